"""kvserve's greedy tokens equal transformers' on the same weights, and logprobs agree within
1e-4 (float32), however the engine cuts and packs the work: block sizes, token budgets that
chunk every prompt, one or many sequences per step, and pools small enough to preempt."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.reference.hf_reference import hf_greedy

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = 12


def prompts_for(seed: int = 0, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


ENGINE_SETTINGS = {
    "default": dict(),
    "block1": dict(block_size=1),
    "block4_budget7": dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4),
    "one_seq": dict(max_num_seqs=1, max_num_batched_tokens=16),
    "preempt": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
}


def check(model_dir, settings, prompts, expect_preemption=False):
    llm = LLM(str(model_dir), **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(str(model_dir), p, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
    if expect_preemption:
        assert llm.engine.stats().num_preemptions_total > 0
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch, random_model_dir):
    check(random_model_dir(arch), {}, prompts_for(1))


@pytest.mark.parametrize("setting", [s for s in ENGINE_SETTINGS if s != "default"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scheduling_does_not_change_outputs(arch, setting, random_model_dir):
    check(random_model_dir(arch), ENGINE_SETTINGS[setting], prompts_for(2),
          expect_preemption=setting == "preempt")
