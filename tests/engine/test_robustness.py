"""Regression tests for the robustness issue's defects, each on the configuration that showed
it, and for the preemption rules of the seeds. Every test here failed (or hung) before the
engine step was rebuilt around named request states."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.request import IllegalTransition, Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from tests.engine.runner_outputs import runner_output
from tests.conftest import STORIES_HF
from tests.reference.hf_reference import hf_greedy
from tests.reference.test_differential import make_workload, run

# Every test here runs on the model-dtype KV cache and again on an int8 one (conftest.kv_cache_dtype).
pytestmark = pytest.mark.usefixtures("kv_cache_dtype")

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=0)


def drive(llm: LLM, requests: list[tuple[str, list[int], SamplingParams, int]], max_steps: int = 3000):
    """Add (id, prompt ids, params, arrival step) requests at their steps; step to the end,
    checking integrity after every step. Returns the finished outputs by id."""
    eng, done = llm.engine, {}
    pending = sorted(requests, key=lambda r: r[3])
    for step in range(max_steps):
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
        if not pending and not eng.has_unfinished_requests():
            break
    else:
        raise AssertionError("requests never finished")
    assert not eng.core.groups and eng.get_num_unfinished_requests() == 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return done


@pytest.mark.parametrize("seed, defect", [(11, "greedy outputs corrupted"), (3, "engine spins")])
def test_swap_with_beams_is_exact_and_finishes(seed, defect, kv_cache_dtype):
    """Defects 1 and 2, on the issue's configuration: under swap, a group swapped in and out in
    one step corrupted KV (seed 11: beam, sampled and greedy outputs wrong, greedy unlike
    transformers), and an idle beam group swapped out and back never advanced (seed 3: the
    engine spun for ever). Workloads from the differential harness: beams of widths 2-3,
    greedy and sampled requests, some arriving late. (An int8 cache is not transformers'
    model: there the check is the big-pool engine on the same cache.)"""
    workload = [dict(w, abort=None) for w in make_workload(random.Random(seed), 10)]
    small = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=15, watermark=0.0, preemption_mode="swap",
                max_num_batched_tokens=64, max_num_seqs=8)
    got, refused = run(small, workload, check=True)
    assert small.engine.stats().num_swap_preemptions_total > 0
    big = LLM(str(STORIES_HF), num_kv_blocks=512, enable_prefix_caching=False)
    want, _ = run(big, [w for w in workload if w["id"] not in refused], check=False)
    for w in workload:
        if w["id"] in refused:
            continue
        out = got[w["id"]]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want[w["id"]].outputs], w
        if w["kind"] == "greedy" and not w["params"].stop_token_ids and kv_cache_dtype == "auto":
            ref, _ = hf_greedy(str(STORIES_HF), w["prompt"], len(out.outputs[0].token_ids))
            assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("n", [1, 2])
def test_outgrowing_the_pool_while_chunked_finishes_with_length(n):
    """Defect 3: preempted and re-admitted in the same schedule(), then finished while still
    scheduled: IndexError in the runner (the server's engine thread died)."""
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=3, max_num_batched_tokens=4, max_num_seqs=4,
              enable_prefix_caching=False)
    prompt = [1] + list(range(300, 310))                     # 11 tokens: 12 slots hold 1 more
    params = SamplingParams(n=n, max_tokens=10, seed=3, **({"temperature": 0.0} if n == 1 else {}))
    out = drive(llm, [("big", prompt, params, 0), ("after", [1, 5, 6], SamplingParams(max_tokens=3), 1)])
    for c in out["big"].outputs:
        assert c.finish_reason == "length" and 1 <= len(c.token_ids) < 10
    assert out["after"].outputs[0].finish_reason == "length"


