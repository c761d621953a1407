"""The request and response bodies of llama-server's routes (server/llama_routes.py): its
/completion and /infill fields under llama-server's names, typed so that /openapi.json states
what is accepted.

Fields llama-server has and kvserve does not build are typed to their neutral value in the
schema and refused otherwise, naming the field (REFUSED, REFUSED_LISTS): mirostat,
dynatemp_range, typical_p, xtc_probability, dry_multiplier, top_n_sigma, min_keep, n_keep,
n_discard, n_indent, t_max_predict_ms, presence_penalty / frequency_penalty (llama.cpp counts
them over the last repeat_last_n tokens, prompt included; /v1/completions has OpenAI's),
post_sampling_probs, timings_per_token, grammar_lazy, return_progress, samplers, lora,
grammar_triggers, preserved_tokens, response_fields, image_data, multimodal_data, input_extra.
The parameters only such a sampler reads (mirostat_tau, dry_base, ...) are accepted with no
effect, as llama-server gives them none with the sampler off.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvserve.sample.params import (
    INT64_MAX, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE, REPETITION_PENALTY_RANGE)
from kvserve.server.openai.protocol import MAX_SEED, NonEmpty, StopString, TokenId
from kvserve.server.openai.request_rules import RULE_ERROR
from kvserve.server.openai.wire_types import Strict, Text

# llama-server's sampling defaults (its --temp, --top-k, --top-p, --min-p)
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _neutral(value, what: str):
    """A field llama-server has and kvserve does not build: only its neutral value (the schema's
    const), anything else refused naming it."""
    return Field(value, json_schema_extra={"const": value, "description": f"not built: {what}"})


def _refused(name: str, neutral, what: str):
    def check(cls, v):
        if v is not None and (v != neutral or isinstance(v, bool) != isinstance(neutral, bool)):     # (None: a type error)
            raise PydanticCustomError("not_built", "{what} is not built in kvserve; leave it out or send "
                                      "{neutral}", {"what": what, "neutral": json.dumps(neutral)})
        return v
    return field_validator(name, mode="before")(classmethod(check))


# name -> (neutral value, what it would do)
REFUSED = {
    "mirostat": (0, "mirostat sampling"),
    "dynatemp_range": (0, "dynamic temperature"),
    "typical_p": (1, "llama.cpp's locally typical sampling"),
    "xtc_probability": (0, "XTC sampling"),
    "dry_multiplier": (0, "DRY repetition penalty"),
    "top_n_sigma": (-1, "top-n-sigma sampling"),
    "min_keep": (0, "min_keep (a floor under every truncating sampler)"),
    "n_keep": (0, "context shifting (a prompt over the context is refused, never shifted)"),
    "n_discard": (0, "context shifting"),
    "n_indent": (0, "n_indent (stop on indentation)"),
    "t_max_predict_ms": (0, "a time limit on generation"),
    "presence_penalty": (0, "llama.cpp's presence penalty over the last repeat_last_n tokens "
                            "(/v1/completions has OpenAI's, over the output)"),
    "frequency_penalty": (0, "llama.cpp's frequency penalty over the last repeat_last_n tokens "
                             "(/v1/completions has OpenAI's, over the output)"),
    "post_sampling_probs": (False, "post-sampling probabilities"),
    "timings_per_token": (False, "timings in every streamed chunk"),
    "grammar_lazy": (False, "lazy grammars"),
    "return_progress": (False, "prompt-progress chunks"),
}
REFUSED_LISTS = {
    "samplers": "a custom sampler order", "lora": "per-request LoRA adapters",
    "grammar_triggers": "lazy-grammar triggers", "preserved_tokens": "preserved tokens",
    "response_fields": "response field selection", "image_data": "images",
    "multimodal_data": "multimodal input",
}
# (null is the field absent: the rule binds a penalty given as a number other than 1)
_REPEAT_RULE = {"if": {"properties": {"repeat_penalty": {"not": {"enum": [1, None]}}}, "required": ["repeat_penalty"]},
                "then": {"properties": {"repeat_last_n": {"const": -1}}, "required": ["repeat_last_n"]}}

Real = Annotated[float, Field(allow_inf_nan=False)]
NPredict = Union[Literal[-1], Annotated[int, Field(ge=1, le=INT64_MAX)]]
LogitBias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1], allow_inf_nan=False)]
LogitBiasPair = Annotated[tuple[Annotated[int, Field(ge=0, le=INT64_MAX, strict=True)],
                                Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1],
                                                       allow_inf_nan=False, strict=True)]],
                          Field(strict=False)]      # (JSON's [id, bias] arrives as a list)


class LlamaCompletionRequest(Strict):
    """`POST /completion` (llama-server's fields; the module docstring says what each does)."""
    model_config = ConfigDict(json_schema_extra={"allOf": [_REPEAT_RULE]})

    model: Optional[str] = None
    prompt: Union[Text, NonEmpty[list[TokenId]]]
    n_predict: Optional[NPredict] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=0, le=INT64_MAX)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=-1, le=MAX_SEED)
    stop: Optional[Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]]] = None
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    cache_prompt: bool = True
    ignore_eos: bool = False
    logit_bias: Optional[Union[Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,17})$")], LogitBias],
                                         Field(max_length=MAX_LOGIT_BIAS,      # (the served schema says the keys' form)
                                               json_schema_extra={"propertyNames": {"pattern": r"^(0|[1-9][0-9]{0,17})$"}})],
                               Annotated[list[LogitBiasPair], Field(max_length=MAX_LOGIT_BIAS)]]] = None
    repeat_penalty: Optional[float] = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                            allow_inf_nan=False)
    repeat_last_n: Optional[Literal[-1, 0, 64]] = None     # -1 only with a penalty (_repeat_window); 0 and 64
                                                           # (llama-server's default) sent with none do nothing
    grammar: Optional[Text] = None
    json_schema: Optional[dict] = None
    return_tokens: bool = False
    id_slot: Literal[-1] = -1
    # llama-server's fields kvserve does not build: their neutral values only (REFUSED)
    mirostat: int = _neutral(0, REFUSED["mirostat"][1])
    dynatemp_range: float = _neutral(0, REFUSED["dynatemp_range"][1])
    typical_p: float = _neutral(1, REFUSED["typical_p"][1])
    xtc_probability: float = _neutral(0, REFUSED["xtc_probability"][1])
    dry_multiplier: float = _neutral(0, REFUSED["dry_multiplier"][1])
    top_n_sigma: float = _neutral(-1, REFUSED["top_n_sigma"][1])
    min_keep: int = _neutral(0, REFUSED["min_keep"][1])
    n_keep: int = _neutral(0, REFUSED["n_keep"][1])
    n_discard: int = _neutral(0, REFUSED["n_discard"][1])
    n_indent: int = _neutral(0, REFUSED["n_indent"][1])
    t_max_predict_ms: int = _neutral(0, REFUSED["t_max_predict_ms"][1])
    presence_penalty: float = _neutral(0, REFUSED["presence_penalty"][1])
    frequency_penalty: float = _neutral(0, REFUSED["frequency_penalty"][1])
    post_sampling_probs: bool = _neutral(False, REFUSED["post_sampling_probs"][1])
    timings_per_token: bool = _neutral(False, REFUSED["timings_per_token"][1])
    grammar_lazy: bool = _neutral(False, REFUSED["grammar_lazy"][1])
    return_progress: bool = _neutral(False, REFUSED["return_progress"][1])
    samplers: Optional[Annotated[list, Field(max_length=0)]] = None
    lora: Optional[Annotated[list, Field(max_length=0)]] = None
    grammar_triggers: Optional[Annotated[list, Field(max_length=0)]] = None
    preserved_tokens: Optional[Annotated[list, Field(max_length=0)]] = None
    response_fields: Optional[Annotated[list, Field(max_length=0)]] = None
    image_data: Optional[Annotated[list, Field(max_length=0)]] = None
    multimodal_data: Optional[Annotated[list, Field(max_length=0)]] = None
    # only read by a refused sampler, as in llama-server: accepted, with no effect
    mirostat_tau: Optional[Real] = None
    mirostat_eta: Optional[Real] = None
    dynatemp_exponent: Optional[Real] = None
    xtc_threshold: Optional[Real] = None
    dry_base: Optional[Real] = None
    dry_allowed_length: Optional[int] = None
    dry_penalty_last_n: Optional[int] = None
    dry_sequence_breakers: Optional[list[Text]] = None

    for _name, (_v, _what) in REFUSED.items():
        locals()[f"_check_{_name}"] = _refused(_name, _v, _what)
    for _name, _what in REFUSED_LISTS.items():
        locals()[f"_check_{_name}"] = _refused(_name, [], _what)
    del _name, _v, _what

    @field_validator("n_predict", mode="before")
    @classmethod
    def _n_predict(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and v < 1 and v != -1:
            raise ValueError("must be -1 (up to the context) or at least 1 (0, evaluating the prompt "
                             "alone, is not built)")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError("one prompt per request: a string or a list of token ids (kvserve does "
                             "not mix text and ids, nor answer several prompts here)")
        return v

    @model_validator(mode="after")
    def _repeat_window(self):
        if self.repeat_penalty is not None and self.repeat_penalty != 1 and self.repeat_last_n != -1:
            raise PydanticCustomError(RULE_ERROR, "repeat_penalty counts every token of the context in "
                                      "kvserve: send repeat_last_n -1 with it (llama-server's last-64 "
                                      "window is not built)", {"param": "repeat_last_n"})
        return self


class LlamaInfillRequest(LlamaCompletionRequest):
    """`POST /infill`: /completion's fields, with the text before and after the hole."""
    prompt: Union[Text, NonEmpty[list[TokenId]]] = ""
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Optional[Annotated[list, Field(max_length=0)]] = None     # repo-level context: not built
    _check_input_extra = _refused("input_extra", [], "repo-level context (input_extra)")


class Timings(BaseModel):
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: Optional[float]
    prompt_per_second: Optional[float]
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: Optional[float]
    predicted_per_second: Optional[float]


class LlamaCompletionResponse(BaseModel):
    """The 200 of `POST /completion` and `/infill` (and a stream's last chunk)."""
    index: int = 0
    content: str
    tokens: list[int]
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    tokens_cached: int
    generation_settings: dict
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: Literal["none", "eos", "limit", "word"]
    stopping_word: str
    timings: Timings
    completion_probabilities: Optional[list[dict]] = None


class PropsResponse(BaseModel):
    default_generation_settings: dict
    total_slots: int
    model_path: str
    chat_template: str
    bos_token: Optional[str]
    eos_token: Optional[str]
    modalities: dict
    build_info: str


class Slot(BaseModel):
    id: int
    n_ctx: int
    speculative: bool
    is_processing: bool
    params: dict


class SlotsResponse(RootModel[list[Slot]]):
    """The 200 of `GET /slots`: one entry per seat of the engine."""
