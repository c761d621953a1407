"""The portable backend: PyTorch over the paged cache, on any device torch runs (CPU, CUDA).
Decode rows as batched matmuls over the gathered blocks; prefill chunks in one padded 4-D
scaled_dot_product_attention call per layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.attention import kv_quant
from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata, PrefillLayout


def write_slots(k, v, k_cache, v_cache, meta: AttentionMetadata, block_size: int, kv_cache_dtype: str,
                cache_dtype: bool = False):
    """k [T, KV, Dk], v [T, KV, Dv] -> their slots of the [n, KV, block_size, D] pools; returns
    what the cache now holds for them (dequantized, in the model dtype, when quantized; a plain
    cache of another dtype: its values in the model dtype, or with `cache_dtype` in the cache's)."""
    block, offset = meta.block_and_offset(block_size)
    if not kv_quant.is_quantized(kv_cache_dtype):
        model_dtype = k.dtype               # "bfloat16" under a float32 model: rounded as written,
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)           # and the step attends to that too
        if k.device.type == "cpu" and kernels.available():    # row copies, not torch's index kernel
            torch.ops.kvserve.write_slots(k, k_cache, meta.slot_mapping)
            torch.ops.kvserve.write_slots(v, v_cache, meta.slot_mapping)
        else:
            k_cache[block, :, offset] = k
            v_cache[block, :, offset] = v
        return (k, v) if cache_dtype else (k.to(model_dtype), v.to(model_dtype))
    out = []
    for x, (values, scales) in ((k, k_cache), (v, v_cache)):
        qx, sx = kv_quant.quantize(x, kv_cache_dtype)                      # [T, KV, D], [T, KV]
        values[block, :, offset] = qx
        scales[block, :, offset] = sx
        out.append(kv_quant.dequantize(qx, sx, x.dtype))
    return out[0], out[1]


def bf16_attention(device: torch.device) -> bool:
    """torch's bfloat16 attention runs here, natively: a GPU, or a CPU at torch's AVX512 capability
    (its bfloat16 flash kernel refuses less: "pack_vnni2 is only supported when avx512 is
    supported") with AVX-512 BF16 or AMX (without, bfloat16 is converted, not multiplied)."""
    if device.type != "cpu":
        return True
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and kernels.cpu_bf16()


