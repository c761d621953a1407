"""Property tests for the scheduler over the real KV manager (no model: a fake token per
sampling sequence). Random add / step / abort interleavings never exceed the token budget or
the seat cap, never leak a block, and every request finishes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.sample.params import SamplingParams


def run_step(sched: Scheduler, budget: int, max_seqs: int) -> None:
    out = sched.schedule()
    assert out.num_batched_tokens <= budget
    assert sum(n for _, n in out.scheduled) == out.num_batched_tokens
    assert len(sched.running) <= max_seqs
    assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
    for req, n in out.scheduled:
        assert req.status == RequestStatus.RUNNING
        assert len(sched.kv.block_tables[req.request_id]) * sched.kv.block_size >= req.num_computed_tokens + n
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(7)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.kv.check_integrity()


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.one_of(
           st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20)),
           st.tuples(st.just("step"), st.just(0), st.just(0)),
           st.tuples(st.just("abort"), st.integers(0, 30), st.just(0))), max_size=80),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4, 16]),
       num_blocks=st.integers(4, 40))
def test_random_interleavings(ops, budget, max_seqs, block_size, num_blocks):
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(kv, budget, max_seqs)
    capacity = num_blocks * block_size
    reqs: list[Request] = []
    for op, a, b in ops:
        if op == "add":
            prompt_len = min(a, capacity - b - 1)
            if prompt_len < 1:
                continue
            r = Request(f"r{len(reqs)}", [5] * prompt_len, SamplingParams(max_tokens=b))
            reqs.append(r)
            sched.add(r)
        elif op == "step":
            run_step(sched, budget, max_seqs)
        elif reqs:
            r = reqs[a % len(reqs)]
            if not r.is_finished:
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
                kv.check_integrity()
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        run_step(sched, budget, max_seqs)
    assert not sched.has_unfinished(), "a request never finished"
    assert all(r.is_finished for r in reqs)
    assert kv.num_free_blocks == num_blocks
