"""The grammar mask, the first logits processor of a constrained row (structured outputs).

The core computes each constrained sampling sequence's bitmask of allowed tokens before the step
(structured/matcher.py's `grammar_bitmasks`: int32 words, bit j of word w allows token 32 w + j);
here the rows get -inf on every token their grammar forbids, in place, before penalties, greedy,
top-k/p and logprobs: every later stage sees only the tokens the grammar allows. Ids past the
grammar's vocabulary are never allowed.
"""
from __future__ import annotations

import numpy as np
import torch


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 bitmasks -> [R, vocab_size] bool, True where the token is not allowed."""
    bits = np.unpackbits(~np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    bits = bits[:, :vocab_size]
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])), constant_values=1)
    return bits.view(np.bool_)


def apply_grammar_bitmask(x: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> list[int]:
    """In place: x[rows[i]] [V] keeps only the tokens bitmask[i] allows (-inf elsewhere).
    Returns the indices i whose row allows no token of the model's vocabulary."""
    forbidden = forbidden_tokens(bitmask, x.shape[1])                     # [R, V]
    (fill_rows_numpy if x.device.type == "cpu" else fill_rows_torch)(x, rows, forbidden)
    return [i for i in range(len(rows)) if forbidden[i].all()]


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
