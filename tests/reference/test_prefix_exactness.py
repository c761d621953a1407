"""Prefix caching and swapping are lossless: greedy tokens equal transformers' and logprobs agree
within 1e-4 with prefix caching off, with the hash chain and with the radix tree (cache-aware
ordering on), including prompts that are fully cached and block-aligned (the hit is capped so the
last prompt token is computed), prompts that hit after their own request was preempted, heavy
memory pressure (evictions while requests share blocks), chunked prefill over a hit, and
preemption by swap instead of recompute."""
from __future__ import annotations

import functools
import random

import pytest

from kvserve import LLM, SamplingParams
from tests.reference.hf_reference import hf_greedy

MAX_TOKENS = 10
CACHES = {"off": dict(enable_prefix_caching=False), "hash": dict(prefix_cache="hash"),
          "radix": dict(prefix_cache="radix")}
SCENARIOS = {
    "shared": dict(block_size=4, num_kv_blocks=256),
    "chunked": dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=256),
    "pressure": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
    "swap": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8, preemption_mode="swap"),
}


def shared_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts over one 23-token system prefix; lengths include multiples of the block size
    (24, 28, 32) and one prompt that is a prefix of another."""
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 512) for _ in range(22)]
    out = []
    for extra in (1, 5, 9, 13, 2, 17):
        out.append(system + [rng.randrange(3, 512) for _ in range(extra)])
    out.append(out[2][:20])
    return out


@functools.lru_cache(maxsize=256)
def reference(model_dir: str, prompt: tuple) -> tuple:
    return hf_greedy(model_dir, list(prompt), MAX_TOKENS)


def check_outputs(model_dir, prompts, outs):
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lps = reference(str(model_dir), tuple(p))
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("cache", list(CACHES))
def test_prefix_caching_is_lossless(cache, scenario, random_model_dir):
    model_dir = random_model_dir("llama")
    llm = LLM(str(model_dir), **SCENARIOS[scenario], **CACHES[cache])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = shared_prompts()
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_outputs(model_dir, prompts, first)
    # Again: now most prompts are cached, the block-aligned ones in full.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_outputs(model_dir, prompts, again)
    eng = llm.engine
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    st = eng.stats()
    if cache == "off":
        assert st.prefix_cache_hits_total == 0 and all(o.num_cached_tokens == 0 for o in again)
    else:
        assert st.prefix_cache_hits_total > 0
        assert any(o.num_cached_tokens > 0 for o in again)
        # The cap: every cached prompt still computed at least its last token.
        assert all(o.num_cached_tokens < len(o.prompt_token_ids) for o in first + again)
    if scenario in ("pressure", "swap"):
        assert st.num_preemptions_total > 0
        if cache != "off":
            assert st.num_evictions_total > 0
    if scenario == "swap":
        assert st.num_swap_preemptions_total > 0 and st.num_swap_in_blocks_total > 0


@pytest.mark.parametrize("cache", ["hash", "radix"])
def test_block_aligned_prompt_fully_cached_still_produces_its_first_token(cache, random_model_dir):
    model_dir = random_model_dir("qwen3")
    llm = LLM(str(model_dir), block_size=8, num_kv_blocks=64, **CACHES[cache])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompt = [1] + list(range(40, 71))            # 32 tokens: exactly 4 blocks
    outs = [llm.generate({"prompt_token_ids": prompt}, params)[0] for _ in range(3)]
    check_outputs(model_dir, [prompt] * 3, outs)
    assert outs[0].num_cached_tokens == 0
    expected = 24 if cache == "hash" else 31      # hash: whole last block recomputed; radix: one token
    assert outs[1].num_cached_tokens == expected and outs[2].num_cached_tokens == expected


def test_hits_after_preemption_are_exact(random_model_dir):
    """A tiny pool: requests are preempted mid-decode and resume as cache hits on their own
    still-labelled blocks (recompute mostly from the cache)."""
    model_dir = random_model_dir("llama")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=8,
              watermark=0.0, prefix_cache="hash")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (10, 11, 12)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_outputs(model_dir, prompts, outs)
    st = llm.engine.stats()
    assert st.num_preemptions_total > 0
    # The prompts share nothing: every hit is a re-admitted request finding its own blocks.
    assert st.prefix_cache_hits_total > 0
