"""Pipeline parallelism (kvserve/distributed/pipeline.py, kvserve/model/stages.py): the layers split
into stages, one process each, over gloo with the mp executor. pipeline_parallel_size=2 gives the
greedy tokens of one process and of transformers, logprobs within 1e-4 in float32, under chunked
prefill, tiny blocks, prefix hits and preemption in both modes, with beams, n > 1 and ngram
speculation, on a float model and a natively quantized GGUF; each stage holds only its layers; a
dead stage fails the step at once with a clear error; what is not built is refused. A step runs as
micro-batches flowing through the stages at once (pipeline_micro_batches; by default one per
stage on CUDA, one on the CPU)."""
from __future__ import annotations

import os
import signal

import pytest
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.model.stages import stage_layers, stage_weights, stage_of
from kvserve.model.config import ModelConfig

from tests.conftest import STORIES_HF
from tests.distributed.test_tensor_parallel import CONSTRAINED, MAX_TOKENS, PROMPTS, close, run
from tests.model.test_gguf_tokenizer import SMOLLM2, needs_smollm2
from tests.reference.hf_reference import hf_greedy


@pytest.mark.parametrize("arch,mode", [("qwen3", "recompute"), ("llama3", "swap")])
def test_pp2_equals_pp1_and_transformers(random_model_dir, arch, mode):
    """qwen3: q/k norms; llama3: the LM head tied to the embedding (both on the last stage)."""
    model = str(random_model_dir(arch))
    pp2 = LLM(model, pipeline_parallel_size=2, pipeline_micro_batches=2, preemption_mode=mode, **CONSTRAINED)
    try:
        got = run(pp2)
        stats = pp2.engine.stats()
        stage0 = pp2.engine.core.model
        assert stage0.num_micro_batches_total > stage0.num_steps_total     # steps ran as two micro-batches
    finally:
        close(pp2)
    want = run(LLM(model, preemption_mode=mode, **CONSTRAINED))
    for (toks, lps), (wtoks, wlps), prompt in zip(got, want, PROMPTS):
        assert toks == wtoks
        assert lps == pytest.approx(wlps, abs=1e-4)
        ref_toks, ref_lps = hf_greedy(model, prompt, MAX_TOKENS)
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-4)
    assert stats.prefix_cache_hits_total > 0          # the constraints were exercised
    assert stats.num_preemptions_total > 0


def _texts(llm: LLM, prompts, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


def test_pp3_beams_n_and_speculation_match_one_process():
    """Three stages of stories260K's five layers (2, 2, 1), three micro-batches: beam search (block copies reach every
    stage), n > 1 with seeds (forks), and ngram speculation (several logits rows per sequence)."""
    beams = SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 3, "max_backoff_steps": 0})
    loop = [[1] + [300, 301, 302, 303] * 6]          # a repeating prompt: ngram drafts get accepted
    results = {}
    for pp in (3, 1):
        split = {"pipeline_parallel_size": 3, "pipeline_micro_batches": 3} if pp == 3 else {}
        llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=96, **split)
        try:
            results[pp, "beams"] = _texts(llm, PROMPTS[:2], beams)
            results[pp, "n"] = _texts(llm, PROMPTS[:3], seeded)
        finally:
            close(llm)
        llm = LLM(str(STORIES_HF), **split, **spec)
        try:
            results[pp, "spec"] = run(llm) + [_texts(llm, loop, SamplingParams(temperature=0.0, max_tokens=24,
                                                                                ignore_eos=True))]
            if pp == 3:
                assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
        finally:
            close(llm)
    for kind in ("beams", "n"):
        for got, want in zip(results[3, kind], results[1, kind]):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-3)
    got, want = results[3, "spec"], results[1, "spec"]
    assert got[-1][0][0][0] == want[-1][0][0][0]
    for (toks, lps), (wtoks, wlps) in zip(got[:-1], want[:-1]):
        assert toks == wtoks
        assert lps == pytest.approx(wlps, abs=1e-4)


