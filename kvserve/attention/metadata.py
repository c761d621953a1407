"""What one step tells attention (seed 003, "Why the cache needs pages"; seed 000, "Chunked
prefill"): the flat batch's slots, its decode rows' block tables and context lengths, its prefill
chunks. The worker's input batch fills it (worker/input_batch.py); a backend derives what it needs
from it once per step (`AttentionBackend.prepare`), so every layer reads, never rebuilds.

The batch is flat: decode tokens first (one per sequence), then the prefill chunks. Every new
token sees its own sequence's cached tokens and the new ones up to itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvserve.kv.block_pool import NULL_BLOCK


@dataclass
class PrefillChunk:
    """One sequence's new tokens `[q_start, q_start + q_len)` of the flat batch."""

    q_start: int
    q_len: int
    context_len: int                 # cached + new tokens: keys this chunk attends to
    block_table: torch.Tensor        # [>= cdiv(context_len, block_size)] int64


@dataclass
class PrefillLayout:
    """Every prefill chunk of a step as one padded batch for one attention call (built once per
    step, read by every layer). C chunks, Q = the longest chunk, L = the longest context."""

    num_chunks: int
    max_q: int
    num_keys: int
    q_index: torch.Tensor | None      # [C * Q]: prefill token of each padded query row (None: all
                                      # chunks Q long, the padded batch is a view)
    out_index: torch.Tensor | None    # [T_prefill]: padded row of each prefill token
    block_tables: torch.Tensor | None  # [C, nb] padded with NULL_BLOCK (None: no chunk has cached
                                       # context, keys are the chunks' own new K/V)
    mask: torch.Tensor | None         # [C, 1, Q, L] additive (0 / -inf) in the model dtype
                                      # (None: plain causal attention)


def build_prefill_layout(chunks: list[PrefillChunk], num_decode_tokens: int, block_size: int,
                         sliding_window: int | None, dtype: torch.dtype, device) -> PrefillLayout:
    """Query row i of chunk c sits at position cached_c + i and sees keys j <= that position (and
    inside the window). A padded row repeats its chunk's last query, so no row is fully masked."""
    C = len(chunks)
    q_lens = [c.q_len for c in chunks]
    cached = [c.context_len - c.q_len for c in chunks]
    Q, L = max(q_lens), max(c.context_len for c in chunks)
    uniform = min(q_lens) == Q
    windowed = sliding_window is not None and L > sliding_window
    if not any(cached) and uniform and not windowed:
        return PrefillLayout(C, Q, Q, None, None, None, None)
    i = torch.arange(Q, device=device).unsqueeze(0)                               # [1, Q]
    q_len = torch.tensor(q_lens, device=device).unsqueeze(1)                      # [C, 1]
    row = torch.minimum(i, q_len - 1)                                             # [C, Q]
    q_index = out_index = None
    if not uniform:
        firsts = torch.tensor([c.q_start - num_decode_tokens for c in chunks], device=device)
        q_index = (firsts.unsqueeze(1) + row).reshape(-1)
        out_index = torch.arange(C * Q, device=device).view(C, Q)[i < q_len]
    q_pos = torch.tensor(cached, device=device).unsqueeze(1) + row                # [C, Q]
    k_pos = torch.arange(L, device=device)                                        # [L]
    visible = k_pos <= q_pos.unsqueeze(-1)                                        # [C, Q, L]
    if sliding_window is not None:
        visible &= k_pos > q_pos.unsqueeze(-1) - sliding_window
    mask = torch.zeros(C, 1, Q, L, dtype=dtype, device=device)
    mask.masked_fill_(~visible.unsqueeze(1), float("-inf"))
    tables = None
    if any(cached):
        tables = torch.nn.utils.rnn.pad_sequence(
            [c.block_table[:-(-c.context_len // block_size)] for c in chunks],
            batch_first=True, padding_value=NULL_BLOCK).to(device)
    return PrefillLayout(C, Q, L, q_index, out_index, tables, mask)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [num_tokens] int64: cache slot of each new token
    num_decode_tokens: int = 0                  # decodes come first, one token each
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] int64 (NULL_BLOCK padded)
    decode_context_lens: torch.Tensor | None = None   # [num_decodes] int64
    decode_key_mask: torch.Tensor | None = None       # [num_decodes, 1, 1, max_blocks*block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Called with a layer's index once its K/V of the step are in the pool (layer-wise KV
    # streaming, kv/stream_sender.py); None: nobody asks
    kv_written: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    # Derived once per step, at the first layer that asks (not sent to tensor-parallel workers);
    # the masks once per sliding window (Gemma's layers alternate between two)
    _block_offset: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _prefill_layouts: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _decode_masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def block_and_offset(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [num_tokens] of every new token's slot: computed once per step, not per layer."""
        if self._block_offset is None:
            self._block_offset = (self.slot_mapping // block_size, self.slot_mapping % block_size)
        return self._block_offset

    def prefill_layout(self, block_size: int, sliding_window: int | None, dtype: torch.dtype) -> PrefillLayout:
        if sliding_window not in self._prefill_layouts:
            self._prefill_layouts[sliding_window] = build_prefill_layout(
                self.prefills, self.num_decode_tokens, block_size, sliding_window, dtype,
                self.slot_mapping.device)
        return self._prefill_layouts[sliding_window]

    def decode_mask(self, max_len: int, sliding_window: int | None) -> torch.Tensor:
        """The decode rows' key mask (`build_decode_key_mask`) for one sliding window, once a step."""
        if sliding_window not in self._decode_masks:
            self._decode_masks[sliding_window] = build_decode_key_mask(
                self.decode_context_lens, max_len, sliding_window)
        return self._decode_masks[sliding_window]


def build_decode_key_mask(context_lens: torch.Tensor, max_len: int,
                          sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len] bool: key j of sequence b is visible iff j < len_b (and in the window)."""
    k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)   # [1, L]
    lens = context_lens.unsqueeze(1)                                         # [B, 1]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask[:, None, None, :]
