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

    @property
    def finished(self) -> bool:
        return not self.live

    def ready(self) -> bool:
        """Every live beam is running and has proposed its candidates."""
        return bool(self.live) and all(
            r.status == RequestStatus.RUNNING and r.beam_candidates is not None for r in self.live)

    def best(self, n: int) -> list[BeamHyp]:
        return sorted(self.completed, key=lambda h: -h.score)[:n]
