"""One sequence's grammar state and the step's token masks (seed 000's sampling, constrained).

`SequenceGrammar` wraps the sequence's own llguidance matcher: the scheduler advances it with
every token the sequence accepts (`accept`, in `update_from_output`: one writer), and it is
`terminated` once the grammar admits nothing more (the sequence stops). EOS is in its mask only
where the grammar is complete. `grammar_bitmasks` computes, in the core before each step, one
int32 bitmask row per constrained sampling sequence ([R, ceil(V / 32)], bit j of word w allows
token 32 w + j), filled by llguidance's executor (several matchers in parallel, the GIL
released); the worker's sampler applies them (sample/grammar_mask.py).
"""
from __future__ import annotations

import weakref

import llguidance as llg
import numpy as np

from kvserve.structured.compiler import matcher_error

_live: "weakref.WeakSet[SequenceGrammar]" = weakref.WeakSet()
_executor: llg.LLExecutor | None = None


def num_live_matchers() -> int:
    """Sequence grammars still referenced anywhere (finished and aborted ones are freed)."""
    return len(_live)


class SequenceGrammar:
    """A sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "num_accepted", "vocab_size", "__weakref__")

    def __init__(self, compiled: llg.LLMatcher, vocab_size: int):
        self.matcher = compiled.deep_copy()
        self.num_accepted = 0
        self.vocab_size = vocab_size            # the llguidance tokenizer's: the mask's width in bits
        _live.add(self)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and `error` says why) if the grammar rejects it."""
        ok = self.matcher.consume_token(token_id)
        self.num_accepted += ok
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is complete and admits no further token (EOS consumed, or no extension)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return "the output left its grammar: " + (matcher_error(self.matcher) or "no reason given")


NO_ALLOWED_TOKEN = "the grammar admits no token here"


def grammar_bitmasks(grammars: list[SequenceGrammar]) -> tuple[np.ndarray, dict[int, str]]:
    """The allowed tokens of each grammar's next position: [R, ceil(V / 32)] int32, bit j of word
    w allows token 32 w + j (little-endian words, least significant bit first), filled by
    llguidance's executor; and {i: why} for grammars that allow nothing (the caller fails them)."""
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor()
    R, W = len(grammars), (grammars[0].vocab_size + 31) // 32
    bitmask = np.full((R, W), -1, dtype=np.int32)                        # [R, W]
    # (llguidance.torch does the same, but importing it imports torch's compiler: seconds)
    _executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                      bitmask.ctypes.data, W * 4, R)
    failed = {}
    for i, g in enumerate(grammars):
        if g.matcher.is_error():
            failed[i] = g.error
        elif not bitmask[i].any():
            failed[i] = NO_ALLOWED_TOKEN
    return bitmask, failed