@needs_smollm2
def test_a_quantized_gguf_splits_too():
    """SmolLM2's Q4_1 file in its own format, kvserve's fused decode kernels on each stage: the
    same tokens as one process; each stage holds about half the weights."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt": "The capital of France is"}, {"prompt": "def fib(n):"}]
    pp2 = LLM(str(SMOLLM2), pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        got = [o.outputs[0].token_ids for o in pp2.generate(prompts, params)]
        stage0 = pp2.engine.core.model.weight_bytes()
    finally:
        close(pp2)
    one = LLM(str(SMOLLM2), num_kv_blocks=64)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        whole = one.engine.core.model.weight_bytes()
    finally:
        close(one)
    assert got == want
    assert stage0 < 0.75 * whole         # half the layers (the tied embedding stays on stage 0)


def test_micro_batches_cut_the_step_evenly_and_in_order():
    from kvserve.worker.model_runner import micro_batch_groups

    def cut(tokens, m):
        return [[n for _, n, _ in g] for g in micro_batch_groups([(None, n, []) for n in tokens], m)]

    assert cut([1, 1, 1, 1], 2) == [[1, 1], [1, 1]]
    assert cut([1, 1, 1, 1, 1], 3) == [[1, 1], [1], [1, 1]]
    assert cut([40, 1, 1], 2) == [[40], [1, 1]]
    assert cut([1, 1, 40], 2) == [[1, 1], [40]]
    assert cut([5], 4) == [[5]] and cut([1, 1], 1) == [[1, 1]] and cut([1, 1], 8) == [[1], [1]]
    for m in (1, 2, 3):     # every sequence once, in order, no group empty
        groups = micro_batch_groups([(i, 1 + i % 3, []) for i in range(10)], m)
        assert [e[0] for g in groups for e in g] == list(range(10)) and all(groups) and len(groups) <= m


@pytest.mark.parametrize("micro", [0, 1, 3])      # 0: the default, one on the CPU
def test_any_micro_batch_count_gives_the_same_answer(micro):
    pp = LLM(str(STORIES_HF), pipeline_parallel_size=2, pipeline_micro_batches=micro, **CONSTRAINED)
    try:
        got = run(pp)
        stage0 = pp.engine.core.model
        assert (stage0.num_micro_batches_total == stage0.num_steps_total) == (micro in (0, 1))
    finally:
        close(pp)
    want = run(LLM(str(STORIES_HF), **CONSTRAINED))
    for (toks, lps), (wtoks, wlps) in zip(got, want):
        assert toks == wtoks
        assert lps == pytest.approx(wlps, abs=1e-4)


def test_a_stage_holds_only_its_layers():
    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=5,
                      num_heads=1, num_kv_heads=1, head_dim=4, tie_word_embeddings=False)
    assert stage_layers(5, 2) == [(0, 3), (3, 2)]
    assert stage_layers(5, 5) == [(i, 1) for i in range(5)]
    weights = {"model.embed_tokens.weight": 0, "lm_head.weight": 1, "model.norm.weight": 2}
    weights.update({f"model.layers.{i}.mlp.down_proj.weight": 10 + i for i in range(5)})
    first = stage_weights(weights, cfg, stage_of(cfg, 0, 2))
    last = stage_weights(weights, cfg, stage_of(cfg, 1, 2))
    assert first == {"model.embed_tokens.weight": 0, **{f"model.layers.{i}.mlp.down_proj.weight": 10 + i
                                                       for i in range(3)}}
    assert last == {"lm_head.weight": 1, "model.norm.weight": 2, "model.layers.0.mlp.down_proj.weight": 13,
                    "model.layers.1.mlp.down_proj.weight": 14}
    tied = stage_weights(weights, ModelConfig(**{**vars(cfg), "tie_word_embeddings": True}), stage_of(cfg, 1, 2))
    assert "model.embed_tokens.weight" in tied         # the tied LM head is the embedding


def test_a_dead_stage_fails_the_step_at_once():
    llm = LLM(str(STORIES_HF), pipeline_parallel_size=2)
    try:
        engine = llm.engine
        engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        stage = engine.core.workers.procs[0]
        os.kill(stage.pid, signal.SIGKILL)
        stage.join(10)
        with pytest.raises(RuntimeError, match="pipeline stage 1 died"):
            engine.step()
    finally:
        close(llm)


def test_what_is_not_built_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's 5 layers"):
        LLM(str(STORIES_HF), pipeline_parallel_size=6)
    for extra, name in (({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                        ({"async_scheduling": True}, "async_scheduling"),
                        ({"kv_tiers": "cpu:64MiB"}, "kv_tiers")):
        with pytest.raises(ValueError, match=f"pipeline_parallel_size > 1 with {name}"):
            EngineConfig(model=str(STORIES_HF), pipeline_parallel_size=2, **extra)
    with pytest.raises(ValueError, match="pipeline_micro_batches needs pipeline_parallel_size > 1"):
        EngineConfig(model=str(STORIES_HF), pipeline_micro_batches=2)
    with pytest.raises(ValueError, match="pipeline_micro_batches must be >= 0"):
        EngineConfig(model=str(STORIES_HF), pipeline_parallel_size=2, pipeline_micro_batches=-1)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(model=str(STORIES_HF), pipeline_parallel_size=0)
    from kvserve.pooling.decoder import DecoderEmbedder
    with pytest.raises(ValueError, match="drop --pipeline-parallel-size"):
        DecoderEmbedder(EngineConfig(model=str(STORIES_HF), pipeline_parallel_size=2))


def test_the_flag_reaches_the_engine():
    import argparse

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    for argv in (["--pipeline-parallel-size", "2"], ["-pp", "2"]):
        assert EngineConfig.from_cli_args(p.parse_args(argv)).pipeline_parallel_size == 2
