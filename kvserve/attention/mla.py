"""Multi-head latent attention over the paged cache (DeepSeek-V2's MLA; seed 001, "the KV cache
size formula": MLA shrinks m_KV, so more sequences fit in the same pool).

A token caches one compressed latent c = RMSNorm(x W_DKV) [R = kv_lora_rank] and one RoPE'd key
part k_pe [P = qk_rope_head_dim] shared by all H heads, not H keys and values: the K pool of a
layer holds the latents [n, 1, block_size, R], its V pool the key parts [n, 1, block_size, P].
Head h's key is [c W_UK_h, k_pe] and its value c W_UV_h, with kv_b [H, nope + vd, R] the
up-projection (kv_b_proj viewed per head: W_UK_h its first nope rows, W_UV_h the vd after).

Prefill rows expand the latents (their own, or the chunk's cached context) into per-head keys and
values and run scaled_dot_product_attention (compute-bound: the up-projection is cheaper than
attending in R dims). Decode rows absorb the up-projections instead (DeepSeek's and vLLM's MLA
decode): q_lat_h = q_nope_h W_UK_h, scores_h = q_lat_h . c + q_pe_h . k_pe, out_h =
(softmax_h . c) W_UV_h^T, so a step reads R + P numbers per cached token, never expands them, and
the H heads share one latent as MQA's heads share one KV head.

A quantized cache (int8 / fp8) holds each token's latent and key part with a scale each
(kv_quant.py); new tokens attend to their own quantized values, as in the portable backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_paged import gather_blocks, write_slots


class MlaAttention(AttentionBackend):
    name = "mla"

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int,
                 block_size: int, kv_cache_dtype: str = "auto", scale: float | None = None):
        super().__init__(num_heads, 1, nope_dim + rope_dim, block_size, None, kv_cache_dtype)
        self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim = kv_lora_rank, rope_dim, nope_dim, v_dim
        if scale is not None:
            self.scale = scale

    @classmethod
    def unsupported(cls, cfg, device, dtype, kv_cache_dtype):
        if not getattr(cfg, "kv_lora_rank", 0):
            return "not a multi-head latent attention model"
        return None

    @classmethod
    def for_model(cls, cfg, block_size: int, kv_cache_dtype: str = "auto") -> "MlaAttention":
        """The scale is 1/sqrt(query_pre_attn_scalar) when the config sets it (DeepSeek-V2 with
        YaRN: its temperature for all dims, model/families.py), else 1/sqrt(nope + P)."""
        scalar = cfg.query_pre_attn_scalar or cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return cls(cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                   block_size, kv_cache_dtype, scalar ** -0.5)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise TypeError("an MLA layer's K and V pools differ in width: use cache_shapes")

    def cache_shapes(self, num_blocks: int):
        return ((num_blocks, 1, self.block_size, self.kv_lora_rank),
                (num_blocks, 1, self.block_size, self.rope_dim))

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        if meta.num_decode_tokens and meta.decode_key_mask is None:
            meta.decode_key_mask = meta.decode_mask(meta.decode_block_tables.shape[1] * self.block_size, None)
        return meta

    def forward(self, q_nope, q_pe, latent, k_pe, latent_cache, pe_cache, meta: AttentionMetadata,
                kv_b: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, P] (RoPE'd), latent [T, 1, R] (normed), k_pe [T, 1, P]
        (RoPE'd), kv_b [H, nope + vd, R] -> the attention output [T, H, vd]; the latents and key
        parts are written to their slots first."""
        latent, k_pe = write_slots(latent, k_pe, latent_cache, pe_cache, meta, self.block_size,
                                   self.kv_cache_dtype)
        nd, T = meta.num_decode_tokens, q_nope.shape[0]
        if nd == T:
            return self._decode(q_nope, q_pe, latent_cache, pe_cache, meta, kv_b)
        if nd == 0:
            return self._prefill(q_nope, q_pe, latent, k_pe, latent_cache, pe_cache, meta, kv_b)
        out = q_nope.new_empty(T, self.num_heads, self.v_dim)
        out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], latent_cache, pe_cache, meta, kv_b)
        out[nd:] = self._prefill(q_nope[nd:], q_pe[nd:], latent[nd:], k_pe[nd:], latent_cache, pe_cache,
                                 meta, kv_b)
        return out

    def _decode(self, q_nope, q_pe, latent_cache, pe_cache, meta, kv_b):
        """Absorbed: the up-projections move onto the query and the output (see the module doc)."""
        B, H, _ = q_nope.shape
        w_uk, w_uv = kv_b[:, :self.nope_dim], kv_b[:, self.nope_dim:]            # [H, nope, R], [H, vd, R]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [B, H, R]
        tables = meta.decode_block_tables.reshape(-1)                             # [B * nb]
        c = gather_blocks(latent_cache, tables, q_nope.dtype).view(B, -1, self.kv_lora_rank)   # [B, L, R]
        pe = gather_blocks(pe_cache, tables, q_nope.dtype).view(B, -1, self.rope_dim)          # [B, L, P]
        scores = torch.baddbmm(torch.bmm(q_pe, pe.transpose(1, 2)), q_lat, c.transpose(1, 2))  # [B, H, L]
        scores = scores.float() * self.scale
        scores.masked_fill_(~meta.decode_key_mask.view(B, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q_nope.dtype)
        o_lat = torch.bmm(probs, c)                                               # [B, H, R]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # [B, H, vd]

    def _prefill(self, q_nope, q_pe, latent, k_pe, latent_cache, pe_cache, meta, kv_b):
        """Expanded: each chunk's keys and values from its context's latents, one padded
        scaled_dot_product_attention call for every chunk of the step."""
        lay = meta.prefill_layout(self.block_size, None, q_nope.dtype)
        C, Q, H = lay.num_chunks, lay.max_q, self.num_heads

        def padded(x):                            # [T_prefill, h, D] -> [C, Q, h, D]
            x = x if lay.q_index is None else x.index_select(0, lay.q_index)
            return x.view(C, Q, x.shape[1], x.shape[2])
        if lay.block_tables is None:              # no cached context: the chunks' own new tokens
            c, pe = padded(latent)[:, :, 0], padded(k_pe)[:, :, 0]               # [C, L, R], [C, L, P]
        else:
            tables = lay.block_tables.reshape(-1)
            c = gather_blocks(latent_cache, tables, q_nope.dtype).view(C, -1, self.kv_lora_rank)[:, :lay.num_keys]
            pe = gather_blocks(pe_cache, tables, q_nope.dtype).view(C, -1, self.rope_dim)[:, :lay.num_keys]
        L = c.shape[1]
        kv = torch.matmul(c, kv_b.reshape(-1, self.kv_lora_rank).t()).view(C, L, H, -1)   # [C, L, H, nope + vd]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, pe.unsqueeze(2).expand(C, L, H, self.rope_dim)], dim=-1)  # [C, L, H, Dqk]
        q = padded(torch.cat([q_nope, q_pe], dim=-1))                                      # [C, Q, H, Dqk]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=lay.mask, is_causal=lay.mask is None, scale=self.scale)
        o = o.transpose(1, 2).reshape(C * Q, H, self.v_dim)                               # [C * Q, H, vd]
        return o if lay.out_index is None else o.index_select(0, lay.out_index)

