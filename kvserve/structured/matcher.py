"""One sequence's grammar state and the step's token masks (seed 000's sampling, constrained).

`SequenceGrammar` wraps the sequence's own llguidance matcher: the scheduler advances it with
every token the sequence accepts (`accept`, in `update_from_output`: one writer), and it is
`terminated` once the grammar admits nothing more (the sequence stops). EOS is in its mask only
where the grammar is complete. `mask_logits` sets -inf on every logit a constrained row's
grammar forbids, before any other sampling step: one int32 bitmask row per sequence
([R, ceil(V / 32)], bit j of word w allows token 32 w + j), filled by llguidance's executor
(several matchers in parallel, the GIL released).
"""
from __future__ import annotations

import weakref

import llguidance as llg
import numpy as np
import torch

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


def mask_logits(x: torch.Tensor, rows: list[int], grammars: list[SequenceGrammar]) -> dict[int, str]:
    """In place: x[rows[i]] [V] keeps only the tokens grammars[i] allows (-inf elsewhere).
    Returns {row: why} for rows whose grammar allows nothing (the caller fails them)."""
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor()
    V = x.shape[1]
    R, W = len(rows), (grammars[0].vocab_size + 31) // 32
    bitmask = torch.full((R, W), -1, dtype=torch.int32)                  # [R, W], on the CPU
    # (llguidance.torch does the same, but importing it imports torch's compiler: seconds)
    _executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                      bitmask.data_ptr(), W * 4, R)
    # bit j of word w is token 32 w + j: little-endian words, least significant bit first
    forbidden = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
    if forbidden.shape[1] < V:            # ids past the grammar's vocabulary: never allowed
        forbidden = np.pad(forbidden, ((0, 0), (0, V - forbidden.shape[1])), constant_values=1)
    forbidden = forbidden.view(np.bool_)                                 # [R, V]
    failed = {}
    for i, g in enumerate(grammars):
        if g.matcher.is_error() or forbidden[i].all():
            failed[rows[i]] = g.error if g.matcher.is_error() else "the grammar admits no token here"
    (fill_rows_numpy if x.device.type == "cpu" else fill_rows_torch)(x, rows, forbidden)
    return failed


def fill_rows_numpy(x: torch.Tensor, rows: list[int], forbidden: np.ndarray) -> None:
    """x[rows[i], forbidden[i]] = -inf, in place, one numpy pass per row (a CPU tensor)."""
    xn = x.numpy()
    for i, row in enumerate(rows):
        np.putmask(xn[row], forbidden[i], -np.inf)


@torch.inference_mode()      # the step's logits are inference tensors: writable only in it
def fill_rows_torch(x: torch.Tensor, rows: list[int], forbidden: np.ndarray) -> None:
    """The same on any device: one masked_fill over the rows, the mask copied to the device."""
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    x[idx] = x[idx].masked_fill(torch.from_numpy(forbidden).to(x.device), float("-inf"))
