"""The OpenAI wire format: pydantic request/response schemas and the error shape.

Requests are validated here, before anything reaches the engine: a wrong type, an out-of-range
number, an empty message list or text that is not valid Unicode becomes an `APIError` (HTTP 400
in OpenAI's `{"error": {"message", "type", "param", "code"}}` shape), never an exception inside
the engine loop. Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI
parameters still work; known fields of the wrong type are rejected.

Beyond OpenAI's parameters the requests accept vLLM's sampling extensions with vLLM's names:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, and `cache_salt` (only requests with the
same salt share prefix-cache blocks).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from kvserve.sample.params import (
    INT64_MAX, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE, REPETITION_PENALTY_RANGE)

MAX_N = 16
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_LOGIT_BIAS = 300              # logit_bias is not supported (ignored), but never unbounded
MAX_CACHE_SALT_CHARS = 1024
# List (and map) fields counted before their items are validated: server/limits.py.
LIST_FIELD_LIMITS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
                     "messages": MAX_MESSAGES, "logit_bias": MAX_LOGIT_BIAS}


def _real(lo=None, hi=None, *, gt=None):
    """An optional finite float field (JSON's NaN / Infinity and 1e400 are refused)."""
    return Field(None, ge=lo, le=hi, gt=gt, allow_inf_nan=False)


TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
StopString = StrictStr            # non-empty, at most MAX_STOP_STRING_CHARS: _stop_valid


class APIError(Exception):
    """An error the client caused or must handle; rendered as OpenAI's error JSON."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def validation_error_to_api_error(err: ValidationError) -> APIError:
    """The first pydantic error as a one-line message naming the offending field."""
    errors = err.errors()
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if not _is_union_tag(x)]
    param = ".".join(str(x) for x in loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    if len(same_field) > 1 and len(first.get("loc", ())) > len(loc):
        # A union field (prompt, stop, content) where no member matched.
        msg = f"invalid type ({_UNION_HINTS.get(str(loc[-1]), 'see the API reference')})"
    return APIError(f"{param}: {msg}" if param else msg, param=param)


_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "expected a string or a list of strings",
    "content": "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts; "
               "only text is supported",
}


def _is_union_tag(x) -> bool:
    # pydantic puts the union member it tried into `loc` (e.g. 'str', 'list[int]').
    return isinstance(x, str) and (x in ("str", "int", "bool", "float") or "[" in x
                                   or x.startswith("function-"))


def check_text(s: str, param: str) -> str:
    """Reject strings that are not valid Unicode (JSON `\\ud800` escapes decode to lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid UTF-8 (it holds an unpaired surrogate)") from None
    return s


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Sampling parameters shared by both endpoints (OpenAI's plus vLLM's extensions)."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = _real(0.0, MAX_TEMPERATURE)
    top_p: Optional[float] = _real(None, 1.0, gt=0.0)
    top_k: Optional[int] = Field(None, ge=-1, le=INT64_MAX)
    min_p: Optional[float] = _real(0.0, 1.0)
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Optional[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]]] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: Optional[float] = _real(-2.0, 2.0)
    frequency_penalty: Optional[float] = _real(-2.0, 2.0)
    repetition_penalty: Optional[float] = _real(*REPETITION_PENALTY_RANGE)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)     # vLLM's: lower runs first (--scheduling-policy priority)
    semantic_cache: bool = True         # false: this request skips the semantic answer cache

    @field_validator("stop")
    @classmethod
    def _stop_valid(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        for s in items:
            check_text(s, "stop")
            if s == "":
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long")
        return v

    @field_validator("user")
    @classmethod
    def _user_valid(cls, v):
        return check_text(v, "user") if v is not None else v

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams`, defaults left to the engine."""
        kw: dict[str, Any] = {"n": self.n, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                              "skip_special_tokens": self.skip_special_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "stop_token_ids"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return kw


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[int] = Field(16, ge=0, le=INT64_MAX)   # 0 only with echo: score the prompt
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False                                  # with logprobs: the prompt's too
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_valid(cls, v):
        if isinstance(v, str):
            return check_text(v, "prompt")
        if len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        for item in v:
            if isinstance(item, str):
                check_text(item, "prompt")
            elif isinstance(item, list) and len(item) == 0:
                raise ValueError("a token-id prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]            # one prompt given as token ids
        return list(p)                  # list of strings, or list of token-id lists


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


ContentParts = Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, ContentParts]] = None
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content_valid(cls, v):
        if isinstance(v, str):
            check_text(v, "content")
        elif v is not None:
            for part in v:
                check_text(part.text, "content")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""
    messages: list[ChatMessageParam] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    echo: bool = False
    tools: Optional[list] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: OpenAI's error shape (`APIError.body()`)."""
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok", "error"]
    error: Optional[str] = None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[dict] = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
