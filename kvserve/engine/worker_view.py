"""What the worker has been told: turns the scheduler's plan of a step into a SchedulerOutput,
the data the worker receives (worker/scheduler_output.py), sending each sequence's data once.

It remembers, per sequence the worker holds, how many tokens the worker has (those sent, and
those it sampled itself: `note_sampled`) and which block table it was sent; a step then carries
only what changed (tokens the worker did not sample, the table when it changed: new block ids
when it only grew, which the KV manager's table object tells without a comparison), nothing for
a sequence that only decodes, and the ids of sequences that finished since (the scheduler records
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
        # seq id -> [tokens the worker holds, the block table object it was sent, its length then]
        self.sent: dict[str, list] = {}

    def build(self, plan, kv, scheduler, ahead: bool = False) -> SchedulerOutput:
        """plan: the scheduler's StepPlan (live requests); kv: the KV cache manager (tables).
        `ahead`: a plan made while the previous step runs (Scheduler.schedule_ahead): each
        sequence starts one past its computed tokens, at the token the worker is sampling now."""
        skip = 1 if ahead else 0
        so = SchedulerOutput(draft_tokens=plan.draft_tokens,
                             prompt_logprob_rows=prompt_logprobs.wanted_rows(plan.scheduled))
        so.finished_seq_ids = [sid for sid in scheduler.finished_seq_ids if self.sent.pop(sid, None) is not None]
        scheduler.finished_seq_ids.clear()
        constrained: list[Request] = []
        fork_waiters, drafts = scheduler.fork_waiters, plan.draft_tokens
        send, scheduled = self._send, so.scheduled
        for req, n in plan.scheduled:
            rid = req.request_id
            send(req, so, kv.block_table(rid))
            scheduled.append((rid, n, req.num_computed_tokens + skip))
            waiters = fork_waiters.get(rid, ()) if fork_waiters else ()
            if waiters:
                so.fork_waiters[rid] = [w.request_id for w in waiters]
                for w in waiters:
                    send(w, so, None)
            if (req.grammar is not None or waiters) and req.num_computed_tokens + n == req.num_tokens \
                    and rid not in drafts:       # it samples this step: its grammar's mask, and its waiters'
                constrained += [r for r in [req, *waiters] if r.grammar is not None]
        if constrained:
            bitmask, failed = grammar_bitmasks([r.grammar for r in constrained])    # [C, W]
            for i, r in enumerate(constrained):
                if i in failed:
                    so.grammar_errors[r.request_id] = failed[i]
                else:
                    so.grammar_bitmask[r.request_id] = bitmask[i]
        return so

    def note_sampled(self, sampled: dict) -> None:
        """After the step: the worker appended each run it sampled to its own copy
        (ModelRunner.append_sampled), so those tokens are not sent again."""
        sent = self.sent
        for sid, run in sampled.items():
            rec = sent.get(sid)
            if rec is not None:
                rec[0] += len(run)

    def _send(self, req: Request, so: SchedulerOutput, table: list | None) -> None:
        """`table`: the KV manager's block table of the sequence (None: not sent this step).
        Nothing is sent for a sequence whose tokens and table the worker already has."""
        sid = req.request_id
        rec = self.sent.get(sid)
        num_tokens = len(req.token_ids)
        if rec is None:
            so.new_seqs.append(NewSequenceData(sid, list(req.token_ids), req.num_prompt_tokens, req.params,
                                               req.seed, req.eos_token_id))
            rec = self.sent[sid] = [num_tokens, None, 0]
        elif rec[0] == num_tokens and (table is None or (table is rec[1] and len(table) == rec[2])):
            return
        assert num_tokens >= rec[0], f"{req}: the worker holds {rec[0]} tokens, the scheduler {num_tokens}"
        new_tokens = req.token_ids[rec[0]:] if num_tokens > rec[0] else []
        new_blocks, replaced = [], None
        if table is not None:
            if table is rec[1]:                 # the same list: it only grew (kv/manager.py)
                new_blocks = [b.block_id for b in table[rec[2]:]]
            else:
                replaced = [b.block_id for b in table]
            rec[1], rec[2] = table, len(table)
        rec[0] = num_tokens
        so.cached_seqs.append(CachedSequenceData(sid, new_tokens, new_blocks, replaced))

    def check_integrity(self, live_seq_ids: set[str], pending_finished: list[str]) -> None:
        """Every sequence the worker holds is live, or finished and not yet told."""
        stale = set(self.sent) - live_seq_ids - set(pending_finished)
        assert not stale, f"the worker holds finished sequences it was never told of: {sorted(stale)[:5]}"
