"""Speculative decoding changes no greedy token (seed 004: "the output is the same as the large
model alone would produce"): the differential workloads of test_differential (chunked prefill,
tiny blocks, preemption by recompute and swap, hash and radix prefix hits, n > 1, beams, stop
tokens, aborts) run with speculation on under constrained settings and equal the unconstrained
engine with speculation off; greedy outputs and their logprobs equal transformers' on stories260K
and on random Llama and Qwen3 models. Proposers: the n-gram lookup, a draft that agrees often
(the target itself; the target in int8 or int4) and a draft that never agrees (a random model)."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF
from tests.reference.hf_reference import hf_greedy
from tests.reference.test_differential import (CONSTRAINED, PREFIXES, check_against, check_greedy_against_transformers,
                                               make_workload, run, unconstrained)

K = 3


def proposers(random_model_dir) -> dict[str, dict]:
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "self": {"model": "self", "num_speculative_tokens": K},
        "self-int8": {"model": "self-int8", "num_speculative_tokens": K + 2},
        "self-int4": {"model": "self-int4", "num_speculative_tokens": K},
        "ngram-long": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 4},
        "never": {"model": str(random_model_dir("llama")), "num_speculative_tokens": K},
    }
    for cfg in configs.values():        # every step speculates: the reject path stays hot
        cfg["max_backoff_steps"] = 0
    return configs


def same_with_and_without(w: dict) -> bool:
    """Seeded n == 1 sampling may differ with speculation (other draws); all else must not."""
    return not (w["kind"] == "sample" and w["params"].n == 1)


@pytest.fixture(scope="module")
def reference():
    return unconstrained()


@pytest.mark.parametrize("seed", range(12))
def test_constrained_speculative_engine_equals_unconstrained(reference, random_model_dir, seed):
    rng = random.Random(1000 + seed)
    name = ["ngram", "self", "never", "self-int8", "self-int4", "ngram-long"][seed % 6]
    settings = dict(CONSTRAINED[seed % len(CONSTRAINED)], watermark=rng.choice([0.0, 0.05]))
    workload = [w for w in make_workload(rng, rng.randrange(6, 12)) if same_with_and_without(w)]
    workload += [dict(id=f"copy{i}", prompt=PREFIXES[i] * 2, arrive=i, abort=None, kind="greedy",
                      params=SamplingParams(temperature=0.0, max_tokens=16 + i, ignore_eos=True, logprobs=1))
                 for i in range(2)]
    stats = check_against(reference, settings, workload, speculative_config=proposers(random_model_dir)[name])
    assert stats.spec_decode_num_drafts > 0, (name, settings)
    if name == "self":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    print(seed, name, settings, "drafts", stats.spec_decode_num_drafts, "accepted",
          stats.spec_decode_num_accepted_tokens, "/", stats.spec_decode_num_draft_tokens,
          "preemptions", stats.num_preemptions_total)


@pytest.mark.parametrize("name", ["ngram", "self", "never"])
def test_greedy_with_speculation_equals_transformers(random_model_dir, name):
    """Under pressure (tiny blocks, swap, radix prefix hits, chunked prefill), greedy tokens and
    logprobs with speculation on are transformers' own."""
    rng = random.Random(7)
    workload = [dict(w, abort=None) for w in make_workload(rng, 10) if w["kind"] == "greedy"]
    workload += [dict(id="copy", prompt=PREFIXES[0] * 3, arrive=2, abort=None, kind="greedy",
                      params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0))]
    small = LLM(str(STORIES_HF), block_size=2, num_kv_blocks=24, max_num_batched_tokens=8, max_num_seqs=6,
                preemption_mode="swap", prefix_cache="radix", watermark=0.0,
                speculative_config=proposers(random_model_dir)[name])
    got, _ = run(small, workload, check=True)
    stats = small.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.spec_decode_num_drafts > 0
    if name == "never":
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens // 4
    check_greedy_against_transformers(got, workload, name)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_random_models_with_speculation_equal_transformers(random_model_dir, arch):
    """Random weights (argmax far from the n-gram's guesses), a draft of the same architecture
    (the model itself in int8), chunked prefill and a shared prefix."""
    model = str(random_model_dir(arch))
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5, 9, 33, 41], [1, 5, 9, 5, 9, 5, 9, 5, 9, 77], [3, 4, 3, 4, 3, 4, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"model": "self-int8", "num_speculative_tokens": 4}):
        llm = LLM(model, block_size=2, max_num_batched_tokens=8, max_num_seqs=4, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.stats().spec_decode_num_drafts > 0
        for p, o in zip(prompts, outs):
            ref, ref_lp = hf_greedy(model, p, 20)
            assert o.outputs[0].token_ids == ref, (arch, spec)
            for lp, t, r in zip(o.outputs[0].logprobs, ref, ref_lp):
                assert abs(lp[t].logprob - r) < 1e-4
