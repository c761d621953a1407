"""Async scheduling's plan (`--async-scheduling`, engine/engine_core.py): the step after one
whose forward pass is still running, with that step's sampled tokens as placeholders. A mixin
of `engine/scheduler.py`'s Scheduler: it reads the scheduler's queues and KV manager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.engine.request import RequestStatus

if TYPE_CHECKING:
    from kvserve.engine.scheduler import StepPlan

S = RequestStatus


class AheadScheduling:
    def schedule_ahead(self, prev: "StepPlan") -> "StepPlan | None":
        """Async scheduling: the step after `prev`, planned while `prev`'s forward pass runs and
        its sampled tokens are not known yet (placeholders: a sequence's next position is one
        past the token `prev` computes). Only one decode token for each live sequence of `prev`
        whose next token needs nothing first: None (the caller waits for `prev`, then schedules
        as usual) when `prev` ran a prefill chunk, drafts, a preemption or a swap-in, when a
        request waits for admission or a swap-in, or a beam group or an n > 1 fork waits, or a
        sequence is constrained by a grammar (its mask needs `prev`'s token), or a slot cannot
        be had without preempting. A sequence whose `prev` token reaches max_tokens or
        max_model_len is left out; one that stops on it (EOS, a stop token, a stop string)
        computes one token more, which update_from_output drops (it skips finished sequences)."""
        if (prev.is_empty or prev.draft_tokens or prev.preempted or prev.swapped_in or prev.finished
                or self.waiting or self.swapped or self.beam_groups or self.fork_waiters):
            return None
        out = type(prev)()                      # a StepPlan
        for req, n in prev.scheduled:
            if req.is_finished:
                continue
            if n != 1 or req.grammar is not None or req.status != S.RUNNING \
                    or req.num_tokens - req.num_computed_tokens != 1:
                return None
            p = req.params
            if (p.max_tokens is not None and req.num_output_tokens + 1 >= p.max_tokens) \
                    or req.num_tokens + 1 >= self.max_model_len:
                continue                        # prev's token is its last
            start = req.num_computed_tokens + 1          # the placeholder's position
            if not self.kv.allocate_slots(req.request_id, start + 1, num_computed=start):
                return None
            out.scheduled.append((req, 1))
        if out.is_empty:
            return None
        self.step_count += 1
        out.num_batched_tokens = len(out.scheduled)
        self.policy.on_scheduled(out)
        return out
