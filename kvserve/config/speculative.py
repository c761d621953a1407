"""`speculative_config`: what proposes the drafts and how many, with vLLM's field names.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "/path/to/small-model", "num_speculative_tokens": 4}     # method "draft_model"
    {"model": "self-int4", "num_speculative_tokens": 4}                # the target's weights in int4
    {"model": "self", ...}                                             # the target itself (tests)

`disable_by_batch_size`: speculation is off for a step whose running batch has more sequences
than this (at large batch a step is no longer memory-bound, so verifying drafts costs compute
the batch already uses). kvserve's defaults when neither lookup bound is given: max 5, min 1
(vLLM: when one is given, the other defaults to it; kvserve does the same).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
# The default load threshold on CPU (config/resolved.py applies it): a CPU step is compute-bound
# from a few sequences on, so verifying k + 1 rows each then costs more than it saves
# (benchmarks/results/spec.md: batch 8 at 0.74x, batch 1 up to 1.6x).
CPU_SPEC_DISABLE_BY_BATCH_SIZE = 4
SELF_DRAFTS = {"self": None, "self-int8": "int8", "self-int4": "int4"}   # model name -> quantization
KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "quantization", "max_backoff_steps"}
DEFAULT_MAX_BACKOFF_STEPS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: str | None = None                 # draft_model: a path, or "self" / "self-int8" / "self-int4"
    quantization: str | None = None          # draft_model: quantize the draft's weights at load
    disable_by_batch_size: int | None = None
    # A sequence whose whole draft was rejected sits out 1, 2, 4, ... steps, at most this many,
    # before it speculates again; an accepted draft resets it (0: always speculate).
    max_backoff_steps: int = DEFAULT_MAX_BACKOFF_STEPS

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict, a JSON string (the CLI flag), a SpeculativeConfig, or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): pass e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'.') from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict (or its JSON), e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        unknown = set(value) - KEYS
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {sorted(unknown)}: known keys are {sorted(KEYS)}.")
        method = value.get("method")
        model = value.get("model")
        if method in ("draft", "draft_model") or (method is None and model is not None):
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be 'ngram' or 'draft_model' (give 'model'), "
                             f"got {method!r}.")
        if method == "draft_model" and not model:
            raise ValueError("speculative_config method 'draft_model' needs 'model': a model path, "
                             "'self', 'self-int8' or 'self-int4'.")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config: 'model' is for a draft model; drop it for method 'ngram'.")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in [1, 64], got {k!r}.")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = 1, 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
        off = value.get("disable_by_batch_size")
        if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {off!r}.")
        quant = value.get("quantization")
        if quant is not None and method != "draft_model":
            raise ValueError("speculative_config 'quantization' applies to a draft model only.")
        backoff = value.get("max_backoff_steps", DEFAULT_MAX_BACKOFF_STEPS)
        if not isinstance(backoff, int) or isinstance(backoff, bool) or backoff < 0:
            raise ValueError(f"speculative_config max_backoff_steps must be an integer >= 0, got {backoff!r}.")
        return cls(method, k, hi, lo, model, quant, off, backoff)
