"""Structured outputs: a request's output constrained, token by token, to a JSON schema, a
regex, a choice of strings or a grammar (vLLM's `structured_outputs`; llguidance compiles them
against the model's own tokenizer).

    StructuredOutputsParams(json=... | regex=... | choice=[...] | grammar=... | json_object=True)
        SamplingParams(structured_outputs=...) takes it (kvserve/structured/params.py)
    check_structured_outputs(params, tokenizer_or_engine, vocab_size=None)
        ValueError, with the compiler's message, unless `params` (StructuredOutputsParams or a
        SamplingParams) compiles against the tokenizer (a kvserve tokenizer, or anything with a
        `.tokenizer`: LLMEngine, EngineCore). The Processor calls it for every request; a server
        building its own StructuredOutputsParams (response_format, tools) may call it first.

The path of a constrained request: the Processor checks it (check_structured_outputs); the
core queues its sequences in WAITING_FOR_GRAMMAR while a worker thread compiles the grammar
(compiler.py, cached by spec; waiting.py, bounded by --max-grammar-compile-s); each sequence gets
its own matcher (matcher.py); every step the sampling stage masks its logits row with the
matcher's bitmask before anything else (worker/sampling.py), and the scheduler advances the
matcher with the accepted token and stops the sequence when the grammar is complete.
"""
from __future__ import annotations

from kvserve.structured.params import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputsParams

__all__ = ["MAX_STRUCTURED_SPEC_BYTES", "StructuredOutputsParams", "check_structured_outputs"]


def check_structured_outputs(params, tokenizer_or_engine, vocab_size: int | None = None) -> None:
    """Raise ValueError (the compiler's message) unless `params` compiles (see the module doc)."""
    from kvserve.structured.compiler import check_grammar, ll_tokenizer

    params = getattr(params, "structured_outputs", params)
    if params is None:
        return
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}.")
    tokenizer = getattr(tokenizer_or_engine, "tokenizer", tokenizer_or_engine)
    check_grammar(params, ll_tokenizer(tokenizer, vocab_size))
