"""Processor: a user's prompt and SamplingParams -> an EngineCoreRequest (the frontend).

Tokenizing and every check a request needs before the core sees it happen here, once, each
with one message (DESIGN.md: a ValueError saying what to change; the server answers 400): the
prompt's form, empty prompts, token ids outside the vocabulary, the context window
(`context_max_tokens`: max_model_len, the core's served one, no more than the whole KV pool
holds, against the prompt, max_tokens and min_tokens; the server calls it too), n / beam_width
against max_num_seqs, a beam search that may need more blocks than the pool has, a structured-outputs grammar that
does not compile against the tokenizer, truncate_prompt_tokens (the prompt's last k tokens) and
bad_words as token ids (`SamplingParams.update_from_tokenizer`), the cache salt and the scheduling fields. The core
trusts what it gets (`CoreLimits` are its numbers).
"""
from __future__ import annotations

import time

from kvserve.engine.core_io import CoreLimits, EngineCoreRequest
from kvserve.engine.fairness import PROMPT_FIELDS, prompt_fields
from kvserve.kv.manager import cdiv
from kvserve.kv.stream_wire import parse_address
from kvserve.sample.params import SamplingParams
from kvserve.structured import check_structured_outputs


class ContextLengthError(ValueError):
    """A request that does not fit the served context (`param`: the field to change); the server
    answers it as OpenAI's 400 context_length_exceeded."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def context_max_tokens(lim: CoreLimits, prompt_len: int, requested: int | None, min_tokens: int = 0) -> int:
    """The context-window rule (vLLM's and OpenAI's), the one check of max_model_len against a
    generating request: the prompt must leave room for a token; `requested` max_tokens must fit
    beside it; without one, the request gets what the context leaves, which must hold
    min_tokens. Returns the max_tokens the request runs with."""
    limit = lim.max_model_len
    pool = (" (max_model_len is all the KV pool holds: raise kv_cache_memory / num_kv_blocks)"
            if limit == lim.num_kv_blocks * lim.block_size else "")
    if prompt_len >= limit:
        raise ContextLengthError(f"This model's maximum context length is {limit} tokens{pool}. However, "
                                 f"your prompt has {prompt_len} tokens. Please reduce the length of the "
                                 "prompt.", "prompt")
    if requested is None:
        if prompt_len + min_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens{pool}. However, you requested at "
                f"least {prompt_len + min_tokens} tokens ({prompt_len} in the prompt, min_tokens "
                f"{min_tokens}). Please reduce the prompt or min_tokens.", "min_tokens")
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens{pool}. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            "completion). Please reduce the prompt or max_tokens.", "max_tokens")
    return requested


def truncated(token_ids: list, keep: int | None, max_model_len: int) -> list:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len; None:
    all of them)."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


class Processor:
    def __init__(self, tokenizer, limits: CoreLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, request_id: str, prompt, params: SamplingParams | None = None,
                arrival_time: float | None = None, prompt_text: str | None = None,
                cache_salt: str | None = None) -> tuple[EngineCoreRequest, str | None]:
        """(the core's request, the prompt's text if known). A prompt is a string, a list of
        token ids, or {"prompt": str} / {"prompt_token_ids": [...]} with optional "cache_salt"
        and scheduling fields (engine/fairness.py). Raises ValueError on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams.")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string.")
        prompt_text, token_ids = self._tokenize(prompt, prompt_text)
        kept = truncated(token_ids, params.truncate_prompt_tokens, self.limits.max_model_len)
        if len(kept) < len(token_ids):
            prompt_text, token_ids = None, kept      # the text is no longer the prompt's
        params.update_from_tokenizer(self.tokenizer)     # bad_words as token ids
        self.check(token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        return EngineCoreRequest(request_id, token_ids, params, arrival, cache_salt,
                                 **prompt_fields(prompt)), prompt_text

    def _tokenize(self, prompt, prompt_text):
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", *PROMPT_FIELDS}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}: a prompt dict has "
                                 "'prompt' or 'prompt_token_ids', and optionally 'cache_salt'.")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt", prompt_text), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompt_token_ids.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return prompt_text, list(prompt)
        raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}.")

    def check(self, token_ids: list, params: SamplingParams) -> None:
        """Every limit a request meets, checked once (see the module docstring)."""
        lim = self.limits
        n_prompt, max_len = len(token_ids), lim.max_model_len
        if n_prompt == 0:
            raise ValueError("the prompt is empty: give at least one token.")
        # offline, a max_tokens past the context is cut by it ("length"), as in vLLM's LLM
        context_max_tokens(lim, n_prompt, None, params.min_tokens)
        vocab = lim.vocab_size
        bad = next((t for t in token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab}).")
        params.verify_for_model(vocab)
        if params.kv_transfer_params is not None:
            check_kv_transfer(params.kv_transfer_params, lim.kv_stream_role)
        if params.structured_outputs is not None:     # the compiler's message, before anything queues
            check_structured_outputs(params.structured_outputs, self.tokenizer, vocab, lim)
        seats = params.beam_width if params.use_beam_search else params.n
        if seats > lim.max_num_seqs:
            what = "beam_width" if params.use_beam_search else "n"
            raise ValueError(f"{what}={seats} needs {seats} sequences at once but max_num_seqs is "
                             f"{lim.max_num_seqs}: lower {what} or raise max_num_seqs.")
        num_blocks, bs = lim.num_kv_blocks, lim.block_size
        if params.use_beam_search:
            max_new = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
            need = params.beam_width * cdiv(min(n_prompt + max_new, max_len), bs)
            room = num_blocks - lim.watermark_blocks
            if need > room:
                raise ValueError(f"beam search with beam_width={params.beam_width} may need {need} KV "
                                 f"blocks but the pool has {room}: lower beam_width or max_tokens, "
                                 "or raise kv_cache_memory / num_kv_blocks.")


def check_kv_transfer(ktp: dict, role: str | None) -> None:
    """kv_transfer_params only where this instance streams KV in that role (engine/remote_kv.py)."""
    want = "prefill" if "stream_to" in ktp else "decode"
    if role != want:
        raise ValueError(f"kv_transfer_params {'with' if want == 'prefill' else 'without'} 'stream_to' needs "
                         f"a --kv-role {want} --kv-transfer stream instance; this one is "
                         f"{'not streaming KV' if role is None else 'the ' + role + ' side'}.")
    if "stream_to" in ktp:
        parse_address(ktp["stream_to"])
