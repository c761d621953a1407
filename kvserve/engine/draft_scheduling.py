"""Who speculates and how far (the scheduler's half of speculative decoding, kvserve/spec_decode/).

`spec_candidates()` names the running sequences that may verify drafts and how many;
`schedule(drafts)` calls `_schedule_drafts` to give each its last token + k drafts, if the
budget and the pool spare them (drafts never preempt). A mixin of `engine/scheduler.py`'s
Scheduler: it reads the scheduler's queues, budget and KV manager.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.engine.scheduler import StepPlan

S = RequestStatus


class DraftScheduling:
    def spec_candidates(self) -> list[tuple[Request, int]]:
        """(sequence, most drafts it may verify) for this step: running decodes of n == 1
        requests without beam search (forked sequences share blocks: never speculated) nor a
        grammar (structured outputs decode one token a step); none when the running batch is
        larger than `spec_disable_by_batch_size`."""
        k = self.num_speculative_tokens
        off = self.spec_disable_by_batch_size
        if k <= 0 or (off is not None and len(self.running) > off):
            return []
        out = []
        for req in self.running:
            if req.status == S.RUNNING and req.num_tokens - req.num_computed_tokens == 1:
                room = min(k, self._draft_room(req))
                if room > 0:
                    out.append((req, room))
        return out

    def _draft_room(self, req: Request) -> int:
        """Drafts that can matter: none past max_model_len (positions must exist) or past
        max_tokens (the target adds one token after the accepted drafts)."""
        p = req.params
        if p.use_beam_search or p.n > 1 or req.parent_id in self.beam_groups or p.structured_outputs:
            return 0
        room = self.max_model_len - req.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return room

    def _schedule_drafts(self, req: Request, spare: int, later: int, out: "StepPlan",
                         done: set[str]) -> int:
        """Schedule `req`'s last token and its drafts if the budget spares them and the pool
        has their blocks without preempting anyone (keeping a block for each of the `later`
        decodes and the watermark). Returns the number of drafts scheduled (0: none)."""
        drafts = self._drafts.get(req.request_id)
        k = min(len(drafts), spare, self._draft_room(req)) if drafts else 0
        if k <= 0:
            return 0
        end = req.num_computed_tokens + 1 + k
        if not self.kv.allocate_slots(req.request_id, end, reserve=later + self.watermark_blocks,
                                      num_computed=req.num_computed_tokens):
            return 0
        out.draft_tokens[req.request_id] = list(drafts[:k])
        self._schedule(out, done, req, 1 + k)
        return k
