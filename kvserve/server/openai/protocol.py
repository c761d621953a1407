"""The OpenAI wire format: pydantic request/response schemas and the error shape.

Requests are validated here, before anything reaches the engine: a wrong type, an out-of-range
number, an empty message list or text that is not valid Unicode becomes an `APIError` (HTTP 400
in OpenAI's `{"error": {"message", "type", "param", "code"}}` shape), never an exception inside
the engine loop. Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI
parameters still work; known fields of the wrong type are rejected.

These models' JSON Schema is the served one (/openapi.json, server/openapi.py), and every check
of a body's fields is in it: strict types, `Field` bounds and lengths, `Literal` enums, the
rules between two fields as `if`/`then` (server/openai/request_rules.py). What needs the tokenizer, the
model or the server's settings comes later, as a 4xx with a code in `SEMANTIC_ERROR_CODES`.

The output constraints (`response_format`, vLLM's `structured_outputs` and `guided_*`, llama.cpp's
`json_schema` and `grammar`) are server/openai/structured_fields.py's, the tool fields (`tools`,
`tool_choice`, `parallel_tool_calls`, the history's `tool_calls`) server/openai/tool_fields.py's.

Beyond OpenAI's parameters the requests accept vLLM's sampling extensions with vLLM's names:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, and `cache_salt` (only requests with the
same salt share prefix-cache blocks); the others of vLLM and llama-server: extension_fields.py.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.sample.params import (
    MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, INT64_MAX, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, SEED_MAX)
from kvserve.server.openai.wire_types import Strict as _Strict
from kvserve.server.openai.wire_types import Text
from kvserve.server.openai.request_rules import (
    CONSTRAINTS_CODE, EXTENSION_RULE_CODE, MIN_TOKENS_CODE, NOT_NULL, Implies, check_rules, conflicting_constraints_error,
    min_tokens_error, rules_schema)
from kvserve.server.openai.chat_fields import (
    CONTINUE_RULE, MAX_DOCUMENTS, MAX_TEMPLATE_KWARGS, ChatTemplateFields, RefusedChatFields)
from kvserve.server.openai.structured_fields import ConstraintFields
from kvserve.server.openai.extension_fields import LENGTH_PENALTY_RULE, ExtensionFields
from kvserve.server.openai.tool_fields import (
    MAX_TOOLS, DeltaToolCall, NamedToolChoice, ToolCall, ToolCallsParam, ToolFields)

MAX_N = 16
MAX_SEED = SEED_MAX - (MAX_N - 1)   # sample i of n is seeded with seed + i, an unsigned 64-bit value
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_CACHE_SALT_CHARS = 1024
# List (and map) fields counted before their items are validated: server/limits.py.
LIST_FIELD_LIMITS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
                     "messages": MAX_MESSAGES, "logit_bias": MAX_LOGIT_BIAS, "tools": MAX_TOOLS,
                     "chat_template_kwargs": MAX_TEMPLATE_KWARGS, "bad_words": MAX_BAD_WORDS,
                     "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS, "documents": MAX_DOCUMENTS}


def _real(lo=None, hi=None, *, gt=None):
    """An optional finite float field (JSON's NaN / Infinity and 1e400 are refused)."""
    return Field(None, ge=lo, le=hi, gt=gt, allow_inf_nan=False)


TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# logit_bias keys: token ids written as strings (JSON object keys), at most 18 digits (< 2**63)
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,17})$"
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_KEY)]
LogitBias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1], allow_inf_nan=False)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]


# The codes of the 4xx whose check needs the tokenizer, the model, the server's settings or two
# numbers at once, which no request schema can state (docs/serving/fields.md): a body
# the served schema admits gets no other 4xx.
PRIORITY_CODE = "priority_not_supported"  # priority on a server whose scheduling policy ignores it
ENGINE_REJECTED = "engine_rejected"     # add_request refused it: a token id outside the vocabulary,
                                        # n over max_num_seqs, a prompt the KV pool cannot hold
