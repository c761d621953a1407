"""kvserve's CPU backend: decode rows through kvserve's C++ paged decode attention
(`torch.ops.kvserve.decode_attention`, kvserve/kernels/: runtime ISA dispatch, online softmax over
the block table, no gathered copy and no key mask), prefill chunks as the portable backend does.
With it, a float32 model's pure-decode steps may also run every layer in one kernel call
(model/fused_decode.py), which only this backend allows."""
from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.attention.metadata import AttentionMetadata
from kvserve.attention.torch_paged import TorchPagedAttention


class FusedCpuAttention(TorchPagedAttention):
    name = "cpu_fused"

    @classmethod
    def unsupported(cls, cfg, device, dtype, kv_cache_dtype):
        if (why := super().unsupported(cfg, device, dtype, kv_cache_dtype)) is not None:
            return why
        if not kernels.available(device):
            return "no kvserve kernels here (a CPU device and a working C++ build are needed)"
        if dtype not in (torch.float32, torch.bfloat16) and kv_cache_dtype == "auto":
            return f"a {str(dtype).removeprefix('torch.')} cache"
        if getattr(cfg, "attn_logit_softcapping", None):
            return "attention logit soft-capping (the decode kernel has none)"
        if kv_cache_dtype.startswith("fp8"):
            return f"kv_cache_dtype {kv_cache_dtype}"
        if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 16 or cfg.head_dim > 256:
            return f"{cfg.num_heads} query heads on {cfg.num_kv_heads} KV heads of dim {cfg.head_dim}"
        return None

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta                                   # the kernel reads the context lengths

    def _decode(self, q, k_cache, v_cache, meta):
        """q [B, H, D] -> [B, H, D], in float32 inside the kernel."""
        kc, ks = k_cache if isinstance(k_cache, tuple) else (k_cache, None)
        vc, vs = v_cache if isinstance(v_cache, tuple) else (v_cache, None)
        out = torch.ops.kvserve.decode_attention(q.float(), kc, vc, ks, vs, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, self.sliding_window or 0)
        return out.to(q.dtype)