def gather_blocks(cache, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `index` of a pool as [n, KV, bs, D] in `dtype` (dequantized if need be)."""
    if isinstance(cache, tuple):
        return kv_quant.dequantize(cache[0].index_select(0, index), cache[1].index_select(0, index), dtype)
    return cache.index_select(0, index).to(dtype)


class TorchPagedAttention(AttentionBackend):
    """Portable backend. Cache layout [num_blocks, KV, block_size, D]: a gathered block is
    `KV` contiguous [block_size, D] matrices, so decode attention runs as batched matmuls
    block by block, straight on the gathered blocks, with no transposed copy of the context.
    Prefill: every chunk of the step in one padded 4-D scaled_dot_product_attention call (a
    PrefillLayout, built once per step), with no loop over chunks.
    A quantized cache is quantized per token and KV head on write and dequantized (in the model
    dtype) right after the gather; new tokens attend to their own quantized K/V too, so the
    result does not depend on how a prompt was chunked."""

    name = "torch"

    @classmethod
    def unsupported(cls, cfg, device, dtype, kv_cache_dtype):
        if getattr(cfg, "kv_lora_rank", 0):
            return "multi-head latent attention (its cache holds latents: the mla backend)"
        return None

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Decode rows: the key mask [B, 1, 1, nb * block_size] of their block tables."""
        if meta.num_decode_tokens and meta.decode_key_mask is None:
            meta.decode_key_mask = self._key_mask(meta)
        return meta

    def _key_mask(self, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_key_mask is not None and not self.per_layer:
            return meta.decode_key_mask
        return meta.decode_mask(meta.decode_block_tables.shape[1] * self.block_size, self.sliding_window)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        k, v = write_slots(k, v, k_cache, v_cache, meta, self.block_size, self.kv_cache_dtype,
                           cache_dtype=True)     # (_prefill takes them in the cache's dtype)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:                      # a pure decode step: no copy into `out`
            return self._decode(q, k_cache, v_cache, meta)
        if nd == 0:
            return self._prefill(q, k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta)
        return out

    def _decode(self, q, k_cache, v_cache, meta):
        """q [B, H, D]; G = H / KV query heads per KV head. Scores and outputs are computed per
        gathered block with two batched matmuls."""
        B, H, D = q.shape
        KV, bs = self.num_kv_heads, self.block_size
        tables = meta.decode_block_tables                                   # [B, nb]
        nb = tables.shape[1]
        G = H // KV
        kb = gather_blocks(k_cache, tables.reshape(-1), q.dtype)             # [B*nb, KV, bs, D]
        vb = gather_blocks(v_cache, tables.reshape(-1), q.dtype)
        qb = q.view(B, 1, KV, G, D).expand(B, nb, KV, G, D).reshape(B * nb * KV, G, D)
        scores = torch.bmm(qb, kb.view(-1, bs, D).transpose(1, 2))          # [B*nb*KV, G, bs]
        scores = scores.view(B, nb, KV, G, bs).permute(0, 2, 3, 1, 4).reshape(B, KV, G, nb * bs)
        scores = scores.float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores.masked_fill_(~self._key_mask(meta), float("-inf"))           # mask [B, 1, 1, L]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)                   # [B, KV, G, L]
        probs = probs.view(B, KV, G, nb, bs).permute(0, 3, 1, 2, 4).reshape(B * nb * KV, G, bs)
        partial = torch.bmm(probs, vb.view(-1, bs, D))                      # [B*nb*KV, G, D]
        out = partial.view(B, nb, KV, G, D).sum(dim=1, dtype=torch.float32)  # [B, KV, G, D]
        return out.to(q.dtype).view(B, H, D)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        """Every prefill chunk in one 4-D scaled_dot_product_attention call (torch's fused CPU
        flash kernel takes 4-D inputs): q, k, v [T_prefill, *, D] -> [T_prefill, H, D]. A float32
        model's bfloat16 cache: in bfloat16 (K and V are the cache's values already; q and the
        probabilities rounded too, as llama.cpp rounds both to float16 against its float16
        cache), 2-2.7x torch's float32 kernel on SmolLM2's 64 x 128 prompts, where bfloat16 is
        native (`bf16_attention`)."""
        bf16 = q.dtype == torch.float32 and self.kv_cache_dtype == "bfloat16" and bf16_attention(q.device)
        dtype = torch.bfloat16 if bf16 else q.dtype
        lay = meta.prefill_layout(self.block_size, self.sliding_window, dtype)
        C, Q, D = lay.num_chunks, lay.max_q, self.head_dim

        def padded(x):                                           # [T_prefill, h, D] -> [C, h, Q, D]
            x = x if lay.q_index is None else x.index_select(0, lay.q_index)
            return x.to(dtype).view(C, Q, x.shape[1], D).transpose(1, 2)
        if lay.block_tables is None:
            keys, values = padded(k), padded(v)
        else:
            keys = self._context(k_cache, lay, dtype)
            values = self._context(v_cache, lay, dtype)
        if self.softcap is None:
            o = F.scaled_dot_product_attention(padded(q), keys, values, attn_mask=lay.mask,
                                               is_causal=lay.mask is None, scale=self.scale, enable_gqa=True)
        else:
            o = self._softcapped(padded(q), keys, values, lay.mask)
        o = o.transpose(1, 2).reshape(C * Q, self.num_heads, D).to(q.dtype)  # [C * Q, H, D]
        return o if lay.out_index is None else o.index_select(0, lay.out_index)

    def _softcapped(self, q, keys, values, mask):
        """Attention with soft-capped scores (no fused kernel has it): q [C, H, Q, D], keys and
        values [C, KV, L, D], an additive mask [C, 1, Q, L] or None (causal, L == Q)."""
        G = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(G, dim=1), values.repeat_interleave(G, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale      # [C, H, Q, L]
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            Q = q.shape[2]
            scores.masked_fill_(torch.ones(Q, Q, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        else:
            scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)

    def _context(self, cache, lay: PrefillLayout, dtype: torch.dtype) -> torch.Tensor:
        """Each chunk's first L cached tokens: [C, KV, L, D] (one gather for all chunks)."""
        C, nb = lay.block_tables.shape
        blocks = gather_blocks(cache, lay.block_tables.reshape(-1), dtype)   # [C * nb, KV, bs, D]
        blocks = blocks.view(C, nb, self.num_kv_heads, self.block_size, self.head_dim)
        return blocks.transpose(1, 2).reshape(C, self.num_kv_heads, -1, self.head_dim)[:, :, :lay.num_keys]
