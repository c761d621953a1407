"""Processor: a user's prompt and SamplingParams -> an EngineCoreRequest (the frontend).

Tokenizing and every check a request needs before the core sees it happen here, once, each
with one message (DESIGN.md: a ValueError saying what to change; the server answers 400): the
prompt's form, empty prompts, token ids outside the vocabulary, a prompt at or over
max_model_len (the core's served one: no more than the whole KV pool holds), n / beam_width
against max_num_seqs, a beam search that may need more blocks than the pool has, a structured-outputs grammar that
does not compile against the tokenizer, the cache salt and the scheduling fields. The core
trusts what it gets (`CoreLimits` are its numbers).
"""
from __future__ import annotations

import time

from kvserve.engine.core_io import CoreLimits, EngineCoreRequest
from kvserve.engine.fairness import PROMPT_FIELDS, prompt_fields
from kvserve.kv.manager import cdiv
from kvserve.sample.params import SamplingParams
from kvserve.structured import check_structured_outputs


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
        if n_prompt >= max_len:
            if max_len == lim.num_kv_blocks * lim.block_size:       # the pool, not the model, limits it
                raise ValueError(f"the prompt has {n_prompt} tokens, but max_model_len is {max_len}, all "
                                 "the KV pool holds: shorten the prompt or raise kv_cache_memory / num_kv_blocks.")
            raise ValueError(f"the prompt has {n_prompt} tokens, but max_model_len is {max_len}: "
                             "shorten the prompt or raise max_model_len.")
        vocab = lim.vocab_size
        bad = next((t for t in token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab}).")
        params.verify_for_model(vocab)
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
