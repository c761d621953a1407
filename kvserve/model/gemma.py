"""Gemma 2 and Gemma 3 (text): LlamaModel's weights and pass, with Gemma's differences.

- RMSNorm scales by (1 + w), computed in float32 (the offset folded into float32 weights once);
- the embedding is scaled by sqrt(hidden) (in the model dtype, as transformers rounds it);
- "sandwich" norms: the attention output and the MLP output are normed before their residual add
  (post_attention_layernorm, post_feedforward_layernorm), the MLP input by pre_feedforward_layernorm;
- GeGLU (gelu_tanh) MLP, attention scale query_pre_attn_scalar^-1/2, soft-capped attention scores
  (Gemma 2; the attention backend's `softcap`) and final logits;
- each layer its own sliding window (model/families.py reads layer_types), each windowed layer
  attending through its backend's `for_layer` copy; Gemma 3: q/k RMSNorm per head and a RoPE base
  of its own for the windowed layers (rope_local_theta).

The fused CPU decode step has none of this: it is off (`unfused`). Tensor parallelism slices it
as Llama's (the extra norms are replicated; each residual branch is all-reduced before its norm);
a pipeline stage holds its layers' windows (model/stages.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.llama import LlamaLayer, LlamaModel
from kvserve.model.layers import rope_tables
from kvserve.model.quant.formats import linear


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight in float32 (weight: Gemma's 1 + w, float32), back in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


class GemmaLayer(LlamaLayer):
    NORMS = ("input_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg, lin, index: int = 0, raw=None):
        super().__init__(w, prefix, cfg, lin, index, raw)
        self.pre_ff_norm = w[prefix + "pre_feedforward_layernorm.weight"]
        self.post_ff_norm = w[prefix + "post_feedforward_layernorm.weight"]
        for name in self.NORMS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.float() + 1.0)


class GemmaModel(LlamaModel):
    layer_class = GemmaLayer

    def __init__(self, cfg, weights: dict, attn, device, dtype, quantization=None,
                 quantization_group_size=None, tp=None, quantize_activations: bool = False, stage=None):
        super().__init__(cfg, weights, attn, device, dtype, quantization, quantization_group_size,
                         tp=tp, quantize_activations=quantize_activations, stage=stage)
        if self.norm is not None:                       # (the last pipeline stage's)
            self.norm = self.norm.float() + 1.0
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype)
        windows = cfg.layer_windows or [cfg.sliding_window] * cfg.num_layers
        self.layer_attn = [attn.for_layer(w) for w in windows]
        self.local_rope = None                  # (cos, sin) of the windowed layers, if their own
        if cfg.rope_local_theta is not None:
            cos, sin = rope_tables(self.rotary_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings)
            self.local_rope = cos.to(device), sin.to(device)
        self.windowed = [w is not None for w in windows]

    def unfused(self) -> str | None:
        return f"{self.cfg.architecture}'s layers (sandwich norms, GeGLU, per-layer windows)"

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale.to(self.dtype)

    def final_hidden(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return gemma_norm(x[indices], self.norm, self.cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().logits(h)
        cap = self.cfg.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T, tp = x.shape[0], self.tp

        def reduced(out):                               # a tensor-parallel rank's partial sum, summed
            return out if tp is None else tp.all_reduce(out)

        def table(cos, sin):
            return cos[positions].to(self.dtype).unsqueeze(1), sin[positions].to(self.dtype).unsqueeze(1)
        full = table(self.rope_cos, self.rope_sin)                    # [T, 1, rotary_dim] each
        local = full if self.local_rope is None else table(*self.local_rope)
        for i, (layer, attn, windowed, (k_cache, v_cache)) in enumerate(zip(
                self.layers, self.layer_attn, self.windowed, kv_caches)):
            h = gemma_norm(x, layer.input_norm, eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias)                # [T, (H + 2KV) * D]
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk, v = qk.view(T, H + KV, D), v.view(T, KV, D)
            if layer.q_norm is not None:                              # Gemma 3
                qk = torch.cat([gemma_norm(qk[:, :H], layer.q_norm, eps),
                                gemma_norm(qk[:, H:], layer.k_norm, eps)], dim=1)
            qk = self.rope(qk, *(local if windowed else full))
            o = attn.forward(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta)   # [T, H, D]
            if meta.kv_written is not None:                           # this layer's K/V are in the pool
                meta.kv_written(i)
            x = x + gemma_norm(reduced(linear(o.reshape(T, H * D), layer.o)), layer.post_norm, eps)
            h = gemma_norm(x, layer.pre_ff_norm, eps)
            mlp = layer.mlp(h)
            x = x + gemma_norm(reduced(mlp), layer.post_ff_norm, eps)
        return x
