"""Structured outputs: a request's output constrained, token by token, to a JSON schema, a
regex, a choice of strings or a grammar (vLLM's `structured_outputs`; llguidance compiles them
against the model's own tokenizer).

    StructuredOutputsParams(json=... | regex=... | choice=[...] | grammar=... | json_object=True)
        SamplingParams(structured_outputs=...) takes it (kvserve/structured/params.py)
    check_structured_outputs(params, tokenizer_or_engine, vocab_size=None, limits=None, owner=None)
        GrammarRejected (a ValueError, with the compiler's message) unless `params`
        (StructuredOutputsParams or a SamplingParams) compiles against the tokenizer (a kvserve
        tokenizer, or anything with a `.tokenizer`: LLMEngine, EngineCore) to a grammar with a
        finite output; GrammarBusy when too many checks are in flight (`owner`'s or all).
        The Processor calls it for every request; the server calls it first, off its event loop.

The path of a constrained request: StructuredOutputsParams bounds what is cheap to bound
(bounds.py); the check compiles it in a worker process (sandbox.py), where a crash, a hang or
a memory blow-up of the compiler costs that worker only; the core queues its sequences in
WAITING_FOR_GRAMMAR while a thread compiles the grammar again in-process (compiler.py, cached by
spec; waiting.py, bounded by --max-grammar-compile-s from the compile's start); each sequence gets
its own matcher (matcher.py); every step the core computes the bitmask of each constrained
sequence that samples (engine/worker_view.py), the worker's sampler masks its logits row with
it before anything else (sample/grammar_mask.py), and the scheduler advances the
matcher with the accepted token and stops the sequence when the grammar is complete.
"""
from __future__ import annotations

from kvserve.structured.params import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputsParams
from kvserve.structured.sandbox import DEFAULT_MAX_FORCED_TOKENS, GrammarBusy, GrammarRejected, sandbox_for

__all__ = ["MAX_STRUCTURED_SPEC_BYTES", "GrammarBusy", "GrammarRejected", "StructuredOutputsParams",
           "check_structured_outputs"]


def check_structured_outputs(params, tokenizer_or_engine, vocab_size: int | None = None, limits=None,
                             owner: str | None = None) -> None:
    """Raise GrammarRejected / GrammarBusy unless `params` compiles (see the module doc);
    `limits`: the engine's CoreLimits (its deadline and max_model_len), read from the engine
    when one is given."""
    params = getattr(params, "structured_outputs", params)
    if params is None:
        return
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}.")
    tokenizer = getattr(tokenizer_or_engine, "tokenizer", tokenizer_or_engine)
    limits = limits if limits is not None else _engine_limits(tokenizer_or_engine)
    if limits is None:
        sandbox_for(tokenizer, vocab_size).check(params, 10.0, DEFAULT_MAX_FORCED_TOKENS, owner)
    else:
        sandbox_for(tokenizer, vocab_size or limits.vocab_size).check(
            params, limits.max_grammar_compile_s, limits.max_model_len, owner)


def _engine_limits(engine):
    """An engine's CoreLimits (LLMEngine, EngineCore), or None for a bare tokenizer."""
    for holder in (engine, getattr(engine, "core", None)):
        limits = getattr(holder, "limits", None)
        if limits is not None and hasattr(limits, "max_grammar_compile_s"):
            return limits
    return None
