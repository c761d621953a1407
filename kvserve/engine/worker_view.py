"""What the worker has been told: turns the scheduler's plan of a step into a SchedulerOutput,
the data the worker receives (worker/scheduler_output.py), sending each sequence's data once.

It remembers, per sequence the worker holds, how many tokens and which block table it sent; a
step then carries only deltas (the tokens appended since, the table when it changed: new block
ids when it only grew) and the ids of sequences that finished since (the scheduler records
them in `finish`), after which the worker forgets them. It also computes the grammar bitmask
of every constrained sequence that samples this step (structured/matcher.py), so the worker
applies masks and never holds a matcher: the scheduler alone advances grammars.
"""
from __future__ import annotations

from kvserve.engine import prompt_logprobs
from kvserve.engine.request import Request
from kvserve.structured.matcher import grammar_bitmasks
from kvserve.worker.scheduler_output import CachedSequenceData, NewSequenceData, SchedulerOutput


class WorkerView:
    def __init__(self):
        self.sent: dict[str, tuple[int, list[int] | None]] = {}   # seq id -> (tokens sent, table sent)

    def build(self, plan, kv, scheduler) -> SchedulerOutput:
        """plan: the scheduler's StepPlan (live requests); kv: the KV cache manager (tables)."""
        so = SchedulerOutput(draft_tokens=plan.draft_tokens,
                             prompt_logprob_rows=prompt_logprobs.wanted_rows(plan.scheduled))
        so.finished_seq_ids = [sid for sid in scheduler.finished_seq_ids if self.sent.pop(sid, None) is not None]
        scheduler.finished_seq_ids.clear()
        constrained: list[Request] = []
        for req, n in plan.scheduled:
            rid = req.request_id
            self._send(req, so, kv.block_ids(rid))
            so.scheduled.append((rid, n))
            samples = req.num_computed_tokens + n == req.num_tokens
            waiters = scheduler.fork_waiters.get(rid, ())
            if waiters:
                so.fork_waiters[rid] = [w.request_id for w in waiters]
                for w in waiters:
                    self._send(w, so, None)
            if samples and rid not in plan.draft_tokens:
                constrained += [r for r in [req, *waiters] if r.grammar is not None]
        if constrained:
            bitmask, failed = grammar_bitmasks([r.grammar for r in constrained])    # [C, W]
            for i, r in enumerate(constrained):
                if i in failed:
                    so.grammar_errors[r.request_id] = failed[i]
                else:
                    so.grammar_bitmask[r.request_id] = bitmask[i]
        return so

    def _send(self, req: Request, so: SchedulerOutput, block_ids: list[int] | None) -> None:
        sid = req.request_id
        sent = self.sent.get(sid)
        if sent is None:
            so.new_seqs.append(NewSequenceData(sid, list(req.token_ids), req.num_prompt_tokens, req.params,
                                               req.seed, req.eos_token_id))
            num_sent, table = req.num_tokens, None
            new_tokens = []
        else:
            num_sent, table = sent
            new_tokens = req.token_ids[num_sent:]
        new_blocks, replaced = [], None
        if block_ids is not None and block_ids != table:
            k = len(table) if table is not None else 0
            if table is not None and len(block_ids) > k and block_ids[:k] == table:
                new_blocks = block_ids[k:]
            else:
                replaced = list(block_ids)
            table = list(block_ids)
        self.sent[sid] = (req.num_tokens, table)
        so.cached_seqs.append(CachedSequenceData(sid, new_tokens, req.num_computed_tokens, new_blocks, replaced))

    def check_integrity(self, live_seq_ids: set[str], pending_finished: list[str]) -> None:
        """Every sequence the worker holds is live, or finished and not yet told."""
        stale = set(self.sent) - live_seq_ids - set(pending_finished)
        assert not stale, f"the worker holds finished sequences it was never told of: {sorted(stale)[:5]}"
