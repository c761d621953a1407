"""What a request returns, in vLLM's shapes: RequestOutput holding CompletionOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import RequestMetrics


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None              # why, when finish_reason is "error"
    error_code: str | None = None         # "grammar_error" when its own grammar failed it (the
                                          # user's error: the server answers 400), else None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None, repr=False)


@dataclass
class BeamSearchSequence:
    """One finished beam, in vLLM's shape: `tokens` are the prompt's and the beam's."""

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None


@dataclass
class BeamSearchOutput:
    """The result of `LLM.beam_search` for one prompt: the beams, best first."""

    sequences: list[BeamSearchSequence]
