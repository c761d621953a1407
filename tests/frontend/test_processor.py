"""The frontend's one context-window rule (frontend/processor.py's `context_max_tokens`), used by
`LLM` (a ValueError) and the server (OpenAI's 400 context_length_exceeded, same message)."""
from __future__ import annotations

import pytest

from kvserve.engine.core_io import CoreLimits
from kvserve.frontend.processor import ContextLengthError, Processor, context_max_tokens
from kvserve.sample.params import SamplingParams


def limits(max_model_len: int, num_kv_blocks: int = 64, block_size: int = 16) -> CoreLimits:
    return CoreLimits(vocab_size=100, max_model_len=max_model_len, max_num_seqs=8, num_kv_blocks=num_kv_blocks,
                      block_size=block_size, watermark_blocks=0, eos_token_id=2)


def test_the_rule_gives_what_the_context_leaves_and_names_the_field_to_change():
    lim = limits(128)
    assert context_max_tokens(lim, 100, None) == 28 and context_max_tokens(lim, 100, 28) == 28
    for args, param in (((128, None), "prompt"), ((100, 29), "max_tokens"), ((100, None, 29), "min_tokens")):
        with pytest.raises(ContextLengthError, match="maximum context length is 128 tokens") as e:
            context_max_tokens(lim, *args)
        assert e.value.param == param and "KV pool" not in str(e.value)


def test_a_context_the_pool_limits_says_so():
    with pytest.raises(ContextLengthError, match="all the KV pool holds: raise kv_cache_memory"):
        context_max_tokens(limits(64, num_kv_blocks=4), 64, None)


def test_the_processor_refuses_what_cannot_fit_and_cuts_nothing_else():
    p = Processor(None, limits(16))
    req, _ = p.process("a", list(range(3, 13)), SamplingParams(max_tokens=100))   # offline: cut by "length"
    assert req.prompt_token_ids == list(range(3, 13))
    with pytest.raises(ValueError, match="your prompt has 16 tokens"):
        p.process("b", list(range(3, 19)), SamplingParams())
    with pytest.raises(ValueError, match="min_tokens 7"):
        p.process("c", list(range(3, 13)), SamplingParams(max_tokens=100, min_tokens=7))
