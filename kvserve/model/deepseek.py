"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM) and DeepSeek-V3 (DeepseekV3ForCausalLM, also R1
and the models built on it): multi-head latent attention (MLA) and a mixture of routed and shared
experts, exact against transformers' DeepseekV2 / DeepseekV3.

Attention per layer (shapes for T tokens, H heads):
    q      = x W_Q (V2-Lite) or RMSNorm(x W_QA) W_QB       [T, H, nope + P] -> q_nope, q_pe
    c, k_pe = x W_KVA split [R], [P];  c = RMSNorm(c)      the per-token latent and RoPE key part
    q_pe, k_pe RoPE'd (DeepSeek rotates adjacent pairs: layers.apply_rope_pairs)
    out    = MLA(q_nope, q_pe, c, k_pe; kv_b_proj) W_O     kvserve/attention/mla.py caches c and
                                                           k_pe only and absorbs kv_b_proj on decode
The MLP: the first first_k_dense_replace layers dense, the others the MoE block of
moe_models.py (V2: softmax router, top-k weights times routed_scaling_factor, "group_limited_greedy"
keeping the best topk_group of n_group expert groups; V3: sigmoid scores plus a selection bias,
groups by their best two, renormalised; n_shared_experts ungated experts summed in).

kv_b_proj stays a dense matrix in the model dtype (decode multiplies its per-head slices into the
queries and outputs), so `quantization` quantizes every other linear weight. A GGUF file (llama.cpp's
deepseek2, loaders/gguf.py) loads into the same names. Not built: tensor and pipeline parallelism
(refused), the fused CPU decode step (off).
"""
from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.layers import apply_rope, apply_rope_pairs, rms_norm
from kvserve.model.moe_models import MoeLayer, MoeModel
from kvserve.model.quant.formats import linear


class DeepseekLayer(MoeLayer):
    """q_a / q_a_norm / q_b (or q), kv_a [R + P, hidden], kv_a_norm [R], kv_b [H, nope + vd, R], o."""

    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, lin, index: int = 0, raw: dict | None = None):
        a = prefix + "self_attn."
        H, R = cfg.num_heads, cfg.kv_lora_rank
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_norm = w[prefix + "post_attention_layernorm.weight"]
        self.q_a = self.q_a_norm = None
        if cfg.q_lora_rank:
            self.q_a = lin(a + "q_a_proj", [a + "q_a_proj.weight"])
            self.q_a_norm = w[a + "q_a_layernorm.weight"]
            self.q = lin(a + "q_b_proj", [a + "q_b_proj.weight"])
        else:
            self.q = lin(a + "q_proj", [a + "q_proj.weight"])
        self.kv_a = lin(a + "kv_a_proj_with_mqa", [a + "kv_a_proj_with_mqa.weight"])
        self.kv_a_norm = w[a + "kv_a_layernorm.weight"]
        dtype = self.input_norm.dtype
        self.kv_b = raw[a + "kv_b_proj.weight"].to(self.input_norm.device, dtype).view(H, -1, R)
        self.o = lin(a + "o_proj", [a + "o_proj.weight"])
        self.build_mlp(w, prefix, cfg, lin, index, raw)

    def attention_linears(self) -> list:
        return [w for w in (self.q_a, self.q, self.kv_a, self.o) if w is not None]


class DeepseekV2Model(MoeModel):
    supports_pipeline = False
    layer_class = DeepseekLayer
    own_suffixes = MoeModel.own_suffixes + ("kv_a_proj_with_mqa.weight",)

    def unfused(self) -> str | None:
        return "multi-head latent attention"

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list) -> torch.Tensor:
        cfg = self.cfg
        H, nope, P, R, eps = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
        T = x.shape[0]
        if cfg.rope_interleave:               # adjacent pairs: [T, 1, P/2] angles
            cos = self.rope_cos[positions, :P // 2].to(self.dtype).unsqueeze(1)
            sin = self.rope_sin[positions, P // 2:].to(self.dtype).unsqueeze(1)
            rope = apply_rope_pairs
        else:                                 # V3 with rope_interleave false: rotate-half, [T, 1, P]
            cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)
            sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
            rope = apply_rope
        for i, (layer, (latent_cache, pe_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = rms_norm(x, layer.input_norm, eps)
            if layer.q_a is not None:
                h_q = rms_norm(linear(h, layer.q_a), layer.q_a_norm, eps)
            else:
                h_q = h
            q = linear(h_q, layer.q).view(T, H, nope + P)
            q_nope, q_pe = q.split([nope, P], dim=-1)
            latent, k_pe = linear(h, layer.kv_a).split([R, P], dim=-1)      # [T, R], [T, P]
            latent = rms_norm(latent, layer.kv_a_norm, eps)
            q_pe = rope(q_pe, cos, sin)                                      # [T, H, P]
            k_pe = rope(k_pe.unsqueeze(1), cos, sin)                         # [T, 1, P]
            o = self.attn.forward(q_nope, q_pe, latent.unsqueeze(1), k_pe, latent_cache, pe_cache, meta,
                                  layer.kv_b)                                # [T, H, vd]
            if meta.kv_written is not None:
                meta.kv_written(i)
            x = x + linear(o.reshape(T, -1), layer.o)
            x = x + layer.mlp(rms_norm(x, layer.post_norm, eps))
        return x
