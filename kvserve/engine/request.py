"""A request's state: its tokens, its progress (`num_computed_tokens`) and its status.

Progress lives here so that a prefill chunk, a decode step and a recompute after preemption
are the same arithmetic: the scheduler runs tokens `[num_computed_tokens, num_tokens)`.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.sample.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


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


class Request:
    """One sequence being generated. `n > 1` sampling makes one Request per sample."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, *, eos_token_id: int | None = None,
                 parent_id: str | None = None, index: int = 0, seed: int | None = None,
                 cache_salt: str | None = None):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, grows by one per decode
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.eos_token_id = eos_token_id
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.seed = seed
        self.generator: torch.Generator | None = None  # made by the sampler on its device
        # Prefix cache (kv/prefix_cache.py): the salt that scopes sharing, and this sequence's
        # labelling progress (chained hashes, radix keys and node), kept across steps.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.block_keys: list[tuple] = []
        self.num_labelled_blocks = 0
        self.radix_node = None
        self._num_cached_set = False
        # Sharing (n > 1): samples wait for the first one's prefill, then fork its blocks.
        self.pending_forks: list[Request] = []
        self.fork_parent: Request | None = None
        self.extra_seats = 0      # seats its forks will take (n - 1 samples, beam_width - 1 beams)
        # Preemption by swap: the blocks are in the CPU swap space.
        self.swapped = False
        self.enqueue_step = 0
        # Beam search: this beam's top candidates (token ids, logprobs) once its logits are in.
        self.beam_candidates: tuple[list[int], list[float]] | None = None

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def fork_pending(self) -> bool:
        return self.fork_parent is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}"
                f"/{self.num_tokens})")
