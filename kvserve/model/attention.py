"""Attention over the paged KV cache for a ragged (packed) batch (seed 003, "Why the cache
needs pages"; seed 000, "Chunked prefill").

The batch is flat: decode tokens first (one per sequence), then the prefill chunks. Every new
token sees its own sequence's cached tokens and the new ones up to itself. Backends share one
interface, `AttentionBackend.forward`; `TorchPagedAttention` is the portable PyTorch one, and a
CUDA kernel backend (flash-attn / FlashInfer) can replace it behind the same metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.model import kv_quant


@dataclass
class PrefillChunk:
    """One sequence's new tokens `[q_start, q_start + q_len)` of the flat batch."""

    q_start: int
    q_len: int
    context_len: int                 # cached + new tokens: keys this chunk attends to
    block_table: torch.Tensor        # [num_blocks_of_seq] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [num_tokens] int64: cache slot of each new token
    num_decode_tokens: int = 0                  # decodes come first, one token each
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] int64 (padded)
    decode_context_lens: torch.Tensor | None = None   # [num_decodes] int64
    decode_context_lens_list: list[int] = field(default_factory=list)   # the same, on the host
    decode_key_mask: torch.Tensor | None = None       # [num_decodes, 1, 1, max_blocks*block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    _block_offset: tuple | None = field(default=None, repr=False)

    def block_and_offset(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [num_tokens] of every new token's slot: computed once per step, not per layer."""
        if self._block_offset is None:
            self._block_offset = (self.slot_mapping // block_size, self.slot_mapping % block_size)
        return self._block_offset


class AttentionBackend:
    """Writes the new K/V into the cache and attends. Shapes: q [T, H, D]; k, v [T, KV, D];
    returns [T, H, D]. The backend owns the layout of one layer's cache (`cache_shape`); with a
    quantized `kv_cache_dtype` each cache is (values, scales) (model/kv_quant.py)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto"):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        self.kv_cache_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Portable backend. Cache layout [num_blocks, KV, block_size, D]: a gathered block is
    `KV` contiguous [block_size, D] matrices, so decode attention runs as batched matmuls
    block by block, straight on the gathered blocks, with no transposed copy of the context.
    A quantized cache is quantized per token and KV head on write and dequantized (in the model
    dtype) right after the gather; new tokens attend to their own quantized K/V too, so the
    result does not depend on how a prompt was chunked."""

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        k, v = self._write(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:                      # a pure decode step: no copy into `out`
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            s, e = chunk.q_start, chunk.q_start + chunk.q_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk)
        return out

    def _write(self, k, v, k_cache, v_cache, meta):
        """k, v [T, KV, D] -> their slots; returns what the cache now holds for them."""
        block, offset = meta.block_and_offset(self.block_size)
        if not kv_quant.is_quantized(self.kv_cache_dtype):
            k_cache[block, :, offset] = k
            v_cache[block, :, offset] = v
            return k, v
        out = []
        for x, (values, scales) in ((k, k_cache), (v, v_cache)):
            qx, sx = kv_quant.quantize(x, self.kv_cache_dtype)              # [T, KV, D], [T, KV]
            values[block, :, offset] = qx
            scales[block, :, offset] = sx
            out.append(kv_quant.dequantize(qx, sx, x.dtype))
        return out[0], out[1]

    @staticmethod
    def _gather(cache, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks `index` of a pool as [n, KV, bs, D] in `dtype` (dequantized if need be)."""
        if isinstance(cache, tuple):
            return kv_quant.dequantize(cache[0].index_select(0, index),
                                       cache[1].index_select(0, index), dtype)
        return cache.index_select(0, index)

    def _decode(self, q, k_cache, v_cache, meta):
        """One-token queries of B sequences. q [B, H, D]; G = H / KV query heads per KV head.
        Scores and outputs are computed per gathered block with two batched matmuls."""
        B, H, D = q.shape
        KV, bs = self.num_kv_heads, self.block_size
        tables = meta.decode_block_tables                                   # [B, nb]
        nb = tables.shape[1]
        G = H // KV
        kb = self._gather(k_cache, tables.reshape(-1), q.dtype)             # [B*nb, KV, bs, D]
        vb = self._gather(v_cache, tables.reshape(-1), q.dtype)
        qb = q.view(B, 1, KV, G, D).expand(B, nb, KV, G, D).reshape(B * nb * KV, G, D)
        scores = torch.bmm(qb, kb.view(-1, bs, D).transpose(1, 2))          # [B*nb*KV, G, bs]
        scores = scores.view(B, nb, KV, G, bs).permute(0, 2, 3, 1, 4).reshape(B, KV, G, nb * bs)
        scores = scores.float() * self.scale
        scores.masked_fill_(~meta.decode_key_mask, float("-inf"))           # mask [B, 1, 1, L]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)                   # [B, KV, G, L]
        probs = probs.view(B, KV, G, nb, bs).permute(0, 3, 1, 2, 4).reshape(B * nb * KV, G, bs)
        partial = torch.bmm(probs, vb.view(-1, bs, D))                      # [B*nb*KV, G, D]
        out = partial.view(B, nb, KV, G, D).sum(dim=1, dtype=torch.float32)  # [B, KV, G, D]
        return out.to(q.dtype).view(B, H, D)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk):
        n_new, ctx = chunk.q_len, chunk.context_len
        window = self.sliding_window
        if ctx == n_new and (window is None or window >= ctx):
            # Nothing cached before this chunk: plain causal attention over the new tokens.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(0, 1)
        keys = self._context(k_cache, chunk.block_table, ctx, q.dtype)      # [KV, ctx, D]
        values = self._context(v_cache, chunk.block_table, ctx, q.dtype)
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)   # [n_new, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)                # [1, ctx]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)                                   # [n_new, H, D]

    def _context(self, cache, block_table: torch.Tensor, ctx: int, dtype: torch.dtype) -> torch.Tensor:
        """One sequence's first `ctx` cached tokens as [KV, ctx, D]."""
        blocks = self._gather(cache, block_table, dtype)                    # [nb, KV, bs, D]
        return blocks.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :ctx]


def build_decode_key_mask(context_lens: torch.Tensor, max_len: int,
                          sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len] bool: key j of sequence b is visible iff j < len_b (and in the window)."""
    k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)   # [1, L]
    lens = context_lens.unsqueeze(1)                                         # [B, 1]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask[:, None, None, :]
