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

from kvserve import kernels
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.model import kv_quant


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
    # Derived once per step, at the first layer that asks (not sent to tensor-parallel workers)
    _block_offset: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _prefill_layout: PrefillLayout | None = field(default=None, init=False, repr=False, compare=False)

    def block_and_offset(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [num_tokens] of every new token's slot: computed once per step, not per layer."""
        if self._block_offset is None:
            self._block_offset = (self.slot_mapping // block_size, self.slot_mapping % block_size)
        return self._block_offset

    def prefill_layout(self, block_size: int, sliding_window: int | None, dtype: torch.dtype) -> PrefillLayout:
        if self._prefill_layout is None:
            self._prefill_layout = build_prefill_layout(self.prefills, self.num_decode_tokens, block_size,
                                                        sliding_window, dtype, self.slot_mapping.device)
        return self._prefill_layout


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
        self.fused_decode: bool | None = None     # kvserve's decode kernel runs (decided at first use)

    @classmethod
    def for_model(cls, cfg, block_size: int, kv_cache_dtype: str = "auto") -> "AttentionBackend":
        """The backend for `cfg`'s heads (a ModelConfig, or one rank's slice of it)."""
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.sliding_window,
                   kv_cache_dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Portable backend. Cache layout [num_blocks, KV, block_size, D]: a gathered block is
    `KV` contiguous [block_size, D] matrices, so decode attention runs as batched matmuls
    block by block, straight on the gathered blocks, with no transposed copy of the context.
    Prefill: every chunk of the step in one padded 4-D scaled_dot_product_attention call (a
    PrefillLayout, built once per step), with no loop over chunks.
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
        if nd == 0:
            return self._prefill(q, k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta)
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
        """One-token queries of B sequences: kvserve's paged decode kernel where it runs
        (`kernels.decode_attention_runs`), else `_decode_torch`."""
        if self.fused_decode is None:
            self.fused_decode = kernels.decode_attention_runs(self, q.device, q.dtype)
        if not self.fused_decode:
            return self._decode_torch(q, k_cache, v_cache, meta)
        kc, ks = k_cache if isinstance(k_cache, tuple) else (k_cache, None)
        vc, vs = v_cache if isinstance(v_cache, tuple) else (v_cache, None)
        out = torch.ops.kvserve.decode_attention(q.float(), kc, vc, ks, vs, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, self.sliding_window or 0)
        return out.to(q.dtype)

    def _decode_torch(self, q, k_cache, v_cache, meta):
        """q [B, H, D]; G = H / KV query heads per KV head. Scores and outputs are computed per
        gathered block with two batched matmuls."""
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

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        """Every prefill chunk in one 4-D scaled_dot_product_attention call (torch's fused CPU
        flash kernel takes 4-D inputs): q, k, v [T_prefill, *, D] -> [T_prefill, H, D]."""
        lay = meta.prefill_layout(self.block_size, self.sliding_window, q.dtype)
        C, Q, D = lay.num_chunks, lay.max_q, self.head_dim

        def padded(x):                                           # [T_prefill, h, D] -> [C, h, Q, D]
            x = x if lay.q_index is None else x.index_select(0, lay.q_index)
            return x.view(C, Q, x.shape[1], D).transpose(1, 2)
        if lay.block_tables is None:
            keys, values = padded(k), padded(v)
        else:
            keys = self._context(k_cache, lay, q.dtype)
            values = self._context(v_cache, lay, q.dtype)
        o = F.scaled_dot_product_attention(padded(q), keys, values, attn_mask=lay.mask,
                                           is_causal=lay.mask is None, scale=self.scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(C * Q, self.num_heads, D)  # [C * Q, H, D]
        return o if lay.out_index is None else o.index_select(0, lay.out_index)

    def _context(self, cache, lay: PrefillLayout, dtype: torch.dtype) -> torch.Tensor:
        """Each chunk's first L cached tokens: [C, KV, L, D] (one gather for all chunks)."""
        C, nb = lay.block_tables.shape
        blocks = self._gather(cache, lay.block_tables.reshape(-1), dtype)   # [C * nb, KV, bs, D]
        blocks = blocks.view(C, nb, self.num_kv_heads, self.block_size, self.head_dim)
        return blocks.transpose(1, 2).reshape(C, self.num_kv_heads, -1, self.head_dim)[:, :, :lay.num_keys]


def build_decode_key_mask(context_lens: torch.Tensor, max_len: int,
                          sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len] bool: key j of sequence b is visible iff j < len_b (and in the window)."""
    k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)   # [1, L]
    lens = context_lens.unsqueeze(1)                                         # [B, 1]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos >= lens - sliding_window
    return mask[:, None, None, :]
