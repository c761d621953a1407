"""Property tests of KV sharing under the real scheduler and manager (no model: a fake token per
sampling sequence). Random interleavings of add (prompts sharing prefixes, n > 1 samples that
fork), step, abort and forced preemption, with each prefix cache and each preemption mode, never
leak or double-free a block: after every step the pool's integrity holds, every block's
refcount equals the number of block tables (and pending copies) holding it, the CPU swap space
agrees with the swapped tables, and in the end every block is free again."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.sample.params import SamplingParams

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [11, 12, 13, 14, 40, 41], [50, 51, 52, 53, 54, 55, 56, 57]]


def fake_token(r: Request) -> int:
    return 100 + (hash((r.request_id, r.num_tokens)) % 7)


def run_step(sched: Scheduler, budget: int, max_seqs: int) -> None:
    kv = sched.kv
    out = sched.schedule()
    kv.take_pending()               # the engine runs these block moves before the forward pass
    assert out.num_batched_tokens <= budget
    assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
    for req, n in out.scheduled:
        assert n > 0 and req.status == RequestStatus.RUNNING
        table = kv.block_tables[req.request_id]
        assert len(table) * kv.block_size >= req.num_computed_tokens + n
        # The block written first is private (copy on write happened if it was shared).
        j = req.num_computed_tokens // kv.block_size
        assert table[j].ref_cnt == 1, "a sequence writes into a block another table holds"
    sched.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            seqs = [req]
            for child in list(req.pending_forks):
                sched.fork(req, child)
                seqs.append(child)
            req.pending_forks = []
            req.extra_seats = 0
            for r in seqs:
                r.token_ids.append(fake_token(r))
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
    kv.check_integrity()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.one_of(
           st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 12), st.integers(1, 3)),
           st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0), st.just(0)),
           st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0), st.just(0)),
           st.tuples(st.just("preempt"), st.integers(0, 30), st.just(0), st.just(0), st.just(0))),
           max_size=60),
       budget=st.integers(1, 48), max_seqs=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(12, 40), cache=st.sampled_from([None, "hash", "radix"]),
       mode=st.sampled_from(["recompute", "swap"]), num_cpu_blocks=st.integers(0, 30),
       cache_aware=st.booleans())
def test_sharing_never_leaks(ops, budget, max_seqs, block_size, num_blocks, cache, mode, num_cpu_blocks,
                             cache_aware):
    kv = KVCacheManager(num_blocks, block_size, prefix_cache=cache, num_cpu_blocks=num_cpu_blocks)
    sched = Scheduler(kv, budget, max_seqs, watermark_blocks=1, preemption_mode=mode,
                      cache_aware=cache_aware, max_wait_steps=3)
    capacity = num_blocks * block_size
    groups: list[list[Request]] = []
    for op, a, b, c, n in ops:
        if op == "add":
            prompt = (PREFIXES[a] + [200 + i for i in range(b)])
            prompt = prompt[:max(1, capacity - c - 2)]
            gid = f"g{len(groups)}"
            params = SamplingParams(n=n, max_tokens=c)
            seqs = [Request(f"{gid}#{i}", prompt, params, parent_id=gid, index=i) for i in range(n)]
            for child in seqs[1:]:
                child.fork_parent = seqs[0]
                seqs[0].pending_forks.append(child)
            seqs[0].extra_seats = n - 1
            sched.add(seqs[0])
            groups.append(seqs)
        elif op == "step":
            run_step(sched, budget, max_seqs)
        elif op == "abort" and groups:
            for r in groups[a % len(groups)]:
                if not r.is_finished:
                    sched.finish(r, RequestStatus.FINISHED_ABORTED)
            kv.check_integrity()
        elif op == "preempt" and sched.running:
            sched.preempt(sched.running[a % len(sched.running)])
            kv.take_pending()
            kv.check_integrity()
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        run_step(sched, budget, max_seqs)
    assert not sched.has_unfinished(), "a request never finished"
    assert all(r.is_finished for g in groups for r in g)
    kv.take_pending()
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks
    assert not kv.block_tables and not kv.swapped_tables
    assert kv.swap_space.num_free_blocks == num_cpu_blocks
