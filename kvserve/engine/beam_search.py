"""Beam search, native in the block manager (seed 003, "Sharing blocks, and copying on write").

A beam search keeps `beam_width` live beams, each a Request (a sequence with its own block
table). After every beam's logits are in, each live beam proposes its `2 * beam_width` most
likely next tokens; a candidate ending in a stop token is a finished hypothesis, the others are
ranked by `score` and the best `beam_width` continue. A surviving candidate takes over its parent
beam's Request if it is the parent's first survivor, else it *forks* it: a block-table copy with
one more reference on every block (`Scheduler.fork`). The shared partial last block is copied
only when a beam writes into it, so at most one block is copied per beam per step. Parents with
no survivor are freed. After `max_tokens` steps (or when no beam is live) the finished
hypotheses and the surviving beams are ranked by score and the best come back.

The rules are those of vLLM's `LLM.beam_search`: candidates are the top 2 * beam_width raw
log-probabilities of each beam, the score is
    cumulative_logprob / seq_len ** length_penalty,
with seq_len the prompt's and the beam's tokens, less one if the beam ends in EOS; no early
stopping. Ties keep candidate order (beam order, then token rank).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus


def beam_score(seq_len: int, cumulative_logprob: float, ends_in_eos: bool, length_penalty: float) -> float:
    if ends_in_eos:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


@dataclass
class BeamHyp:
    """A finished beam: its output tokens, their log-probabilities, its score."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class BeamGroup:
    request_id: str
    width: int
    n: int                                                  # beams returned, best first
    length_penalty: float
    head: Request                                           # the first beam: prompt, metrics
    live: list[Request] = field(default_factory=list)       # also the engine's groups[request_id]
    completed: list[BeamHyp] = field(default_factory=list)
    beam_logprobs: dict[str, list[float]] = field(default_factory=dict)  # request id -> token logprobs
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_beam_id(self) -> str:
        return f"{self.request_id}#beam{next(self._ids)}"

    @property
    def finished(self) -> bool:
        return not self.live

    def ready(self) -> bool:
        """Every live beam has proposed its candidates (and holds its blocks)."""
        return bool(self.live) and all(r.status == RequestStatus.WAITING_FOR_BEAMS for r in self.live)

    def select(self, eos_token_id: int | None, max_model_len: int) -> list[tuple[int, int, float, float]]:
        """One beam step's decision (no state but `completed` changes): candidates ending in a
        stop token, or reaching max_tokens / max_model_len, become finished hypotheses; returns
        the continuing ones, best first, as (live beam index, token, logprob, cumulative)."""
        live = self.live
        p = live[0].params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos and eos_token_id is not None:
            stops.add(eos_token_id)
        cands = []
        for bi, beam in enumerate(live):
            ids, lps = beam.beam_candidates
            hist = self.beam_logprobs.get(beam.request_id, [])
            for tid, lp in zip(ids, lps):
                cum = beam.cumulative_logprob + lp
                seq_len = beam.num_tokens + 1
                if tid in stops:
                    self.completed.append(BeamHyp(
                        beam.output_token_ids + [tid], hist + [lp], cum,
                        beam_score(seq_len, cum, tid == eos_token_id, self.length_penalty), "stop",
                        None if tid == eos_token_id else tid))
                else:
                    cands.append((beam_score(seq_len, cum, False, self.length_penalty), bi, tid, lp, cum))
        cands.sort(key=lambda c: -c[0])          # stable: beam order, then token rank
        cont = []
        for score, bi, tid, lp, cum in cands[:self.width]:
            beam = live[bi]
            n_out = beam.num_output_tokens + 1
            if (p.max_tokens is not None and n_out >= p.max_tokens) or beam.num_tokens + 1 >= max_model_len:
                hist = self.beam_logprobs.get(beam.request_id, [])
                self.completed.append(BeamHyp(beam.output_token_ids + [tid], hist + [lp], cum, score, "length"))
            else:
                cont.append((bi, tid, lp, cum))
        return cont

    def best(self, n: int) -> list[BeamHyp]:
        return sorted(self.completed, key=lambda h: -h.score)[:n]


def advance_beams(sched, group: BeamGroup) -> None:
    """One beam step, applied through the scheduler (which owns every status change): keep the
    best `width` candidates; a candidate takes over its beam if it is the beam's first
    survivor, else forks it (shared blocks); beams with no survivor are pruned. Never takes
    more seats than `max_num_seqs` allows."""
    live = list(group.live)
    cont = group.select(sched.eos_token_id, sched.max_model_len)
    mine = sum(sched.seats(r) for r in live)            # every live beam is seated when ready
    cont = cont[:sched.max_num_seqs - sched.num_seats_taken + mine]
    claimed: set[int] = set()
    targets = []
    for bi, tid, lp, cum in cont:
        parent = live[bi]
        if bi not in claimed:
            claimed.add(bi)
            targets.append((parent, tid, lp, cum))
            continue
        child = Request(group.new_beam_id(), parent.prompt_token_ids, parent.params,
                        parent.arrival_time, eos_token_id=parent.eos_token_id,
                        parent_id=group.request_id, cache_salt=parent.cache_salt,
                        arrival_seq=parent.arrival_seq, priority=parent.priority,
                        tenant=parent.tenant, tenant_weight=parent.tenant_weight)
        child.token_ids = list(parent.token_ids)
        child.cumulative_logprob = parent.cumulative_logprob
        child.metrics.first_token_time = parent.metrics.first_token_time
        group.beam_logprobs[child.request_id] = list(group.beam_logprobs.get(parent.request_id, []))
        sched.fork(parent, child)
        targets.append((child, tid, lp, cum))
    for bi, beam in enumerate(live):
        if bi not in claimed:                     # pruned: no survivor
            sched.finish(beam, RequestStatus.FINISHED_ABORTED)
            group.beam_logprobs.pop(beam.request_id, None)
    group.live[:] = []
    for req, tid, lp, cum in targets:
        if req.status == RequestStatus.WAITING_FOR_BEAMS:
            req.transition(RequestStatus.RUNNING)
        req.beam_candidates = None
        req.extra_seats = 0
        req.cumulative_logprob = cum
        group.beam_logprobs.setdefault(req.request_id, []).append(lp)
        sched.append_token(req, tid)
        group.live.append(req)
    if group.finished:
        group.head.metrics.finished_time = time.monotonic()
