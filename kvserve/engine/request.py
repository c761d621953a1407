"""A request's state: its tokens, its progress (`num_computed_tokens`) and its named status.

Progress lives here so that a prefill chunk, a decode step and a recompute after preemption
are the same arithmetic: the scheduler runs tokens `[num_computed_tokens, num_tokens)`.

The status is a name, never a flag: every change goes through `Request.transition`, which
checks it against `TRANSITIONS` (vLLM v1's `RequestStatus`, with the states that sharing,
beams, swapping and grammar compiles add). Only the scheduler calls it. KV state (block
tables, prefix-cache progress) belongs to `kv/` and is keyed by `request_id`; none of it is
stored here.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvserve.sample.params import SamplingParams
from kvserve.worker.sequence import PromptAndOutput


# Request.error_code of a sequence its own grammar failed (a structured-outputs matcher error:
# the user's input, a 400-class error, not a server fault).
GRAMMAR_ERROR = "grammar_error"


class RequestStatus(enum.Enum):
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # PD decode side: its prompt's KV is streaming in
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # structured outputs: its grammar is compiling
    WAITING = "waiting"                      # in the waiting queue, no blocks, never ran
    WAITING_FOR_FORK = "waiting_for_fork"    # sample i > 0 of n: forks sample 0 after its prefill
    RUNNING = "running"                      # holds a seat and blocks; has tokens to compute
    WAITING_FOR_BEAMS = "waiting_for_beams"  # a beam whose candidates are in; holds its blocks
    PREEMPTED = "preempted"                  # blocks freed: back in the queue, to be recomputed
    SWAPPED = "swapped"                      # blocks in the CPU swap space
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"                 # failed alone (a bug, a stall, its grammar); see Request.error

    def __init__(self, value: str):
        # an attribute, not a property: read for every sequence of every step
        self.finished = value in ("stop", "length", "abort", "error")

    @property
    def holds_blocks(self) -> bool:
        return self in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_BEAMS)


S = RequestStatus
FINISHED = frozenset({S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED, S.FINISHED_ERROR})
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.WAITING_FOR_REMOTE_KV: frozenset({S.WAITING, S.WAITING_FOR_GRAMMAR}) | FINISHED,
    S.WAITING_FOR_GRAMMAR: frozenset({S.WAITING}) | FINISHED,
    S.WAITING: frozenset({S.RUNNING, S.WAITING_FOR_FORK}) | FINISHED,
    S.WAITING_FOR_FORK: frozenset({S.RUNNING}) | FINISHED,
    S.RUNNING: frozenset({S.WAITING_FOR_BEAMS, S.PREEMPTED, S.SWAPPED}) | FINISHED,
    S.WAITING_FOR_BEAMS: frozenset({S.RUNNING, S.PREEMPTED, S.SWAPPED}) | FINISHED,
    S.PREEMPTED: frozenset({S.RUNNING}) | FINISHED,
    S.SWAPPED: frozenset({S.RUNNING, S.WAITING_FOR_BEAMS}) | FINISHED,
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class RequestMetrics:
    """Wall-clock milestones of one request (time.monotonic seconds) and what they imply."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gap before every output token after the first."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1)."""
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class Request(PromptAndOutput):
    """One sequence being generated. `n > 1` sampling makes one Request per sample, a beam
    search one per live beam; `parent_id` is the user's request id, shared by the group."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, *, eos_token_id: int | None = None,
                 parent_id: str | None = None, index: int = 0, seed: int | None = None,
                 cache_salt: str | None = None, arrival_seq: int = 0, priority: int = 0,
                 tenant: str | None = None, tenant_weight: float = 1.0, group_head: bool = False):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, grows by one per decode
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None   # prefix-cache hit at first admission
        # A constrained request (structured outputs) waits for its grammar before it queues.
        # A PD decode request whose prompt's KV streams in waits for it first (engine/remote_kv.py).
        self.status = S.WAITING if params.structured_outputs is None else S.WAITING_FOR_GRAMMAR
        ktp = params.kv_transfer_params
        if ktp is not None and "stream_to" not in ktp:
            self.status = S.WAITING_FOR_REMOTE_KV
        self.grammar = None         # its structured.matcher.SequenceGrammar, once compiled
        self.eos_token_id = eos_token_id
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_code: str | None = None   # GRAMMAR_ERROR: the request's own grammar failed it
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.arrival_seq = arrival_seq             # breaks arrival-time ties: later = larger
        # The group head's count of prompt logprob entries made (the first token's null one
        # included: nothing predicts it), when asked for (engine/prompt_logprobs.py); the entries
        # go out as deltas. Only the head (`group_head`) records them: its samples and beams share
        # its prompt.
        self.num_prompt_logprobs: int | None = 1 if group_head and params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.seed = seed
        self.cache_salt = cache_salt
        self.priority = priority              # lower runs first (--scheduling-policy priority)
        self.tenant = tenant                  # VTC's client (server/tenants.py) and its weight
        self.tenant_weight = tenant_weight
        self.extra_seats = 0      # seats reserved for forks to come (n - 1 samples, beam_width - 1)
        self.enqueue_step = 0
        # Beam search: this beam's top candidates (token ids, logprobs) once its logits are in.
        self.beam_candidates: tuple[list[int], list[float]] | None = None

    def transition(self, new: RequestStatus) -> None:
        """The one way a status changes; an illegal change is a bug, raised at once."""
        if new not in TRANSITIONS.get(self.status, ()):
            raise IllegalTransition(f"request {self.request_id}: {self.status.name} -> {new.name} "
                                    "is not a legal transition")
        self.status = new

    @property
    def arrival_key(self) -> tuple[float, int]:
        """Arrival order: the preemption victim is the running request with the largest key."""
        return self.metrics.arrival_time, self.arrival_seq

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def must_compute_prompt(self) -> bool:
        """Its prompt logprobs are not all recorded yet: every prompt position must run through
        the model (no prefix-cache hit), as vLLM does for prompt_logprobs requests."""
        return self.num_prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}"
                f"/{self.num_tokens})")
