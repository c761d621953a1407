"""Property tests of speculative decoding's bookkeeping over the real scheduler and KV manager,
with no model (the shadow KV of test_scheduler_props stands in for the cache; drafts are marked
there until verified).

Random interleavings of adds (shared prefixes, n > 1 samples, which never speculate; beams
are covered by test_scheduler_props and never speculate either), steps with random drafts and
random acceptance lengths, aborts and forced preemption, under every prefix cache and
preemption mode: after every step integrity holds, every sequence reads exactly its own tokens'
K/V at every computed position (so rollback kept nothing rejected), a sequence that verified
drafts holds no block past its computed tokens, and no labelled block (hash or radix) holds an
unverified draft; in the end every block is free again."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.kv.radix_cache import RADIX_LABEL
from kvserve.sample.params import SamplingParams
from tests.engine.runner_outputs import runner_output
from tests.engine import test_scheduler_props as base


class DraftShadow(base.ShadowKV):
    """ShadowKV plus the set of (block, offset) slots holding unverified draft K/V."""

    def __init__(self, kv):
        super().__init__(kv)
        self.unverified: set[tuple[int, int]] = set()

    def apply(self, ops) -> None:
        """Block moves carry the unverified marks with the contents."""
        bs, marks = self.kv.block_size, self.unverified
        cpu = {(c, o) for g, c in ops.swap_out for o in range(bs) if (g, o) in marks}
        self.cpu_unverified = getattr(self, "cpu_unverified", set())
        self.cpu_unverified -= {(c, o) for _, c in ops.swap_out for o in range(bs)}
        self.cpu_unverified |= cpu
        moved = [(g, o, (c, o) in self.cpu_unverified) for c, g in ops.swap_in for o in range(bs)]
        moved += [(d, o, (s, o) in marks) for s, d in ops.copies for o in range(bs)]
        for g, o, m in moved:
            (marks.add if m else marks.discard)((g, o))
        super().apply(ops)

    def write_run(self, req: Request, n: int, drafts: list[int]) -> None:
        bs, table = self.kv.block_size, self.kv.block_ids(req.request_id)
        start = req.num_computed_tokens
        seen = [self.gpu[table[p // bs]][p % bs] for p in range(start)]
        assert seen == req.token_ids[:start], f"{req.request_id} reads K/V that is not its own"
        toks = req.token_ids + drafts
        for p in range(start, start + n):
            slot = (table[p // bs], p % bs)
            self.gpu[slot[0]][slot[1]] = toks[p]
            if p >= req.num_tokens:
                self.unverified.add(slot)
            else:
                self.unverified.discard(slot)

    def verified(self, table: list[int], lo: int, hi: int) -> None:
        bs = self.kv.block_size
        for p in range(lo, hi):
            self.unverified.discard((table[p // bs], p % bs))

    def check_labels(self) -> None:
        kv, bs = self.kv, self.kv.block_size
        for b in kv.pool.blocks:
            if b.block_hash is None:
                continue
            n = bs
            if b.block_hash == RADIX_LABEL:
                node = kv.cache.nodes[b.block_id]
                n = len(node.key)
                assert self.gpu[b.block_id][:n] == list(node.key), "a radix node's block holds other tokens"
            bad = [o for o in range(n) if (b.block_id, o) in self.unverified]
            assert not bad, f"block {b.block_id} is labelled but holds unverified drafts at {bad}"


def spec_step(sched: Scheduler, shadow: DraftShadow, rng: random.Random, budget: int) -> None:
    kv = sched.kv
    cands = sched.spec_candidates()
    for req, k in cands:
        assert req.params.n == 1 and not req.params.use_beam_search and k <= sched.num_speculative_tokens
    drafts = {r.request_id: [rng.randrange(100, 104) for _ in range(rng.randrange(0, k + 1))]
              for r, k in cands if rng.random() < 0.8}
    out = sched.schedule(drafts)
    shadow.apply(kv.take_pending())
    assert out.num_batched_tokens <= budget
    for rid, d in out.draft_tokens.items():
        assert d and d == drafts[rid][:len(d)], "the scheduler invented drafts"
    samples, candidates, before = {}, {}, {}
    for req, n in out.scheduled:
        d = out.draft_tokens.get(req.request_id, [])
        table = kv.block_tables[req.request_id]
        assert len(table) * kv.block_size >= req.num_computed_tokens + n
        assert table[req.num_computed_tokens // kv.block_size].ref_cnt == 1, "writes a shared block"
        if d:
            assert n == 1 + len(d) and req.num_tokens - req.num_computed_tokens == 1
            assert all(b.ref_cnt == 1 for b in table[req.num_computed_tokens // kv.block_size:])
        shadow.write_run(req, n, d)
        if req.num_computed_tokens + n == req.num_tokens + len(d):
            if req.params.use_beam_search:
                candidates[req.request_id] = base.fake_candidates(req, req.params.beam_width)
            elif d:
                a = rng.randrange(0, len(d) + 1)                 # a random acceptance length
                samples[req.request_id] = d[:a] + [base.fake_token(req)]
                before[req.request_id] = (req, req.num_computed_tokens, list(kv.block_ids(req.request_id)))
            else:
                for r in [req] + sched.fork_waiters.get(req.request_id, []):
                    samples[r.request_id] = base.fake_token(r)
    sched.update_from_output(out, runner_output(samples, candidates))
    for rid, (req, start, table) in before.items():
        assert req.num_computed_tokens <= start + len(samples[rid])
        shadow.verified(table, start + 1, req.num_computed_tokens)
        if not req.is_finished:
            assert req.num_tokens - req.num_computed_tokens == 1
            assert kv.num_held_blocks(rid) == cdiv(req.num_computed_tokens, kv.block_size), "rollback kept a block"
    kv.check_integrity()
    sched.check_integrity()
    shadow.check_labels()


ADD = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 30),
                st.integers(1, 3), st.integers(0, 5))
STEP = st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0), st.just(0), st.just(0))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(ADD, ADD, STEP, STEP,
           st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0), st.just(0), st.just(0)),
           st.tuples(st.just("preempt"), st.integers(0, 30), st.just(0), st.just(0), st.just(0), st.just(0))),
           min_size=4, max_size=50),
       k=st.integers(1, 6), max_seqs=st.integers(2, 6), extra_budget=st.integers(0, 30),
       block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 30),
       cache=st.sampled_from([None, "hash", "radix"]), mode=st.sampled_from(["recompute", "swap"]),
       num_cpu_blocks=st.integers(0, 30), off=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**16))
def test_random_drafts_and_acceptance(ops, k, max_seqs, extra_budget, block_size, num_blocks, cache,
                                      mode, num_cpu_blocks, off, seed):
    rng = random.Random(seed)
    budget = max_seqs + extra_budget
    kv = KVCacheManager(num_blocks, block_size, prefix_cache=cache, num_cpu_blocks=num_cpu_blocks)
    sched = Scheduler(kv, budget, max_seqs, preemption_mode=mode, max_model_len=64,
                      num_speculative_tokens=k, spec_disable_by_batch_size=off)
    shadow = DraftShadow(kv)
    groups: list[list[Request]] = []
    for op, a, b, c, n, kind in ops:
        if op == "add":
            prompt = base.PREFIXES[a] + [200 + i for i in range(b)]
            gid = f"g{len(groups)}"
            n = min(n, max_seqs) if kind == 4 else 1     # add_request: n <= max_num_seqs
            prompt = prompt[:max(1, num_blocks * block_size - c - 2)]
            seqs = [Request(f"{gid}#{i}", prompt, SamplingParams(n=n, max_tokens=c), parent_id=gid,
                            index=i, arrival_seq=len(groups)) for i in range(n)]
            sched.add_samples(seqs)
            groups.append(seqs)
        elif op == "step":
            spec_step(sched, shadow, rng, budget)
        elif op in ("abort", "preempt"):
            base.abort_or_preempt(op, a, sched, kv, shadow, groups)
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        spec_step(sched, shadow, rng, budget)
    assert not sched.has_unfinished(), "a request never finished"
    assert sched.counters.num_failed == 0, "the watchdog failed a request"
    for g in groups:
        assert all(r.is_finished and r.status != RequestStatus.FINISHED_ERROR for r in g)
        for r in g:          # max_tokens holds even when a run overshoots it
            assert r.num_output_tokens <= r.params.max_tokens or r.params.use_beam_search
    kv.take_pending()
    kv.check_integrity()
    assert kv.num_free_blocks == num_blocks, "a block leaked"
    assert not kv.block_tables and not kv.swapped_tables and not kv.cache_state
