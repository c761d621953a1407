"""--async-scheduling (issue 32, item 8): step N + 1 planned while step N's forward pass runs on
the worker thread, N's tokens placeholders until they land. Exactness is unchanged: the same
tokens with it on and off (greedy and seeded sampling, stops, max_tokens, chunked prefill, tiny
blocks, prefix caching), the differential fuzzer passes with it on (preemption by recompute and
by swap, beams, aborts, late arrivals), and steps really ran ahead."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from tests.conftest import STORIES_HF
from tests.reference.test_differential import CONSTRAINED, check_against, make_workload, unconstrained


def outputs(llm: LLM, prompts, params):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]


def test_the_same_tokens_with_it_on_and_off():
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]}
               for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=i % 3 != 0, logprobs=1)
              for i in range(6)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=30, ignore_eos=True,
                              stop_token_ids=[rng.randrange(3, 512)]) for i in range(6)]
    kw = dict(block_size=4, num_kv_blocks=400, max_num_batched_tokens=16, max_num_seqs=8)
    off = LLM(str(STORIES_HF), **kw)
    on = LLM(str(STORIES_HF), async_scheduling=True, **kw)
    assert outputs(on, prompts, params) == outputs(off, prompts, params)
    stats = on.engine.stats()
    assert stats.num_async_steps > stats.num_steps // 3, (stats.num_async_steps, stats.num_steps)
    assert off.engine.stats().num_async_steps == 0
    on.engine.check_integrity()
    on.engine.core.shutdown()


@pytest.mark.parametrize("setting", range(len(CONSTRAINED)))
def test_the_differential_fuzzer_passes_with_it_on(setting):
    reference = unconstrained()
    stats = []
    for seed in (100 + setting, 200 + setting):
        rng = random.Random(seed)
        settings = dict(CONSTRAINED[setting], watermark=rng.choice([0.0, 0.05]))
        workload = make_workload(rng, rng.randrange(6, 12))
        try:
            stats.append(check_against(reference, settings, workload, async_scheduling=True))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    assert sum(s.num_async_steps for s in stats) > 0


def test_refused_with_what_it_cannot_overlap():
    from kvserve.cli import build_parser

    assert EngineConfig.from_cli_args(build_parser().parse_args(["serve", "--async-scheduling"])).async_scheduling
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=str(STORIES_HF), async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=str(STORIES_HF), async_scheduling=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
