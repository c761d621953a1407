"""llama.cpp's deepseek2 GGUF files (DeepSeek-V2 / V2-Lite / V3) for loaders/gguf.py: their
metadata keys -> ModelConfig's MLA, expert and YaRN fields, their attention tensors' names and
shapes, and kv_b_proj joined back from the converter's split k_b / v_b."""
from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig

MLA_TENSORS = {   # deepseek2: multi-head latent attention (kvserve/model/deepseek.py)
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",            # older files: kv_b_proj whole
    "attn_k_b.weight": "self_attn.k_b_proj.weight",              # newer: [H, R, nope] (k_b transposed)
    "attn_v_b.weight": "self_attn.v_b_proj.weight",              # and [H, vd, R]
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",      # DeepSeek-V3's selection bias [E]
}
# read dequantized whatever their type (model/deepseek.py multiplies kv_b_proj's slices itself)
DENSE_ALWAYS = ("kv_b_proj.weight", "k_b_proj.weight", "v_b_proj.weight")


def deepseek2_config(meta: dict, key, hf_arch: str, path) -> ModelConfig:
    """DeepSeek-V2 from llama.cpp's deepseek2 keys: the MLA widths (kv_lora_rank, q_lora_rank,
    rope.dimension_count; key_length_mla / value_length_mla, or in older files key_length /
    value_length, for a head's nope + rope and value widths), the experts (expert_count,
    expert_used_count, expert_feed_forward_length, expert_shared_count, leading_dense_block_count,
    expert_weights_scale, expert_group_count / expert_group_used_count; expert_gating_func 2 with
    exp_probs_b and expert_weights_norm: DeepSeek-V3's sigmoid router) and YaRN
    (rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim, which llama.cpp also takes as mscale)."""
    from kvserve.model.families import deepseek_attention_scalar

    heads, P = key("attention.head_count", required=True), key("rope.dimension_count", required=True)
    R = key("attention.kv_lora_rank", required=True)
    if key("attention.key_length_mla") is not None:
        nope, v = key("attention.key_length_mla") - P, key("attention.value_length_mla", required=True)
    else:
        nope, v = key("attention.key_length", required=True) - P, key("attention.value_length", required=True)
    gating = key("expert_gating_func", 1)        # 1 softmax (V2), 2 sigmoid + exp_probs_b (V3)
    if gating not in (1, 2):
        raise ValueError(f"{str(path)!r}: deepseek2.expert_gating_func {gating} is neither softmax (1, "
                         "DeepSeek-V2's) nor sigmoid (2, DeepSeek-V3's).")
    if key("expert_weights_norm") and gating == 1:
        raise ValueError(f"{str(path)!r}: deepseek2.expert_weights_norm is true with a softmax router; kvserve "
                         "runs DeepSeek-V2's router without renormalising the top-k weights (as transformers does).")
    if gating == 2:
        hf_arch = "DeepseekV3ForCausalLM"
    experts, used = key("expert_count", required=True), key("expert_used_count", required=True)
    if not 1 <= used <= experts:
        raise ValueError(f"deepseek2.expert_used_count = {used} must be between 1 and deepseek2.expert_count = "
                         f"{experts}; the file is inconsistent.")
    groups = key("expert_group_count") or 1
    moe_ff, layers = key("expert_feed_forward_length", required=True), key("block_count", required=True)
    ctx = key("context_length", 2048)
    scaling = None
    if key("rope.scaling.type") == "yarn":
        mscale = (key("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor", required=True)),
                   "original_max_position_embeddings": key("rope.scaling.original_context_length", required=True),
                   "mscale": mscale, "mscale_all_dim": mscale, "max_position_embeddings": ctx,
                   "beta_fast": key("rope.scaling.yarn_beta_fast") or 32, "beta_slow": key("rope.scaling.yarn_beta_slow") or 1}
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{str(path)!r}: rope scaling {key('rope.scaling.type')!r} for deepseek2 is not built "
                         "(YaRN is).")
    tokens = meta.get("tokenizer.ggml.tokens")
    return ModelConfig(
        architecture=hf_arch, vocab_size=len(tokens) if tokens else key("vocab_size") or 0,
        hidden_size=key("embedding_length", required=True), intermediate_size=key("feed_forward_length", required=True),
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=nope + P, rotary_dim=P,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling, max_position_embeddings=ctx, kv_lora_rank=R, q_lora_rank=key("attention.q_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=P, v_head_dim=v,
        query_pre_attn_scalar=deepseek_attention_scalar(nope + P, scaling or {}, ctx),
        num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=moe_ff,
        shared_expert_intermediate_size=(key("expert_shared_count") or 0) * moe_ff, shared_expert_gated=False,
        routed_scaling_factor=float(key("expert_weights_scale") or 1.0),
        router_scoring="sigmoid" if gating == 2 else "softmax", norm_topk_prob=bool(key("expert_weights_norm")),
        topk_groups=(groups, key("expert_group_used_count", required=True)) if groups > 1 else None,
        mlp_only_layers=tuple(range(min(key("leading_dense_block_count") or 0, layers))),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))


def join_kv_b(weights: dict, cfg: ModelConfig) -> None:
    """llama.cpp's converter splits kv_b_proj into k_b (transposed, [H, R, nope]) and v_b
    ([H, vd, R]); kvserve reads it whole, [H * (nope + vd), R]."""
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        if a + "k_b_proj.weight" in weights:
            k_b, v_b = weights.pop(a + "k_b_proj.weight"), weights.pop(a + "v_b_proj.weight")
            weights[a + "kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(
                -1, cfg.kv_lora_rank)


def mla_shape(leaf: str, cfg: ModelConfig) -> tuple[int, ...]:
    """deepseek2's attention and shared-expert tensors, torch order."""
    E, H, R, P, S = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.shared_expert_intermediate_size
    nope, v, qr = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    return {
        "self_attn.q_proj.weight": (H * (nope + P), E), "self_attn.q_a_proj.weight": (qr, E),
        "self_attn.q_a_layernorm.weight": (qr,), "self_attn.q_b_proj.weight": (H * (nope + P), qr),
        "self_attn.kv_a_proj_with_mqa.weight": (R + P, E), "self_attn.kv_a_layernorm.weight": (R,),
        "self_attn.kv_b_proj.weight": (H * (nope + v), R), "self_attn.k_b_proj.weight": (H, R, nope),
        "self_attn.v_b_proj.weight": (H, v, R), "self_attn.o_proj.weight": (E, H * v),
        "mlp.shared_experts.gate_proj.weight": (S, E), "mlp.shared_experts.up_proj.weight": (S, E),
        "mlp.shared_experts.down_proj.weight": (E, S),
    }[leaf]
