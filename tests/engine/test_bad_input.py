"""Bad input gets a clear ValueError when the request is added, and costs nothing else: the
other requests finish normally and no block leaks."""
from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF


@pytest.fixture(params=[{}, {"quantization": "int8", "quantize_activations": True}, {"quantization": "int4"}],
                ids=["float", "int8-w8a8", "int4"])
def llm(request):
    """The same small engine unquantized and quantized: bad input is handled alike (issue 11)."""
    return LLM(str(STORIES_HF), max_model_len=64, block_size=4, num_kv_blocks=12, **request.param)


BAD_PROMPTS = {
    "too long for max_model_len": ({"prompt_token_ids": [5] * 64}, "max_model_len"),
    "empty": ({"prompt_token_ids": []}, "empty"),
    "token outside vocab": ({"prompt_token_ids": [1, 99999]}, "vocabulary"),
    "bigger than the pool": ({"prompt_token_ids": [5] * 50}, "pool"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_is_rejected_and_others_finish(llm, case):
    prompt, words = BAD_PROMPTS[case]
    eng = llm.engine
    eng.add_request("good-1", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match=words):
        eng.add_request("bad", prompt, SamplingParams(max_tokens=8))
    eng.add_request("good-2", "The cat", SamplingParams(temperature=0, max_tokens=8))
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            eng.check_integrity()
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"good-1", "good-2"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in finished.values())
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_duplicate_request_id(llm):
    llm.engine.add_request("a", "Tom", SamplingParams())
    with pytest.raises(ValueError, match="already"):
        llm.engine.add_request("a", "Tom", SamplingParams())


def test_bad_batch_in_generate_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate(["Tom", {"prompt_token_ids": []}], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["Tom"], SamplingParams(max_tokens=4))[0].finished


def test_sequence_outgrowing_the_pool_finishes_with_length():
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=3)   # 12 token slots in all
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) <= 12 + 1
    llm.engine.check_integrity()


def test_abort_frees_everything(llm):
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", "Once upon a time", SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(5):
        eng.step()
    eng.abort_request(["r0", "r2", "unknown"])
    eng.check_integrity()
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_unknown_model_type_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                       "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(tmp_path))
    cfg = json.loads((STORIES_HF / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_bad_engine_settings():
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(STORIES_HF), dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(STORIES_HF), max_model_len=100000)
