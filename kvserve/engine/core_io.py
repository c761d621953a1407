"""What crosses the engine core's boundary: requests in (token ids), deltas out (token ids).

The core never handles text (DESIGN.md): a step returns, per user request that changed, only
what is new -- each sequence's new token ids, their logprobs as ids and values, its finish --
so the bytes and the work per step are proportional to the tokens made in that step, however
long the streams are. The frontend (kvserve/frontend/) turns them into text and outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sample.params import SamplingParams
from kvserve.sample.params import Sampled  # noqa: F401 (one position's token and logprobs)


@dataclass
class EngineCoreRequest:
    """A request as the core takes it: already tokenized and validated (frontend/processor.py)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None
    tenant_weight: float = 1.0


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence (sample `index` of its request) made in one step."""

    index: int
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Sampled] | None = None      # one per new token, when logprobs were asked
    finish_reason: str | None = None               # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None                 # the stop token id that ended it
    error: str | None = None
    error_code: str | None = None                  # "grammar_error": the request's own grammar failed it


@dataclass(slots=True)
class BeamResult:
    """A finished beam search's hypothesis, as ids: the frontend decodes its text."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """One user request's change in one step."""

    request_id: str
    seqs: list[SequenceDelta]
    finished: bool
    timestamp: float                               # time.monotonic() when the step's tokens came
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    new_prompt_logprobs: list[Sampled] | None = None   # entries for prompt tokens, in order
    beams: list[BeamResult] | None = None          # a finished beam search: the best n, best first
    error: str | None = None                       # a failed beam search's reason


@dataclass(frozen=True)
class CoreLimits:
    """What a request is checked against before it reaches the core (frontend/processor.py)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    watermark_blocks: int
    eos_token_id: int | None
    max_grammar_compile_s: float = 10.0           # a structured-outputs check's deadline
    kv_stream_role: str | None = None             # "prefill" | "decode": takes kv_transfer_params
    kv_stream_address: str | None = None          # decode: where its KV streams come in (host:port)
