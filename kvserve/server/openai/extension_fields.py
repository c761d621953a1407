"""vLLM's and llama-server's request fields beyond OpenAI's, on both endpoints: each honoured or
refused with a 400 naming it, never accepted without effect.

vLLM's
    use_beam_search, length_penalty   beam search, `n` beams (vLLM's beam_width = n); length_penalty
                                      ranks them (without beams: only 1.0, vLLM's rule)
    bad_words, allowed_token_ids      vocabulary masks (kvserve/sample/sampler.py)
    truncate_prompt_tokens            keep the prompt's last k tokens (-1: max_model_len)
    spaces_between_special_tokens     kvserve writes adjacent special tokens as the tokenizer decodes
                                      them, with no space put between: `false`; an explicit `true`
                                      with skip_special_tokens false is refused
    request_id                        the response id's suffix (an X-Request-Id header wins, as in
                                      vLLM), echoed as X-Request-Id, and in the request log
    kv_transfer_params                a PD pair's KV transfer, as `kvserve proxy` sets it: {"transfer_id",
                                      "stream_to"} on a --kv-transfer stream prefill instance,
                                      {"transfer_id"} on a decode one (engine/remote_kv.py); elsewhere 400
llama-server's
    n_predict       max_tokens (-1: as the context allows); both given and different: 400
    repeat_penalty  repetition_penalty (over the whole context: llama's repeat_last_n -1)
    typical_p       locally typical sampling
    n_probs         top-n probabilities: completions' logprobs, chat's top_logprobs
    samplers        only kvserve's own order (SAMPLER_ORDER); any other order is refused
    cache_prompt    false: this request's prompt neither reads nor leaves reusable prefix-cache
                    blocks (a salt of its own); outputs are the same either way
    mirostat, dry_multiplier, id_slot   only their "off" values (0, 0, -1)
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

from pydantic import Field, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

from kvserve.sample.params import (
    INT64_MAX, MAX_ABS_LENGTH_PENALTY, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE)
from kvserve.server.openai.request_rules import EXTENSION_RULE_CODE, Implies
from kvserve.server.openai.wire_types import Strict, Text

MAX_REQUEST_ID_CHARS = 256
# kvserve's sampling order in llama-server's names (and as its one-letter form)
SAMPLER_ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p", "typ_p")
SAMPLER_CHARS = "etkpmy"
_REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]+")
_SAMPLER_ALIASES = {"typical_p": "typ_p", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p",
                    "typ-p": "typ_p", "typical-p": "typ_p"}

REFUSED_EXTENSIONS = {
    "mirostat": "mirostat is not supported (kvserve has no mirostat sampler): leave it out or 0",
    "dry_multiplier": "dry_multiplier is not supported (kvserve has no DRY sampler): leave it out or 0",
    "id_slot": "id_slot is not supported: kvserve schedules every request itself (leave it out or -1)",
}

BadWord = Annotated[Text, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]


def rule_error(param: str, message: str) -> PydanticCustomError:
    """A 400 naming `param` (server/body.py reads RULE_ERROR's ctx)."""
    return PydanticCustomError(EXTENSION_RULE_CODE, message, {"param": param})


# length_penalty ranks beams only (vLLM's rule): a schema rule of both endpoints (protocol.py)
LENGTH_PENALTY_RULE = Implies("length_penalty", {"not": {"enum": [None, 1.0]}}, "use_beam_search", True,
                              "length_penalty only ranks beams: it needs use_beam_search=true (vLLM's rule)")


class KVTransferParams(Strict):
    transfer_id: Text = Field(..., min_length=1, max_length=128)
    stream_to: Optional[Text] = Field(None, min_length=1, max_length=300)   # host:port (checked by the engine's frontend)


class ExtensionFields(Strict):
    # vLLM's
    use_beam_search: bool = False
    length_penalty: Optional[float] = Field(None, ge=-MAX_ABS_LENGTH_PENALTY, le=MAX_ABS_LENGTH_PENALTY,
                                            allow_inf_nan=False)
    bad_words: Optional[list[BadWord]] = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: Optional[list[Annotated[int, Field(ge=0, le=INT64_MAX)]]] = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=INT64_MAX)    # 0 refused
    spaces_between_special_tokens: bool = True
    request_id: Optional[Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]] = None
    kv_transfer_params: Optional[KVTransferParams] = None
    # llama-server's
    n_predict: Optional[int] = Field(None, ge=-1, le=INT64_MAX)
    repeat_penalty: Optional[float] = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                            allow_inf_nan=False)
    typical_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n_probs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # (the served schema states the one value each form may take, as the validator below checks)
    samplers: Optional[Union[Annotated[list[Text], WithJsonSchema({"const": list(SAMPLER_ORDER)})],
                             Annotated[Text, WithJsonSchema({"const": SAMPLER_CHARS})]]] = None
    cache_prompt: bool = True
    mirostat: Literal[0] = 0
    dry_multiplier: Literal[0] = 0
    id_slot: Literal[-1] = -1

    @field_validator("request_id")
    @classmethod
    def _request_id_chars(cls, v):
        # (checked here, not as a schema pattern: JSON Schema's "$" and the validator's differ on a
        # trailing newline, so the served schema would admit ids the server refuses)
        if v is not None and not _REQUEST_ID_CHARS.fullmatch(v):
            raise rule_error("request_id", "must be 1 to 256 characters of A-Z a-z 0-9 . _ : -")
        return v

    @field_validator("samplers")
    @classmethod
    def _kvserve_order(cls, v):
        if v is None:
            return v
        names = [SAMPLER_ORDER[SAMPLER_CHARS.index(c)] if c in SAMPLER_CHARS else c for c in v] \
            if isinstance(v, str) else [_SAMPLER_ALIASES.get(s, s) for s in v]
        if tuple(names) != SAMPLER_ORDER:
            raise ValueError(f"kvserve applies its samplers in one order, {list(SAMPLER_ORDER)} (\"{SAMPLER_CHARS}\"; "
                             "each off unless its parameter asks): give that order or leave samplers out")
        return v

    def resolve_extensions(self) -> None:
        """llama-server's aliases onto kvserve's fields (a conflict is a 400; n_probs: each
        endpoint's `resolve_n_probs`), and the rules between fields; run before the request's
        own rules."""
        if self.truncate_prompt_tokens == 0:
            raise rule_error("truncate_prompt_tokens", "must be >= 1, or -1 for max_model_len")
        if self.repeat_penalty is not None:
            if self.repetition_penalty is not None and self.repetition_penalty != self.repeat_penalty:
                raise rule_error("repeat_penalty", "repeat_penalty is llama-server's name for repetition_penalty: "
                                 "give one, or the same value")
            self.repetition_penalty = self.repeat_penalty
        if self.n_predict is not None:
            self._resolve_n_predict()
        if self.n_probs:
            self._resolve_n_probs(self.n_probs)
        if self.use_beam_search and self.stream:
            raise rule_error("use_beam_search", "beam search answers once the beams are ranked: it cannot "
                             "stream (set stream to false)")
        if ("spaces_between_special_tokens" in self.model_fields_set and self.spaces_between_special_tokens
                and not self.skip_special_tokens):
            raise rule_error("spaces_between_special_tokens", "kvserve writes adjacent special tokens as the "
                             "tokenizer decodes them, with no space put between: only false is honoured "
                             "when skip_special_tokens is false")

    def _resolve_n_predict(self) -> None:
        want = None if self.n_predict == -1 else self.n_predict
        for name in self.max_tokens_fields():
            if name in self.model_fields_set and getattr(self, name) != want:
                raise rule_error("n_predict", f"n_predict is llama-server's name for {name}: give one, or the same value")
        if want == 0 and "prompt" not in type(self).model_fields:     # (completions: 0 with echo)
            raise rule_error("n_predict", "n_predict 0 asks for no tokens: give at least 1, or -1")
        self.max_tokens = want

    def max_tokens_fields(self) -> tuple[str, ...]:
        return tuple(f for f in ("max_tokens", "max_completion_tokens") if f in type(self).model_fields)

    def _resolve_n_probs(self, k: int) -> None:
        """llama-server's n_probs (k > 0): completions' logprobs k; chat's logprobs true with
        top_logprobs k."""
        chat = "top_logprobs" in type(self).model_fields
        given = self.model_fields_set
        if chat and (("logprobs" in given and not self.logprobs) or ("top_logprobs" in given and self.top_logprobs != k)) \
                or not chat and "logprobs" in given and self.logprobs != k:
            raise rule_error("n_probs", f"n_probs is llama-server's name for {'top_logprobs' if chat else 'logprobs'}: "
                             "give one, or the same value")
        if chat:
            self.logprobs, self.top_logprobs = True, k
        else:
            self.logprobs = k

    def sampling_extensions(self) -> dict:
        """SamplingParams keywords of the extension fields."""
        kw: dict = {}
        if self.use_beam_search:
            kw.update(use_beam_search=True, beam_width=self.n)
        if self.length_penalty is not None:
            kw["length_penalty"] = self.length_penalty
        for name in ("bad_words", "allowed_token_ids", "truncate_prompt_tokens", "typical_p"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.kv_transfer_params is not None:
            kw["kv_transfer_params"] = self.kv_transfer_params.model_dump(exclude_none=True)
        return kw
