"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log_softmax of the
full-sequence logits at every prompt position within 1e-4, in vLLM's shape ([None, {token:
Logprob(logprob, rank, decoded_token)}, ...], the prompt token plus the top k): on a
random-weight Llama and on stories260K, with whole and chunked prefill, after a prefix-cache
hit would have served the prompt, through preemption by recompute and by swap, and for n > 1
and beam search (recorded once per request)."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF
from tests.reference.hf_reference import load_hf

TOL = 1e-4
CHUNKED = dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4)
SCENARIOS = {"whole": dict(block_size=16), "chunked": CHUNKED}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in (1, 2, 5, 13, 30)]


@functools.lru_cache(maxsize=64)
def hf_logprobs(model_dir: str, prompt: tuple) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position, [P, V] float32."""
    with torch.inference_mode():
        logits = load_hf(model_dir)(torch.tensor([list(prompt)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(model_dir, prompt: list[int], entries: list, k: int) -> None:
    ref = hf_logprobs(str(model_dir), tuple(prompt))
    assert entries is not None and len(entries) == len(prompt), "one entry per prompt token"
    assert entries[0] is None
    for j in range(1, len(prompt)):
        row, entry, tok = ref[j - 1], entries[j], prompt[j]
        got = entry[tok]
        assert abs(got.logprob - float(row[tok])) < TOL, f"token {j}"
        # rank: 1 + the number of tokens more likely (ties within the tolerance either way)
        assert int((row > row[tok] + TOL).sum()) + 1 <= got.rank <= int((row > row[tok] - TOL).sum()) + 1
        assert isinstance(got.decoded_token, str)
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        want = row.topk(k).values.tolist()
        assert max((abs(a.logprob - b) for a, b in zip(top, want)), default=0.0) < TOL
        assert len(entry) in (k, k + 1)          # the top k, plus the prompt token if not among them


@pytest.fixture(params=["llama", "stories260K"])
def model_dir(request, random_model_dir):
    return random_model_dir("llama") if request.param == "llama" else STORIES_HF


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prompt_logprobs_equal_transformers(model_dir, scenario):
    llm = LLM(str(model_dir), **SCENARIOS[scenario])
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4))
    for p, out in zip(ps, outs):
        check(model_dir, p, out.prompt_logprobs, 4)
    plain = llm.generate({"prompt_token_ids": ps[-1]}, SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None           # not asked for: no extra rows computed
    llm.engine.check_integrity()


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_prompt_logprobs_skip_the_prefix_cache(model_dir, cache):
    """The prompt is cached by a first request; a second one asking for prompt logprobs still
    computes (and reports) every position; a third one, not asking, hits the cache."""
    llm = LLM(str(model_dir), prefix_cache=cache, **CHUNKED)
    p = prompts(1)[-1]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": p}, params)
    hits = llm.engine.stats().prefix_cache_hits_total
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    check(model_dir, p, out.prompt_logprobs, 0)
    assert out.num_cached_tokens == 0 and llm.engine.stats().prefix_cache_hits_total == hits
    again = llm.generate({"prompt_token_ids": p}, params)[0]
    assert again.num_cached_tokens > 0, "the cache was warm: the skip above was the rule, not luck"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_through_preemption(mode):
    """A pool too small for the load preempts prompt-logprob requests (mid-prefill and after);
    their entries are recorded once and stay exact."""
    model_dir = STORIES_HF
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=4,
              preemption_mode=mode)
    rng = random.Random(7)
    ps = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (29, 23, 31, 26, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    assert llm.engine.stats().num_preemptions_total > 0
    for p, out in zip(ps, outs):
        check(model_dir, p, out.prompt_logprobs, 2)


def test_prompt_logprobs_with_n_and_beams():
    model_dir = STORIES_HF
    llm = LLM(str(model_dir), **CHUNKED)
    p = prompts(2)[-2]
    sampled = llm.generate({"prompt_token_ids": p},
                           SamplingParams(n=3, seed=5, max_tokens=4, prompt_logprobs=1))[0]
    assert len(sampled.outputs) == 3
    check(model_dir, p, sampled.prompt_logprobs, 1)
    beams = llm.generate({"prompt_token_ids": p}, SamplingParams(n=2, use_beam_search=True, beam_width=2,
                                                                 temperature=0.0, max_tokens=4,
                                                                 prompt_logprobs=1))[0]
    check(model_dir, p, beams.prompt_logprobs, 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_prompt_logprobs_bounds(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
    SamplingParams(prompt_logprobs=0)
    SamplingParams(prompt_logprobs=20)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=10).verify_for_model(8)
