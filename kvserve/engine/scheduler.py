"""Continuous batching with chunked prefill under a token budget (seed 003, "Scheduling one step
at a time", "Mixing prefill and decode in one step", "When memory runs out", "Radix trees").

The scheduler decides who runs and owns every status change (its base class in
`engine/queues.py` keeps the places and the legal moves between them); it never touches
tensors. A step is `schedule()` then, after the forward pass, `update_from_output()`: the one
place where states change after a step, on every path, the empty step included.

`schedule()`: one decode token per running sequence, then prefill chunks; then, only in a step
that preempted nobody (vLLM's rule), swapped groups come back and waiting prompts are admitted
(from their prefix-cache hit, keeping `watermark_blocks` free) until `max_num_batched_tokens`
is spent, with at most `max_num_seqs` seats. Out of blocks, the running request that arrived
last is preempted with its whole group (samples and beams share blocks: freeing some frees
almost nothing), by recompute (back to the queue's front) or swap; when that group is the
asker's own, its other samples are shed one by one (a beam group goes whole). A sequence that
alone outgrows the pool finishes with "length". Cache-aware ordering (SGLang) serves the
longest cached prefix first, preempted or `max_wait_steps`-old requests before it. When no
seat can run while requests wait (beams waiting for siblings that do not fit), the latest
other group is recomputed; `stall_steps` steps with no progress fail the stuck requests with
a clear error instead of spinning.

Speculative decoding (kvserve/spec_decode/): `spec_candidates()` names who may verify drafts
and how many (engine/draft_scheduling.py); `schedule(drafts)` gives each its last token + k
drafts the budget and pool spare; `update_from_output` appends the verified run and rolls the
rest back. Structured outputs (kvserve/structured/): a sequence's grammar advances with every
token it accepts, and the sequence stops when its grammar is complete.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from kvserve.engine.ahead_scheduling import AheadScheduling
from kvserve.engine.beam_search import advance_beams
from kvserve.engine.draft_scheduling import DraftScheduling
from kvserve.engine.queues import RequestQueues
from kvserve.engine.core_io import SequenceDelta
from kvserve.engine.request import GRAMMAR_ERROR, Request, RequestStatus
from kvserve.kv.manager import KVCacheManager
from kvserve.sample.params import Sampled
from kvserve.structured.matcher import SequenceGrammar
from kvserve.worker.output import ModelRunnerOutput

logger = logging.getLogger(__name__)
S = RequestStatus

CACHE_AWARE_WINDOW = 256   # at most this many waiting requests are ranked by cached prefix


@dataclass
class StepPlan:
    """This step's work as the scheduler chose it: (request, number of new tokens), and what
    changed while choosing it. The worker gets it as data (engine/worker_view.py -> the
    worker's SchedulerOutput)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)      # outgrew the pool
    # Speculative decoding: sequence id -> the drafts scheduled after its last token (the
    # sequence's n counts them: 1 + k); their K/V are unverified until update_from_output.
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(AheadScheduling, DraftScheduling, RequestQueues):
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermark_blocks: int = 0, *, preemption_mode: str = "recompute",
                 cache_aware: bool = False, max_wait_steps: int = 64,
                 preemption_warn_threshold: int = 3, stall_steps: int = 8,
                 eos_token_id: int | None = None, max_model_len: int = 1 << 30,
                 num_speculative_tokens: int = 0, spec_disable_by_batch_size: int | None = None):
        super().__init__(kv, max_num_seqs, preemption_mode, preemption_warn_threshold)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.cache_aware = cache_aware
        self.max_wait_steps = max_wait_steps
        self.stall_steps = stall_steps
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self._stalled = 0
        self._budget = 0
        self._drafts: dict[str, list[int]] = {}

    def _latest(self, candidates) -> Request | None:
        return max(candidates, key=self.policy.victim_key, default=None)   # fcfs: the latest arrival

    def _make_room(self, req: Request, num_tokens: int, out: StepPlan, done: set[str]) -> bool:
        """Give `req` slots for `num_tokens` tokens in all (copying a shared block first),
        preempting the latest-arrived group with nothing scheduled yet while short."""
        if not self.kv.fits_alone(num_tokens):
            self.finish(req, S.FINISHED_LENGTH)
            out.finished.append(req)
            return False
        while not self.kv.allocate_slots(req.request_id, num_tokens, num_computed=req.num_computed_tokens):
            victim = self._latest(r for r in self.running if r.parent_id not in done)
            if victim is None:
                return False
            if victim.parent_id != req.parent_id:
                out.preempted += self._preempt(victim)
                continue
            if req.parent_id in self.beam_groups:     # beams advance together: never split them
                out.preempted += self._preempt(req)
                return False
            sibling = next((r for r in reversed(self.running)
                            if r.parent_id == req.parent_id and r is not req), None)
            out.preempted += self._preempt(sibling or req, only=True)
            if sibling is None:
                return False
        return True

    def grammar_ready(self, seqs: list[Request], compiled: tuple) -> None:
        """A constrained request's grammar is compiled (`compiled`: structured.matcher.
        SequenceGrammar's arguments): each sequence gets a matcher of its own and leaves
        WAITING_FOR_GRAMMAR (the caller then queues them as it queues any new request)."""
        for r in seqs:
            r.grammar = SequenceGrammar(*compiled)
            r.transition(S.WAITING)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, drafts: dict[str, list[int]] | None = None) -> StepPlan:
        """`drafts`: proposals for some of `spec_candidates()` (speculative decoding); each is
        scheduled, cut to what the budget and the pool spare, or dropped."""
        self.step_count += 1
        out = StepPlan()
        self._budget = self.max_num_batched_tokens
        self._drafts = drafts or {}
        done: set[str] = set()     # groups with a sequence scheduled this step: never victims
        self._schedule_running(out, done)
        if not out.preempted:      # vLLM's rule: no swap-in, no admission in a step that preempted
            if self.swapped:
                self._swap_in(out)
            self._admit(out, done)
        stuck = out.is_empty and not out.preempted and not out.swapped_in
        if stuck and self.running and (self.waiting or self.swapped):
            self._break_idle_deadlock(out)
        out.num_batched_tokens = self.max_num_batched_tokens - self._budget
        self.policy.on_scheduled(out)
        return out

    def _schedule(self, out: StepPlan, done: set[str], req: Request, n: int) -> None:
        out.scheduled.append((req, n))
        done.add(req.parent_id)
        self._budget -= n

    def _schedule_running(self, out: StepPlan, done: set[str]) -> None:
        # 1. One decode token for every running sequence whose prefill is complete (with its
        # drafts when it speculates: they only use budget and blocks the others can spare).
        decodes = sum(1 for r in self.running if r.status == S.RUNNING and r.num_tokens - r.num_computed_tokens == 1)
        spare = self._budget - decodes
        for req in list(self.running):
            if self._budget == 0:
                break
            if req.status == S.RUNNING and req.num_tokens - req.num_computed_tokens == 1:
                decodes -= 1
                k = self._schedule_drafts(req, spare, decodes, out, done)
                spare -= k
                if not k and self._make_room(req, req.num_computed_tokens + 1, out, done):
                    self._schedule(out, done, req, 1)
        # 2. Prefill chunks of running requests whose prompt is not done yet.
        for req in list(self.running):
            if self._budget == 0:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            if req.status != S.RUNNING or remaining <= 1:
                continue
            n = min(remaining, self._budget)
            n = min(n, self._tokens_that_fit(req, n)) or n
            if self._make_room(req, req.num_computed_tokens + n, out, done):
                self._schedule(out, done, req, n)

    def _swap_in(self, out: StepPlan) -> None:
        while self.swapped:
            group = self.swapped[0]
            if self.num_seats_taken + sum(self.seats(r) for r in group) > self.max_num_seqs:
                break
            if self.waiting and self.waiting[0].arrival_key < group[0].arrival_key:
                break                      # arrival order between the two queues
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.swap_in(group, reserve=reserve):
                break
            self.swapped.popleft()
            for r in group:
                r.transition(S.WAITING_FOR_BEAMS if r.beam_candidates is not None else S.RUNNING)
                self.running.append(r)
            out.swapped_in += group

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

    def _admit(self, out: StepPlan, done: set[str]) -> None:
        if self.cache_aware and len(self.waiting) > 1 and self.kv.cache is not None:
            self._order_waiting()
        self.policy.order(self)     # priority / VTC, stable over the order above (engine/fairness.py)
        while self.waiting and self._budget > 0:
            req = self.waiting[0]
            if not self.kv.fits_alone(req.num_tokens):       # recomputed past the pool's size
                self.finish(req, S.FINISHED_LENGTH)
                out.finished.append(req)
                continue
            if self.num_seats_taken + self.seats(req) > self.max_num_seqs:
                break
            hit = self.kv.lookup(req)
            end = hit.num_tokens + min(req.num_tokens - hit.num_tokens, self._budget)
            reserve = self.watermark_blocks if self.running else 0
            used = self.kv.allocate_prefill(req, hit, end, reserve=reserve)
            if used is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = used.num_tokens
            if req.num_cached_tokens is None:         # vLLM reports the first admission's hit
                req.num_cached_tokens = used.num_tokens
            req.transition(S.RUNNING)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            self._schedule(out, done, req, min(end - used.num_tokens, self._budget))

    def _break_idle_deadlock(self, out: StepPlan) -> None:
        """Nothing could run: every seat is a beam waiting for siblings that do not fit. Preempt
        the latest group other than the next in line (by recompute, to the queue's back, so it
        cannot come straight back); the next in line comes in next step (a beam group alone
        fits: add_request checks it)."""
        if self.waiting and not (self.swapped and self.swapped[0][0].arrival_key < self.waiting[0].arrival_key):
            head = self.waiting[0].parent_id
        else:
            head = self.swapped[0][0].parent_id
        victim = self._latest(r for r in self.running if r.parent_id != head)
        if victim is not None:
            out.preempted += self._preempt(victim, to_back=True, recompute=True)

    def _tokens_that_fit(self, req: Request, n: int) -> int:
        """How many of the next `n` tokens fit in held plus free blocks, without preempting."""
        bs = self.kv.block_size
        capacity = (self.kv.num_held_blocks(req.request_id) + self.kv.num_free_blocks) * bs
        return max(0, min(n, capacity - req.num_computed_tokens))

    # -- after the forward pass: the one owner of post-step transitions -----------------------
    def update_from_output(self, out: StepPlan, result: ModelRunnerOutput
                           ) -> tuple[list[str], dict[str, SequenceDelta], dict[str, list]]:
        """Apply one step: the scheduled tokens now have K/V (label the full blocks); forks of
        n > 1 happen; each sequence's sampled tokens (one, or a verified speculative run) are
        appended and checked for stops, a failure fails its sequence alone; beams with
        candidates wait for their group, and every ready beam group advances, whether or not
        this step ran a forward pass. Returns (the user request ids whose output changed, the
        step's delta of every sequence that made tokens, new prompt-logprob entries by head)."""
        touched: dict[str, None] = {r.parent_id: None for r in out.finished}
        deltas: dict[str, SequenceDelta] = {}
        by_id = {}
        drafts = out.draft_tokens
        for req, n in out.scheduled:
            by_id[req.request_id] = req
            if req.is_finished:         # stopped or aborted while its step ran (async scheduling)
                continue
            req.num_computed_tokens += n - len(drafts.get(req.request_id, ()))   # drafts: once verified
            self.kv.cache_blocks(req)
            if req.num_computed_tokens == req.num_prompt_tokens and req.num_output_tokens == 0:
                self.counters.prompt_tokens += req.num_prompt_tokens
        for rid, entries in result.prompt_logprobs.items():
            by_id[rid].num_prompt_logprobs += len(entries)
            touched[by_id[rid].parent_id] = None
        for rid, cands in result.beam_candidates.items():
            req = by_id[rid]
            req.beam_candidates = cands
            req.transition(S.WAITING_FOR_BEAMS)
        for rid in list(result.sampled) + list(result.failed) + list(result.grammar_errors):
            parent = by_id.get(rid)
            for kid in self.fork_waiters.pop(rid, ()) if parent is not None else ():
                self.fork(parent, kid)
                by_id[kid.request_id] = kid
        for failures, code in ((result.failed, None), (result.grammar_errors, GRAMMAR_ERROR)):
            for rid, why in failures.items():
                req = by_id[rid]
                if not req.is_finished:
                    self.finish(req, S.FINISHED_ERROR, why, code)
                    touched[req.parent_id] = None
        for rid, run in result.sampled.items():
            req = by_id[rid]
            if not req.is_finished:
                self._append_run(req, run, deltas)
                touched[req.parent_id] = None
        for rid in drafts:                     # rejected drafts' K/V: their blocks go back
            req = by_id[rid]
            if not req.is_finished:
                self.kv.rollback(rid, req.num_computed_tokens)
        advanced = False
        for rid, group in list(self.beam_groups.items()):
            if group.ready():
                advance_beams(self, group)
                advanced = True
                if group.finished:
                    touched[rid] = None
        progress = bool(out.scheduled or out.preempted or out.swapped_in or out.finished or advanced)
        self._stalled = 0 if progress or not self.has_unfinished() else self._stalled + 1
        if self._stalled >= self.stall_steps:
            touched.update(dict.fromkeys(self._fail_stalled()))
        return list(touched), deltas, result.prompt_logprobs

    def append_token(self, req: Request, token_id: int) -> None:
        """Append a token the sequence produced and record when."""
        req.token_ids.append(token_id)
        self.counters.generation_tokens += 1
        m, now = req.metrics, time.monotonic()
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)

    def _append_run(self, req: Request, run: list[Sampled], deltas: dict[str, SequenceDelta]) -> None:
        """Sampled tokens: one, or a verified speculative run (accepted drafts then the target's
        token). Each token before the last was a draft the target ran, so its K/V is in the
        cache: the sequence's computed tokens grow with it. A stop (EOS, a stop token,
        max_tokens, max_model_len) ends the run; stop strings are the frontend's."""
        logprobs = req.params.logprobs is not None
        d = deltas[req.request_id] = SequenceDelta(req.index, new_logprobs=[] if logprobs else None)
        for i, s in enumerate(run):
            if i:
                req.num_computed_tokens += 1
            self.append_token(req, s.token_id)
            d.new_token_ids.append(s.token_id)
            if logprobs:
                d.new_logprobs.append(s)
            if req.grammar is not None and not req.grammar.accept(s.token_id):   # a matcher limit
                self.finish(req, S.FINISHED_ERROR, req.grammar.error, GRAMMAR_ERROR)
                return
            status = self.stop_status(req, s.token_id)
            if status is not None:
                self.finish(req, status)
                return
        if len(run) > 1:
            self.kv.cache_blocks(req)          # label the full blocks the accepted drafts filled

    def stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        """The core's stop rules, on token ids (the token is already appended): EOS and stop
        token ids once min_tokens are out, a complete grammar (it admits no further token),
        then max_tokens and max_model_len."""
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token_id == req.eos_token_id and not p.ignore_eos:
                return S.FINISHED_STOPPED
            if token_id in p.stop_token_id_set:         # O(1) however many ids
                req.stop_reason = token_id
                return S.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.terminated:
            return S.FINISHED_STOPPED
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            return S.FINISHED_LENGTH
        return None

    def _fail_stalled(self) -> list[str]:
        """The watchdog: no progress for `stall_steps` steps. Fail every unfinished request with
        a clear error instead of spinning; returns their user request ids."""
        stuck = list(self.waiting) + list(self.running) + [r for g in self.swapped for r in g]
        msg = (f"the scheduler made no progress for {self.stall_steps} steps with {len(stuck)} "
               "sequences unfinished (a kvserve bug): failing them")
        logger.error("%s: %s", msg, stuck)
        for r in stuck:
            if not r.is_finished:
                self.finish(r, S.FINISHED_ERROR, msg)
        for group in self.beam_groups.values():
            group.live.clear()
        self._stalled = 0
        return sorted({r.parent_id for r in stuck})
