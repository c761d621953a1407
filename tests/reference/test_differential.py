"""Differential fuzzing on the real stories260K model: seeded random workloads (greedy, seeded
n > 1 sampling, beams, shared prefixes, stop tokens, late arrivals, aborts) run through a
constrained engine (tiny pool, block sizes 1/2/4, budgets that chunk, recompute or swap,
prefix caching off/hash/radix) and through an unconstrained one (a big pool, a big budget, no
prefix cache). Every request that finished in both must be equal, token for token (prefix-equal
where the constrained run stopped it for length because it outgrew the pool); integrity holds
after every step; no step raises; nothing spins; nothing stays registered; greedy requests
equal `transformers`; and over its seeds each constrained setting really preempted (by
recompute or by swap, as set), shared blocks and copied on write (`check_pressure`)."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF
from tests.reference.hf_reference import hf_greedy

PREFIXES = [[1, 403, 261, 505, 280, 325, 261, 390, 310], [1, 306, 412, 281, 384], [1, 403, 261, 505, 280, 301]]
MAX_STEPS = 4000


def make_workload(rng: random.Random, n: int) -> list[dict]:
    """Requests as plain data: prompt ids, params, the step at which each arrives / is aborted."""
    reqs = []
    for i in range(n):
        prompt = list(rng.choice(PREFIXES)) + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 14))]
        kind = rng.choice(["greedy", "greedy", "sample", "beam"])
        max_tokens = rng.randrange(2, 24)
        if kind == "greedy":
            stop = [rng.randrange(3, 512)] if rng.random() < 0.3 else None
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    stop_token_ids=stop, logprobs=0)
        elif kind == "sample":
            params = SamplingParams(n=rng.randrange(1, 4), temperature=0.9, top_p=0.95, seed=1000 + i,
                                    max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(use_beam_search=True, beam_width=rng.randrange(2, 4),
                                    max_tokens=rng.randrange(2, 10), ignore_eos=True)
        arrive = 0 if rng.random() < 0.6 else rng.randrange(1, 12)
        abort = rng.randrange(arrive + 1, arrive + 20) if rng.random() < 0.1 else None
        reqs.append(dict(id=f"r{i}", prompt=prompt, params=params, arrive=arrive, abort=abort, kind=kind))
    return reqs


def run(llm: LLM, workload: list[dict], check: bool) -> tuple[dict, set]:
    """Drive the workload step by step; returns (finished outputs by id, ids refused at add)."""
    eng = llm.engine
    done, refused, step = {}, set(), 0
    pending = sorted(workload, key=lambda r: r["arrive"])
    while pending or eng.has_unfinished_requests():
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            try:
                eng.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, r["params"])
            except ValueError:
                refused.add(r["id"])
        for r in workload:
            if r["abort"] == step and r["id"] in eng.core.groups:
                eng.abort_request(r["id"])
                done.pop(r["id"], None)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            eng.check_integrity()
        step += 1
        assert step < MAX_STEPS, "the engine spins: requests never finish"
    assert not eng.core.groups and not eng.scheduler.has_unfinished(), "a request stayed registered"
    assert not eng.kv.block_tables and not eng.kv.swapped_tables
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.scheduler.counters.num_failed == 0, [o.outputs[0].error for o in done.values()]
    return done, refused


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


CONSTRAINED = [
    dict(block_size=1, num_kv_blocks=96, max_num_batched_tokens=8, max_num_seqs=6),
    dict(block_size=2, num_kv_blocks=40, max_num_batched_tokens=12, max_num_seqs=6, preemption_mode="swap"),
    dict(block_size=4, num_kv_blocks=15, max_num_batched_tokens=6, max_num_seqs=6, prefix_cache="radix"),
    dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=8,
         preemption_mode="swap", prefix_cache="radix", swap_space=1 << 16),
    dict(block_size=2, num_kv_blocks=30, max_num_batched_tokens=5, max_num_seqs=4,
         enable_prefix_caching=False),
    dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=8, preemption_mode="swap"),
]


def unconstrained(**engine_kwargs) -> LLM:
    """A big pool, a big budget, no prefix cache: no preemption, no chunking."""
    return LLM(str(STORIES_HF), block_size=16, num_kv_blocks=2048, max_num_batched_tokens=4096,
               max_num_seqs=256, enable_prefix_caching=False, watermark=0.0, **engine_kwargs)


def check_against(reference: LLM, settings: dict, workload: list[dict], **engine_kwargs):
    """Run `workload` on a constrained engine and on `reference`; every request finished in both
    must be equal (prefix-equal where the constrained one stopped it for length). Returns the
    constrained engine's stats."""
    small = LLM(str(STORIES_HF), **settings, **engine_kwargs)
    got, refused = run(small, workload, check=True)
    want, _ = run(reference, [dict(w, abort=None) for w in workload if w["id"] not in refused], check=False)
    compared = 0
    for w in workload:
        rid = w["id"]
        if rid not in got or w["abort"] is not None:
            continue
        for i, (x, y) in enumerate(zip(tokens(got[rid]), tokens(want[rid]))):
            if got[rid].outputs[i].finish_reason == "length" and len(x) < len(y):
                assert x == y[:len(x)], (rid, w["kind"], settings)     # outgrew the tiny pool
            else:
                assert x == y, (rid, w["kind"], settings)
        compared += 1
    assert compared > 0
    return small.engine.stats()


