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


class AttentionBackend:
    """Writes the new K/V into the cache and attends. Shapes: q [T, H, D]; k, v [T, KV, D];
    caches [num_blocks, block_size, KV, D]; returns [T, H, D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Portable backend: scatter through the slot mapping, gather through block tables,
    `scaled_dot_product_attention` (GQA-aware) for all decodes at once and per prefill chunk."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        k_cache.view(kv_shape).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(kv_shape).index_copy_(0, meta.slot_mapping, v)
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

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """[..., n_blocks] block ids -> [..., n_blocks * block_size, KV, D] (one contiguous copy)."""
        x = cache.index_select(0, block_table.reshape(-1))                # [N*nb, bs, KV, D]
        return x.view(*block_table.shape[:-1], -1, *cache.shape[2:])

    def _decode(self, q, k_cache, v_cache, meta):
        """All one-token queries at once with batched matmuls over the gathered context.
        q [B, H, D]; GQA groups G = H / KV query heads per KV head."""
        B, H, D = q.shape
        KV = self.num_kv_heads
        keys = self._gather(k_cache, meta.decode_block_tables)              # [B, L, KV, D]
        values = self._gather(v_cache, meta.decode_block_tables)
        if B == 1 and self.sliding_window is None:
            # One sequence: no padding to mask, one fused SDPA call over its exact context.
            n = meta.decode_context_lens_list[0]
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys[:, :n].transpose(1, 2), values[:, :n].transpose(1, 2),
                scale=self.scale, enable_gqa=True)                          # [1, H, 1, D]
            return o.view(1, H, D)
        qg = q.view(B, KV, H // KV, D)                                      # [B, KV, G, D]
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float()         # [B, KV, G, L]
        scores = scores * self.scale
        scores.masked_fill_(~meta.decode_key_mask, float("-inf"))           # mask [B, 1, 1, L]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))               # [B, KV, G, D]
        return out.reshape(B, H, D)

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk):
        n_new, ctx = chunk.q_len, chunk.context_len
        window = self.sliding_window
        if ctx == n_new and (window is None or window >= ctx):
            # Nothing cached before this chunk: plain causal attention over the new tokens.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(0, 1)
        keys = self._gather(k_cache, chunk.block_table)[:ctx].transpose(0, 1)   # [KV, ctx, D]
        values = self._gather(v_cache, chunk.block_table)[:ctx].transpose(0, 1)
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device).unsqueeze(1)   # [n_new, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)                # [1, ctx]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)                                   # [n_new, H, D]


def build_decode_key_mask(context_lens: torch.Tensor, max_len: int,
                          sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len] bool: key j of sequence b is visible iff j < len_b (and in the window)."""
    k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)   # [1, L]
    lens = context_lens.unsqueeze(1)                                         # [B, 1]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask[:, None, None, :]
