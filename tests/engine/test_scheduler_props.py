"""Property tests of the scheduler over the real KV manager, with no model: a *shadow KV* stands
in for the cache. Each GPU and CPU block is a list of token ids; the queued block moves are
applied to it in the runner's order (swap out, swap in, copies), then the step "writes" each
scheduled token into its slot. Before every write, a sequence's block table must show exactly
its own tokens at every computed position: this checks the contents and the order of the block
moves (copy on write, prefix hits, partial copies, swap), not only the refcounts.

Random interleavings of add (shared prefixes, n > 1 samples, beams), step, abort and forced
preemption, under every prefix cache and preemption mode: after every step the integrity of the
pool, the queues and the statuses holds, the budget and the seat cap hold, and in the end every
request finished (none failed by the watchdog) and every block and CPU block is free again."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.sample.params import SamplingParams
from tests.engine.runner_outputs import runner_output

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [11, 12, 13, 14, 40, 41], [50, 51, 52, 53, 54, 55, 56, 57]]
EMPTY = -1


class ShadowKV:
    """Token ids where the runner would keep K/V: enough to see a wrong block move."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        # indexed by block id: 1..num_blocks (0 is the null block, kv/block_pool.py)
        self.gpu = [[EMPTY] * kv.block_size for _ in range(kv.pool.num_blocks + 1)]
        self.cpu = [[EMPTY] * kv.block_size for _ in range(kv.swap_space.num_blocks)]

    def apply(self, ops) -> None:
        for g, c in ops.swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in ops.swap_in:
            self.gpu[g] = list(self.cpu[c])
        srcs = [list(self.gpu[s]) for s, _ in ops.copies]
        for (_, d), data in zip(ops.copies, srcs):
            self.gpu[d] = data

    def write(self, req: Request, n: int) -> None:
        bs, table = self.kv.block_size, self.kv.block_ids(req.request_id)
        start = req.num_computed_tokens
        seen = [self.gpu[table[p // bs]][p % bs] for p in range(start)]
        assert seen == req.token_ids[:start], f"{req.request_id} reads another sequence's K/V"
        for p in range(start, start + n):
            self.gpu[table[p // bs]][p % bs] = req.token_ids[p]


def fake_token(r: Request) -> int:
    return 100 + (hash((r.request_id, r.num_tokens)) % 7)


def fake_candidates(r: Request, width: int):
    base = sum(r.token_ids) % 5
    ids = [100 + (base + k) % 9 for k in range(2 * width)]
    return ids, [-0.1 * (k + 1) - 0.01 * ((base + k) % 3) for k in range(2 * width)]


def run_step(sched: Scheduler, shadow: ShadowKV, budget: int, max_seqs: int) -> None:
    kv = sched.kv
    queued = {r.request_id for r in sched.waiting} | {r.request_id for g in sched.swapped for r in g}
    out = sched.schedule()
    shadow.apply(kv.take_pending())          # take_pending checks: no read after a write
    assert out.num_batched_tokens <= budget
    ids = {r.request_id for r, _ in out.scheduled}
    assert len(ids) == len(out.scheduled)
    assert not ids & {r.request_id for r in out.preempted}, "a preempted sequence was scheduled"
    if out.preempted:                        # no admission and no swap-in in a step that preempted
        assert not out.swapped_in and not ids & queued, "admitted in a step that preempted"
    samples, candidates = {}, {}
    for req, n in out.scheduled:
        assert n > 0 and req.status == RequestStatus.RUNNING
        table = kv.block_tables[req.request_id]
        assert len(table) * kv.block_size >= req.num_computed_tokens + n
        j = req.num_computed_tokens // kv.block_size
        assert table[j].ref_cnt == 1, "a sequence writes into a block another table holds"
        shadow.write(req, n)
        if req.num_computed_tokens + n == req.num_tokens:
            if req.params.use_beam_search:
                candidates[req.request_id] = fake_candidates(req, req.params.beam_width)
            else:
                for r in [req] + sched.fork_waiters.get(req.request_id, []):
                    samples[r.request_id] = fake_token(r)
    sched.update_from_output(out, runner_output(samples, candidates))
    assert sched.num_seats_taken <= max_seqs
    kv.check_integrity()
    sched.check_integrity()


def abort_or_preempt(op: str, a: int, sched, kv, shadow, groups) -> None:
    """The "abort" (a whole group) and "preempt" (a running sequence) ops of the random
    interleavings, each followed by the integrity checks."""
    if op == "abort" and groups:
        for r in list(groups[a % len(groups)]):
            if not r.is_finished:
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
    elif op == "preempt" and sched.running:
        sched._preempt(sched.running[a % len(sched.running)])
        shadow.apply(kv.take_pending())
    else:
        return
    kv.check_integrity()
    sched.check_integrity()


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.one_of(
           st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 24),
                     st.integers(1, 3), st.booleans()),
           st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0), st.just(0), st.just(False)),
           st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0), st.just(0), st.just(False)),
           st.tuples(st.just("preempt"), st.integers(0, 30), st.just(0), st.just(0), st.just(0), st.just(False))),
           max_size=60),
       max_seqs=st.integers(3, 8), extra_budget=st.integers(0, 40), block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(6, 24), cache=st.sampled_from([None, "hash", "radix"]),
       mode=st.sampled_from(["recompute", "swap"]), num_cpu_blocks=st.integers(0, 30),
       cache_aware=st.booleans(), watermark=st.integers(0, 2))
