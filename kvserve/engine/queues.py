"""Where every unfinished sequence is, and the legal moves between places (the bookkeeping half
of the scheduler; `engine/scheduler.py` is the policy half that decides who runs).

Places: `waiting` (WAITING, PREEMPTED), `running` (RUNNING, WAITING_FOR_BEAMS: a seat and KV
blocks), `swapped` (SWAPPED groups, KV in the CPU swap space), `fork_waiters` (WAITING_FOR_FORK
samples of n > 1, waiting for sample 0's prefill). Every move here pairs the queue change with
the status transition (`Request.transition`) and the KV change (`kv/manager.py`), so the three
never disagree; `check_integrity` verifies it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.fairness import FCFSPolicy
from kvserve.engine.request import GRAMMAR_ERROR, Request, RequestStatus
from kvserve.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)
S = RequestStatus


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0                 # sequences preempted, either way
    num_swap_preemptions: int = 0            # of which by swap
    num_repeatedly_preempted: int = 0        # sequences that reached the warn threshold
    max_preemptions_per_request: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_failed: int = 0                      # sequences finished with an error (not their grammar's)
    num_grammar_errors: int = 0              # sequences their own grammar failed (GRAMMAR_ERROR)


class RequestQueues:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, preemption_mode: str = "recompute",
                 preemption_warn_threshold: int = 3):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}.")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.preemption_warn_threshold = preemption_warn_threshold
        self.waiting: deque[Request] = deque()          # WAITING, PREEMPTED
        self.running: list[Request] = []                # RUNNING, WAITING_FOR_BEAMS: seated
        self.swapped: deque[list[Request]] = deque()    # SWAPPED groups, oldest first
        self.fork_waiters: dict[str, list[Request]] = {}  # sample 0's id -> WAITING_FOR_FORK
        self.beam_groups: dict[str, BeamGroup] = {}
        self.finished_seq_ids: list[str] = []           # finished since the worker was last told
        self.step_count = 0
        self.counters = SchedulerCounters()
        self.policy = FCFSPolicy()      # who waits first, who is preempted first (engine/fairness.py)

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.enqueue_step = self.step_count
        self.policy.on_arrival(req, self)
        self.waiting.append(req)

    def add_samples(self, seqs: list[Request]) -> None:
        """n > 1 sharing: sample 0 is queued; the others fork it when its prefill is done."""
        self.add(seqs[0])
        if len(seqs) > 1:
            for r in seqs[1:]:
                r.transition(S.WAITING_FOR_FORK)
            self.fork_waiters[seqs[0].request_id] = list(seqs[1:])

    def add_beam_group(self, group: BeamGroup) -> None:
        group.head.extra_seats = group.width - 1
        self.beam_groups[group.request_id] = group
        self.add(group.head)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_swapped(self) -> int:
        return sum(len(g) for g in self.swapped)

    def seats(self, req: Request) -> int:
        """Seats a sequence takes: its own and those reserved for the forks it will make."""
        return 1 + req.extra_seats + len(self.fork_waiters.get(req.request_id, ()))

    @property
    def num_seats_taken(self) -> int:
        return sum(self.seats(r) for r in self.running)

    def finish(self, req: Request, status: RequestStatus, error: str | None = None,
               error_code: str | None = None) -> None:
        """Retire a sequence (stopped, out of length, aborted, pruned, failed: `error` says why,
        `error_code` GRAMMAR_ERROR when its grammar failed it); free its KV."""
        s = req.status
        if s.holds_blocks:
            self.running.remove(req)
        elif s in (S.WAITING, S.PREEMPTED):
            self.waiting.remove(req)
        elif s == S.SWAPPED:
            group = next(g for g in self.swapped if req in g)
            group.remove(req)
            if not group:
                self.swapped.remove(group)
        elif s == S.WAITING_FOR_FORK:
            for head, kids in list(self.fork_waiters.items()):
                if req in kids:
                    kids.remove(req)
                    if not kids:
                        del self.fork_waiters[head]
        req.transition(status)
        req.error, req.error_code = error, error_code
        self.finished_seq_ids.append(req.request_id)    # the worker forgets it (engine/worker_view.py)
        self.counters.num_failed += status == S.FINISHED_ERROR and error_code is None
        self.counters.num_grammar_errors += error_code == GRAMMAR_ERROR
        req.metrics.finished_time = time.monotonic()
        self.kv.free(req.request_id, req)
        group = self.beam_groups.get(req.parent_id)
        if group is not None and req in group.live:
            group.live.remove(req)
        for kid in self.fork_waiters.pop(req.request_id, ()):   # sample 0 ended before forking
            kid.transition(status)
            kid.error, kid.error_code = error, error_code
            self.finished_seq_ids.append(kid.request_id)
            kid.metrics.finished_time = req.metrics.finished_time

    def fork(self, parent: Request, child: Request) -> None:
        """`child` joins the batch sharing every block of `parent` (copy on write later)."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        child.transition(S.RUNNING)
        self.running.append(child)

    # -- preemption --------------------------------------------------------------------------
    def _preempt(self, req: Request, only: bool = False, to_back: bool = False,
                 recompute: bool = False) -> list[Request]:
        """Preempt `req`'s running group (`only`: just `req`); returns the preempted sequences.
        Recomputed sequences rejoin the queue's front (`to_back`: its back)."""
        group = [req] if only else [r for r in self.running if r.parent_id == req.parent_id]
        c = self.counters
        for r in group:
            r.num_preemptions += 1
            c.num_preemptions += 1
            if r.num_preemptions == self.preemption_warn_threshold:
                c.num_repeatedly_preempted += 1
                logger.warning("request %s preempted %d times: the KV pool is too small for the load "
                               "(raise kv_cache_memory, lower max_num_seqs)", r.request_id, r.num_preemptions)
            c.max_preemptions_per_request = max(c.max_preemptions_per_request, r.num_preemptions)
        for r in group:
            self.running.remove(r)
        if self.preemption_mode == "swap" and not recompute and self.kv.swap_out(group):
            for r in group:
                r.transition(S.SWAPPED)
            c.num_swap_preemptions += len(group)
            self.swapped.append(group)
            return group
        for r in group:                     # recompute (or no swap space left)
            self.kv.free(r.request_id, r)
            r.transition(S.PREEMPTED)
            r.num_computed_tokens = 0
            r.beam_candidates = None        # recomputed with the prefill
        if to_back:
            self.waiting.extend(group)
        else:
            self.waiting.extendleft(reversed(group))
        return group

    def check_integrity(self) -> None:
        """Every unfinished sequence is in exactly the place its status says, holds exactly
        the KV its status says, and the seat cap holds."""
        kv = self.kv
        assert self.num_seats_taken <= self.max_num_seqs, f"{self.num_seats_taken} seats > {self.max_num_seqs}"
        for r in self.running:
            assert r.status.holds_blocks, f"{r} is seated but {r.status.name}"
            assert (r.status == S.WAITING_FOR_BEAMS) == (r.beam_candidates is not None), r
        for r in self.waiting:
            assert r.status in (S.WAITING, S.PREEMPTED) and not kv.num_held_blocks(r.request_id), r
        swapped = [r for g in self.swapped for r in g]
        assert all(r.status == S.SWAPPED for r in swapped)
        for kids in self.fork_waiters.values():
            assert kids and all(r.status == S.WAITING_FOR_FORK for r in kids)
        seated = {r.request_id for r in self.running}
        assert set(kv.block_tables) == seated, "block tables != seated sequences"
        assert set(kv.swapped_tables) == {r.request_id for r in swapped}, "swap space != swapped"
        live = seated | {r.request_id for r in self.waiting}
        assert set(kv.cache_state) <= live, "prefix-cache state kept for a finished sequence"
        ids = [r.request_id for r in list(self.running) + list(self.waiting) + swapped]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