def test_a_lone_request_that_outgrows_the_pool_is_retired():
    """Defect 4: the early-return path of step() returned the output but never retired it."""
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=2, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=False)
    out = drive(llm, [("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, **GREEDY), 0)])
    assert out["r"].outputs[0].finish_reason == "length"
    assert not llm.engine.requests and not llm.engine.output.requests


def test_seat_cap_holds_for_samples_and_beams():
    """Defect 8: with max_num_seqs=1, n=4 ran four sequences at once; now it is refused, and
    groups that fit never take more than max_num_seqs seats (check_integrity after every step)."""
    llm = LLM(str(STORIES_HF), max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="n=4 .* max_num_seqs is 2"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(n=4))
    with pytest.raises(ValueError, match="beam_width=3 .* max_num_seqs is 2"):
        llm.engine.add_request("y", [1, 2, 3], SamplingParams(use_beam_search=True, beam_width=3))
    assert not llm.engine.core.groups
    drive(llm, [("a", [1, 2, 3], SamplingParams(n=2, seed=1, max_tokens=8), 0),
                ("b", [1, 4, 5], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=5), 0),
                ("c", [1, 6], SamplingParams(max_tokens=8), 2)])


def test_budget_below_seat_cap_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        LLM(str(STORIES_HF), max_num_batched_tokens=8, max_num_seqs=16)


def test_victim_is_the_latest_arrival_not_the_latest_admitted():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    late = Request("late", [1] * 8, SamplingParams(max_tokens=9), arrival_time=2.0)
    early = Request("early", [1] * 8, SamplingParams(max_tokens=9), arrival_time=1.0)
    sched.add(late)                      # admitted first (as cache-aware ordering may do)
    sched.add(early)
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["late", "early"]
    sched.update_from_output(out, runner_output({"late": 5, "early": 5}, {}))
    out = sched.schedule()               # both need a third block; the pool has none
    assert [r.request_id for r in out.preempted] == ["late"]
    assert [r.request_id for r, _ in out.scheduled] == ["early"]


def test_transitions_are_checked():
    r = Request("r", [1, 2], SamplingParams())
    with pytest.raises(IllegalTransition, match="WAITING -> SWAPPED"):
        r.transition(RequestStatus.SWAPPED)
    r.transition(RequestStatus.FINISHED_ABORTED)
    with pytest.raises(IllegalTransition):
        r.transition(RequestStatus.RUNNING)


def test_a_stall_fails_the_stuck_requests_with_a_clear_error(monkeypatch):
    """The watchdog: requests unfinished and nothing schedulable for stall_steps steps become
    finish_reason 'error' with a message, instead of a silent spin."""
    llm = LLM(str(STORIES_HF))
    eng = llm.engine
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    monkeypatch.setattr(eng.scheduler, "_admit", lambda out, done: None)   # simulate a stuck queue
    outs = []
    for _ in range(eng.scheduler.stall_steps):
        outs += eng.step()
    assert len(outs) == 1 and outs[0].finished
    c = outs[0].outputs[0]
    assert c.finish_reason == "error" and "no progress" in c.error
    assert not eng.has_unfinished_requests() and not eng.core.groups


def test_one_failing_request_does_not_stop_the_others(monkeypatch):
    """A request whose output processing or sampling raises fails alone; the step goes on."""
    llm = LLM(str(STORIES_HF))
    eng = llm.engine
    ref = llm.generate([{"prompt_token_ids": [1, 403, 261]}], SamplingParams(max_tokens=10, **GREEDY))
    orig_check = eng.output._stop_string

    def bad_check(params, seq, token_id):
        if seq.detok.tokens[:2] == [1, 5]:          # the "bad-stop" request's prompt
            raise RuntimeError("detokenizer exploded")
        return orig_check(params, seq, token_id)

    orig_sampler = eng.core.runner.sampling.sampler

    def bad_sampler(logits, reqs):
        if any(r.request_id == "bad-sample" for r in reqs):
            raise RuntimeError("sampler exploded")
        return orig_sampler(logits, reqs)

    monkeypatch.setattr(eng.output, "_stop_string", bad_check)
    monkeypatch.setattr(eng.core.runner.sampling, "sampler", bad_sampler)
    got = drive(llm, [("good", [1, 403, 261], SamplingParams(max_tokens=10, **GREEDY), 0),
                      ("bad-stop", [1, 5, 6], SamplingParams(max_tokens=10), 0),
                      ("bad-sample", [1, 7, 8], SamplingParams(max_tokens=10), 0)])
    assert got["good"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert got["bad-stop"].outputs[0].finish_reason == "error"
    assert "detokenizer exploded" in got["bad-stop"].outputs[0].error
    assert got["bad-sample"].outputs[0].finish_reason == "error"
    assert "sampler exploded" in got["bad-sample"].outputs[0].error