def test_random_interleavings(ops, max_seqs, extra_budget, block_size, num_blocks, cache, mode,
                              num_cpu_blocks, cache_aware, watermark):
    budget = max_seqs + extra_budget
    kv = KVCacheManager(num_blocks, block_size, prefix_cache=cache, num_cpu_blocks=num_cpu_blocks)
    sched = Scheduler(kv, budget, max_seqs, watermark_blocks=watermark, preemption_mode=mode,
                      cache_aware=cache_aware, max_wait_steps=3)
    shadow = ShadowKV(kv)
    capacity = (num_blocks - watermark) * block_size
    groups: list[list[Request]] = []
    for op, a, b, c, n, beam in ops:
        if op == "add":
            prompt = (PREFIXES[a] + [200 + i for i in range(b)])
            gid = f"g{len(groups)}"
            if beam:             # the engine's add_request checks: the group alone fits
                width = min(n + 1, max_seqs)
                longest = (num_blocks - watermark) // width * block_size - c
                if longest < 1:
                    continue
                prompt = prompt[:longest]
                params = SamplingParams(max_tokens=c, use_beam_search=True, beam_width=width)
                head = Request(f"{gid}#beam0", prompt, params, parent_id=gid, arrival_seq=len(groups))
                group = BeamGroup(gid, width, 1, 1.0, head, [head])
                sched.add_beam_group(group)
                groups.append(group.live)
                continue
            prompt = prompt[:max(1, capacity - c - 2)]
            params = SamplingParams(n=n, max_tokens=c)
            seqs = [Request(f"{gid}#{i}", prompt, params, parent_id=gid, index=i, arrival_seq=len(groups))
                    for i in range(n)]
            sched.add_samples(seqs)
            groups.append(seqs)
        elif op == "step":
            run_step(sched, shadow, budget, max_seqs)
        elif op in ("abort", "preempt"):
            abort_or_preempt(op, a, sched, kv, shadow, groups)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        run_step(sched, shadow, budget, max_seqs)
    assert not sched.has_unfinished(), "a request never finished"
    assert sched.counters.num_failed == 0, "the watchdog failed a request"
    for g in groups:
        assert all(r.is_finished for r in g)
        assert all(r.status != RequestStatus.FINISHED_ERROR for r in g), [r.error for r in g]
    assert all(grp.finished for grp in sched.beam_groups.values())
    kv.take_pending()
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks
    assert not kv.block_tables and not kv.swapped_tables and not kv.cache_state
    assert kv.swap_space.num_free_blocks == num_cpu_blocks
    assert not sched.fork_waiters