INVALID_TOOLS = "invalid_tools"         # tools and tool_choice disagree (server/openai/tool_choice.py)
INVALID_STRUCTURED_OUTPUT, GRAMMAR_ERROR = "invalid_structured_output", "grammar_error"   # spec refused; failed decoding
NO_MESSAGE_CODE = "no_input_message"       # a Responses input of reasoning items alone
SAMPLING_RULE_CODE = "sampling_params_conflict"   # SamplingParams refused fields that conflict (beams + ...)
SEMANTIC_ERROR_CODES = ("context_length_exceeded", EXTENSION_RULE_CODE, NO_MESSAGE_CODE, SAMPLING_RULE_CODE, ENGINE_REJECTED, INVALID_STRUCTURED_OUTPUT, GRAMMAR_ERROR, "model_not_found", "chat_template_error",
                        MIN_TOKENS_CODE, "too_many_prompts", INVALID_TOOLS, CONSTRAINTS_CODE, PRIORITY_CODE,
                        "invalid_token_id", "previous_response_not_found", "response_not_found",
                        "unsupported_task")


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


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(ConstraintFields, ExtensionFields):
    """Sampling parameters shared by both endpoints (OpenAI's plus vLLM's extensions), the
    output constraints (server/openai/structured_fields.py) and vLLM's and llama-server's
    further fields (server/openai/extension_fields.py)."""
    RULES: ClassVar[tuple] = ()

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = _real(0.0, MAX_TEMPERATURE)
    top_p: Optional[float] = _real(None, 1.0, gt=0.0)
    top_k: Optional[int] = Field(None, ge=-1, le=INT64_MAX)
    min_p: Optional[float] = _real(0.0, 1.0)
    seed: Optional[int] = Field(None, ge=-1, le=MAX_SEED)       # -1: none (vLLM's)
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
    user: Optional[Text] = None
    cache_salt: Optional[Text] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)     # vLLM's: lower runs first (--scheduling-policy priority)
    semantic_cache: bool = True         # false: this request skips the semantic answer cache
    logit_bias: Optional[dict[TokenIdKey, LogitBias]] = Field(     # OpenAI's; keys: token ids
        None, max_length=MAX_LOGIT_BIAS, json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY}})
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)     # vLLM's: the prompt tokens' logprobs
    return_tokens_as_token_ids: bool = False        # vLLM's: logprobs name tokens "token_id:N"

    @model_validator(mode="after")
    def _rules_hold(self):
        self.resolve_extensions()
        check_rules(self, self.RULES)
        given = self.given_constraints()
        if len(given) > 1:
            raise conflicting_constraints_error(given)
        max_tokens = self.requested_max_tokens()
        if max_tokens and self.min_tokens > max_tokens:     # (0: echo scores the prompt only)
            raise min_tokens_error(self.min_tokens, max_tokens)
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

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
        if self.logit_bias:
            kw["logit_bias"] = {int(t): float(b) for t, b in self.logit_bias.items()}
        return {**kw, **self.sampling_extensions()}


_NOT_STREAMED = Implies("prompt_logprobs", NOT_NULL, "stream", False,
                        "prompt_logprobs is not available when stream is true (vLLM's rule)")
_COMPLETION_RULES = (_NOT_STREAMED, LENGTH_PENALTY_RULE,
    Implies("max_tokens", {"const": 0}, "echo", True,
            "max_tokens=0 is only allowed with echo=true (score the prompt, generate nothing)"),
    Implies("best_of", {"const": 1}, "n", 1, "best_of must equal n (only 1 is supported; use n)"),
)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""
    model_config = ConfigDict(json_schema_extra=rules_schema(_COMPLETION_RULES))
    RULES: ClassVar[tuple] = _COMPLETION_RULES

    prompt: Union[Text, NonEmpty[list[TokenId]], NonEmpty[list[Text]],
                  NonEmpty[list[NonEmpty[list[TokenId]]]]]
    max_tokens: Optional[int] = Field(16, ge=0, le=INT64_MAX)   # 0 only with echo: score the prompt
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False                                  # with logprobs: the prompt's too
    best_of: Optional[Literal[1]] = None                # OpenAI's; only 1 (= n): use n
    suffix: Optional[Annotated[str, Field(max_length=0)]] = None    # not supported: only "" or null
    add_special_tokens: bool = True                     # vLLM's: the tokenizer's BOS (and such) on text prompts


class TextContentPart(_Strict):
    type: Literal["text"]
    text: Text


ContentParts = Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)]


_MESSAGE_RULES = (Implies("tool_calls", NOT_NULL, "role", "assistant", "only assistant messages make tool calls"),)


class ChatMessageParam(_Strict):
    model_config = ConfigDict(json_schema_extra=rules_schema(_MESSAGE_RULES))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, ContentParts]] = None
    name: Optional[Text] = None
    tool_calls: Optional[ToolCallsParam] = None     # an assistant's calls
    tool_call_id: Optional[Text] = None             # a tool message: the call it answers

    @model_validator(mode="after")
    def _rules_hold(self):
        check_rules(self, _MESSAGE_RULES)
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


_CHAT_RULES = (Implies("top_logprobs", NOT_NULL, "logprobs", True, "top_logprobs needs logprobs: true"),
               _NOT_STREAMED, CONTINUE_RULE, LENGTH_PENALTY_RULE)


class ChatCompletionRequest(_SamplingFields, ToolFields, ChatTemplateFields, RefusedChatFields):
    """`POST /v1/chat/completions` (the template and refused fields: server/openai/chat_fields.py)."""
    model_config = ConfigDict(json_schema_extra=rules_schema(_CHAT_RULES))
    RULES: ClassVar[tuple] = _CHAT_RULES

    messages: list[ChatMessageParam] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False          # vLLM's: the answer starts with the last message's text when it is the assistant's

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def given_constraints(self) -> list[str]:
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        return super().given_constraints() + (["tool_choice"] if forced else [])   # a forced call is one


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


# vLLM's prompt_logprobs: per prompt token (None for the first) token id -> logprob, rank, decoded_token
PromptLogprobs = list[Optional[dict[str, dict[str, Any]]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


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
    reasoning_content: Optional[str] = None     # --reasoning-parser: the model's thought (vLLM's field)
    tool_calls: Optional[list[ToolCall]] = None


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
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


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