def check_model_constrained_equals_unconstrained(model_dir: str, setting: int, seeds, **engine_kwargs) -> None:
    """The random workloads of `seeds` on `model_dir` (another model than stories260K: an MoE, an
    MLA model) under CONSTRAINED[setting] equal an unconstrained engine's, integrity checked
    after every step (check_against's comparison, for any model)."""
    reference = LLM(model_dir, block_size=16, num_kv_blocks=1024, max_num_batched_tokens=4096, max_num_seqs=256,
                    enable_prefix_caching=False, watermark=0.0, **engine_kwargs)
    compared = 0
    for seed in seeds:
        rng = random.Random(seed)
        workload = make_workload(rng, rng.randrange(5, 9))
        small = LLM(model_dir, watermark=0.0, **CONSTRAINED[setting], **engine_kwargs)
        got, refused = run(small, workload, check=True)
        want, _ = run(reference, [dict(w, abort=None) for w in workload if w["id"] not in refused], check=False)
        for w in workload:
            if w["id"] in got and w["abort"] is None:
                for i, (x, y) in enumerate(zip(tokens(got[w["id"]]), tokens(want[w["id"]]))):
                    if got[w["id"]].outputs[i].finish_reason == "length" and len(x) < len(y):
                        y = y[:len(x)]                                   # outgrew the tiny pool
                    assert x == y, (seed, w["id"], w["kind"], CONSTRAINED[setting])
                compared += 1
    assert compared > 0


@pytest.fixture(scope="module")
def reference():
    return unconstrained()


def check_pressure(settings: dict, stats: list) -> None:
    """Over its seeds, a constrained setting exercised what it is there for: preemption (by swap
    or by recompute, as set), prefix-cache hits (when on), copy on write (block size > 1: with
    one-token blocks every shared block is full, so nothing is ever copied) and radix
    partial-block copies. Sums of the engines' `stats()` counters."""
    total = lambda name: sum(getattr(s, name) for s in stats)
    swaps = total("num_swap_preemptions_total")
    if settings.get("preemption_mode", "recompute") == "swap":
        assert swaps > 0, ("never swapped", settings)
    else:
        assert total("num_preemptions_total") - swaps > 0, ("never preempted by recompute", settings)
    if settings.get("enable_prefix_caching", True):
        assert total("prefix_cache_hits_total") > 0, ("no prefix-cache hit", settings)
    if settings["block_size"] > 1:
        assert total("num_cow_copies_total") > 0, ("never copied on write", settings)
    if settings.get("prefix_cache") == "radix":
        assert total("num_partial_block_copies_total") > 0, ("no radix partial-block copy", settings)


SEEDS = range(48)    # seed s runs CONSTRAINED[s % 6]


@pytest.mark.parametrize("setting", range(len(CONSTRAINED)))
def test_constrained_engine_equals_unconstrained(reference, setting):
    stats = []
    for seed in SEEDS[setting::len(CONSTRAINED)]:
        rng = random.Random(seed)
        settings = dict(CONSTRAINED[setting], watermark=rng.choice([0.0, 0.05]))
        workload = make_workload(rng, rng.randrange(6, 12))
        try:
            stats.append(check_against(reference, settings, workload))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    check_pressure(CONSTRAINED[setting], stats)


def test_greedy_under_pressure_equals_transformers(reference):
    """The constrained runs' greedy outputs are the model's: equal to transformers' greedy."""
    rng = random.Random(99)
    workload = [w for w in make_workload(rng, 10) if w["kind"] == "greedy"]
    workload += [dict(id="late", prompt=PREFIXES[0] + [77, 88], arrive=3, abort=None, kind="greedy",
                      params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0))]
    small = LLM(str(STORIES_HF), block_size=2, num_kv_blocks=24, max_num_batched_tokens=6, max_num_seqs=6,
                preemption_mode="swap", prefix_cache="radix", watermark=0.0)
    got, _ = run(small, workload, check=True)
    assert small.engine.stats().num_preemptions_total > 0
    check_greedy_against_transformers(got, workload)


def check_greedy_against_transformers(got: dict, workload: list, label: str = "") -> None:
    """Every greedy request's tokens equal transformers' on stories260K (cut after its stop
    token), and its logprobs within 1e-4."""
    for w in workload:
        out = got[w["id"]].outputs[0]
        ref, ref_lp = hf_greedy(str(STORIES_HF), w["prompt"], len(out.token_ids))
        stop = w["params"].stop_token_ids
        if stop and stop[0] in ref:
            ref = ref[:ref.index(stop[0]) + 1]
        assert out.token_ids == ref, (w["id"], label)
        for lp, t, r in zip(out.logprobs, ref, ref_lp, strict=True):
            assert abs(lp[t].logprob - r) < 1e-4
