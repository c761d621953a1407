"""Continuous batching with chunked prefill under a token budget (seed 003, "Scheduling one step
at a time", "Mixing prefill and decode in one step", "When memory runs out").

Each step: one decode token for every running sequence whose prompt is done, then prefill
chunks of partially prefilled and waiting prompts until `max_num_batched_tokens` is spent, with
at most `max_num_seqs` running. When blocks run out, the most recently arrived running request
is preempted by recompute: its blocks are freed and it goes back to the front of the queue,
to be prefilled again over its prompt and the tokens it has generated. The scheduler decides
who runs and how many tokens; it never touches tensors.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.manager import KVCacheManager


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
                 watermark_blocks: int = 0):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, out of length or aborted) and free its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req.request_id)

    def preempt(self, req: Request) -> None:
        """Recompute preemption: drop every block, rejoin the front of the queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        done: set[str] = set()  # scheduled this step: never chosen as a victim

        def make_room(req: Request, num_tokens: int) -> bool:
            """Allocate, preempting the latest-arrived unscheduled running request while short."""
            while not self.kv.allocate_slots(req.request_id, num_tokens):
                victim = next((r for r in reversed(self.running) if r.request_id not in done), None)
                if victim is None:
                    return False
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return False
            return True

        # 1. One decode token for every running sequence whose prefill is complete.
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if make_room(req, req.num_computed_tokens + 1):
                out.scheduled.append((req, 1))
                done.add(req.request_id)
                budget -= 1

        # 2. Prefill chunks of running requests whose prompt is not done yet.
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in done:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = min(n, self._tokens_that_fit(req, n)) or n
            if make_room(req, req.num_computed_tokens + n):
                out.scheduled.append((req, n))
                done.add(req.request_id)
                budget -= n

        # 3. Admit waiting requests in arrival order while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                          reserve=self.watermark_blocks if self.running else 0):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append((req, n))
            done.add(req.request_id)
            budget -= n

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _tokens_that_fit(self, req: Request, n: int) -> int:
        """How many of the next `n` tokens fit in held plus free blocks, without preempting."""
        bs = self.kv.block_size
        held = len(self.kv.block_tables.get(req.request_id, ()))
        capacity = (held + self.kv.num_free_blocks) * bs - req.num_computed_tokens
        return max(0, min(n, capacity))

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The forward pass ran: the scheduled tokens now have K/V in the cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
