"""Continuous batching with chunked prefill under a token budget (seed 003, "Scheduling one step
at a time", "Mixing prefill and decode in one step", "When memory runs out", "Radix trees").

Each step: one decode token for every running sequence whose prompt is done, then prefill
chunks of partially prefilled prompts, then swapped-out groups come back (swap mode), then
waiting prompts are admitted until `max_num_batched_tokens` is spent, with at most
`max_num_seqs` running. An admitted prompt starts at its prefix-cache hit, so only its uncached
tokens cost budget. A new request is admitted only if `watermark_blocks` stay free afterwards,
so that admissions do not cause immediate thrash.

When blocks run out, the most recently arrived running request is preempted, together with every
running sequence of its group (the samples of one request, the beams of one beam search share
blocks): by recompute (default: its blocks are freed, still labelled in the prefix cache, and it
goes back to the front of the queue to be prefilled again over its prompt and the tokens it has
generated, mostly as cache hits) or by swap (its blocks are copied to the CPU swap space and
back when there is room; shared blocks once). Preemptions are counted, and requests preempted
`preemption_warn_threshold` times are counted apart: thrash shows in the metrics.

Cache-aware ordering (SGLang): the waiting queue is served longest cached prefix first; a
request that has waited `max_wait_steps` steps, or was preempted, goes first in arrival order,
which bounds starvation. The scheduler decides who runs and how many tokens; it never touches
tensors.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)

CACHE_AWARE_WINDOW = 256   # at most this many waiting requests are ranked by cached prefix


@dataclass
class SchedulerOutput:
    """This step's work: (request, number of new tokens), decodes first."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermark_blocks: int = 0, *, preemption_mode: str = "recompute",
                 cache_aware: bool = False, max_wait_steps: int = 64,
                 preemption_warn_threshold: int = 3):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}.")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.preemption_mode = preemption_mode
        self.cache_aware = cache_aware
        self.max_wait_steps = max_wait_steps
        self.preemption_warn_threshold = preemption_warn_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[list[Request]] = deque()   # groups in the CPU swap space, oldest first
        self.step_count = 0
        self.num_preemptions = 0                 # sequences preempted, either way
        self.num_swap_preemptions = 0            # of which by swap
        self.num_repeatedly_preempted = 0        # sequences that reached the warn threshold
        self.max_preemptions_per_request = 0

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.enqueue_step = self.step_count
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_swapped(self) -> int:
        return sum(len(g) for g in self.swapped)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, out of length, aborted or a pruned beam); free its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.fork_pending:
            req.fork_parent.pending_forks.remove(req)
            req.fork_parent = None
        elif req.swapped:
            for g in self.swapped:
                if req in g:
                    g.remove(req)
                    if not g:
                        self.swapped.remove(g)
                    break
            req.swapped = False
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.request_id, req)

    def fork(self, parent: Request, child: Request) -> None:
        """`child` joins the batch sharing every block of `parent` (copy on write later)."""
        self.kv.fork(parent.request_id, child.request_id)
        if self.kv.cache is not None:
            self.kv.cache.fork_request(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child._num_cached_set = True
        child.fork_parent = None
        child.status = parent.status
        if child.metrics.first_scheduled_time is None:
            child.metrics.first_scheduled_time = time.monotonic()
        if parent.status == RequestStatus.RUNNING:
            self.running.append(child)
        else:   # forked from a preempted parent: recompute like it
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)

    # -- preemption --------------------------------------------------------------------------
    def _count_preemption(self, req: Request) -> None:
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.num_preemptions == self.preemption_warn_threshold:
            self.num_repeatedly_preempted += 1
            logger.warning("request %s preempted %d times: the KV pool is too small for the load "
                           "(raise kv_cache_memory, lower max_num_seqs)", req.request_id, req.num_preemptions)
        self.max_preemptions_per_request = max(self.max_preemptions_per_request, req.num_preemptions)

    def preempt(self, req: Request, to_back: bool = False, only: bool = False) -> list[Request]:
        """Preempt `req` and every running sequence of its group (`only`: just `req`); returns
        them. Recomputed sequences rejoin the front of the queue (`to_back`: its back)."""
        if only:
            group = [req] if req.status == RequestStatus.RUNNING else []
        else:
            group = [r for r in self.running if r.parent_id == req.parent_id]
        if not group:
            return []
        for r in group:
            self._count_preemption(r)
        if self.preemption_mode == "swap" and self.kv.swap_out(group):
            for r in group:
                self.running.remove(r)
                r.status = RequestStatus.PREEMPTED
                r.swapped = True
            self.num_swap_preemptions += len(group)
            self.swapped.append(group)
            return group
        for r in group:                    # recompute (or no swap space left)
            self.running.remove(r)
            self.kv.free(r.request_id, r)
            r.status = RequestStatus.PREEMPTED
            r.num_computed_tokens = 0      # beam_candidates stay: a function of the tokens only
        if to_back:
            self.waiting.extend(group)
        else:
            self.waiting.extendleft(reversed(group))
        return group

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        done: set[str] = set()     # groups with a sequence scheduled this step: never victims
        scheduled: set[str] = set()

        def make_room(req: Request, num_tokens: int) -> bool:
            """Allocate (copying a shared block first), preempting the latest-arrived group with
            nothing scheduled yet while short."""
            while not self.kv.allocate_slots(req.request_id, num_tokens,
                                             num_computed=req.num_computed_tokens):
                victim = next((r for r in reversed(self.running) if r.parent_id not in done), None)
                if victim is None:
                    return False
                if victim.parent_id != req.parent_id:
                    out.preempted += self.preempt(victim)
                    continue
                # Its own group is the latest: shed the group's other sequences one at a time
                # (a group too big to grow together would otherwise thrash forever).
                sibling = next((r for r in reversed(self.running)
                                if r.parent_id == req.parent_id and r is not req), None)
                if sibling is None:
                    out.preempted += self.preempt(req)
                    return False
                out.preempted += self.preempt(sibling, only=True)
            return True

        # 1. One decode token for every running sequence whose prefill is complete.
        for req in list(self.running):
            if self._budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if make_room(req, req.num_computed_tokens + 1):
                out.scheduled.append((req, 1))
                done.add(req.parent_id)
                scheduled.add(req.request_id)
                self._budget -= 1

        # 2. Prefill chunks of running requests whose prompt is not done yet.
        for req in list(self.running):
            if self._budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in scheduled:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0:
                continue      # a beam waiting for its siblings' logits
            n = min(remaining, self._budget)
            n = min(n, self._tokens_that_fit(req, n)) or n
            if make_room(req, req.num_computed_tokens + n):
                out.scheduled.append((req, n))
                done.add(req.parent_id)
                self._budget -= n

        # 3. Swapped-out groups come back when there is room (not in a step that preempted).
        if self.swapped and not out.preempted:
            self._swap_in()

        # 4. Admit waiting requests.
        self._admit(out, done)

        # 5. Nothing could run: the running sequences are all idle beams waiting for siblings
        #    that do not fit. Preempt other idle groups, latest first, to the back of the
        #    queue, until the queue head fits (a group alone always fits: add_request checks).
        while out.is_empty and self.waiting and self.running:
            head = self.waiting[0].parent_id
            victim = next((r for r in reversed(self.running) if r.parent_id != head
                           and r.num_computed_tokens >= r.num_tokens), None)
            if victim is None:
                break
            out.preempted += self.preempt(victim, to_back=True)
            self._admit(out, done)

        out.num_batched_tokens = self.max_num_batched_tokens - self._budget
        return out

    def _swap_in(self) -> None:
        while self.swapped:
            group = self.swapped[0]
            if self.running and len(self.running) + len(group) > self.max_num_seqs:
                break
            if self.waiting and self.waiting[0].arrival_time < group[0].arrival_time:
                break                      # arrival order between the two queues
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.swap_in(group, reserve=reserve):
                break
            self.swapped.popleft()
            for r in group:
                r.status = RequestStatus.RUNNING
                r.swapped = False
                self.running.append(r)

    def _order_waiting(self) -> None:
        """Cache-aware order: longest cached prefix first; starving or preempted requests first."""
        window = [self.waiting.popleft() for _ in range(min(len(self.waiting), CACHE_AWARE_WINDOW))]
        first, rest = [], []
        for r in window:
            if r.num_preemptions or self.step_count - r.enqueue_step >= self.max_wait_steps:
                first.append(r)
            else:
                rest.append((-self.kv.lookup(r).num_tokens, len(rest), r))
        rest.sort(key=lambda t: (t[0], t[1]))
        self.waiting.extendleft(reversed(first + [r for _, _, r in rest]))

    def _admit(self, out: SchedulerOutput, done: set[str]) -> None:
        if self.cache_aware and len(self.waiting) > 1 and self.kv.cache is not None:
            self._order_waiting()
        while self.waiting and self._budget > 0:
            req = self.waiting[0]
            seats = 1 + req.extra_seats
            if self.running and len(self.running) + seats > self.max_num_seqs:
                break
            hit = self.kv.lookup(req)
            n = min(req.num_tokens - hit.num_tokens, self._budget)
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.allocate_prefill(req, hit, hit.num_tokens + n, reserve=reserve):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append((req, n))
            done.add(req.parent_id)
            self._budget -= n

    def _tokens_that_fit(self, req: Request, n: int) -> int:
        """How many of the next `n` tokens fit in held plus free blocks, without preempting."""
        bs = self.kv.block_size
        held = len(self.kv.block_tables.get(req.request_id, ()))
        capacity = (held + self.kv.num_free_blocks) * bs - req.num_computed_tokens
        return max(0, min(n, capacity))

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The forward pass ran: the scheduled tokens now have K/V in the cache, and the newly
        full blocks are labelled for the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_blocks(req)
