"""Adapters of the dense families beyond Llama (the registry's `adapter`): what a family's config.json
says that ModelConfig holds (`config_fields(hf) -> dict of ModelConfig fields`), and its checkpoint
names turned into the ones kvserve's model classes read (`adapt_weights(weights, cfg) -> weights`),
applied once at load so tensor parallelism and pipeline stages see Llama's names.

Phi-3 / Phi-4 (Phi3ForCausalLM) run as LlamaModel: fused qkv_proj and gate_up_proj split into
q/k/v and gate/up, partial_rotary_factor as ModelConfig.rotary_dim, LongRoPE ("longrope", formerly
"su") as a rope_scaling that layers.rope_tables reads. Gemma 2 / 3 run as model/gemma.py's GemmaModel.
DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM) run as model/deepseek.py's DeepseekV2Model: its MLA
widths, routed and shared experts, dense first layers and router rules become ModelConfig fields.
"""
from __future__ import annotations

import torch

from kvserve.model.layers import yarn_factors, yarn_mscale


def _arch(hf: dict) -> str:
    return next(iter(hf.get("architectures") or []), "")


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a Phi-3 or Gemma config.json that the generic reading leaves out."""
    if _arch(hf).startswith("Gemma"):
        return _gemma_fields(hf)
    if _arch(hf) in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_fields(hf)
    return _phi3_fields(hf)


def _deepseek_fields(hf: dict) -> dict:
    """DeepSeek-V2 (and V3, below): multi-head latent attention (a query / key head is qk_nope_head_dim +
    qk_rope_head_dim wide, a value head v_head_dim; each token caches kv_lora_rank +
    qk_rope_head_dim), n_routed_experts routed and n_shared_experts always-on ungated experts of
    moe_intermediate_size, the first first_k_dense_replace layers dense, the router's top-k
    weights not renormalised but times routed_scaling_factor, "greedy" or "group_limited_greedy".
    V3: the router's sigmoid scores plus e_score_correction_bias choose the top k among the
    topk_group best of n_group groups (each scored by its best two), weighted by the sigmoid scores,
    renormalised (norm_topk_prob) and scaled; rope_interleave false rotates halves.
    Refused (ValueError naming the field): what transformers' DeepseekV2 does not run as DeepSeek's
    own code does (norm_topk_prob, moe_layer_freq != 1), attention biases, another top-k method."""
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    v3 = _arch(hf) == "DeepseekV3ForCausalLM"
    if hf.get("norm_topk_prob") and not v3:
        raise ValueError("DeepseekV2ForCausalLM with norm_topk_prob=true: DeepSeek's code renormalises the "
                         "top-k weights and transformers' does not; kvserve runs neither (set it false).")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{_arch(hf)} moe_layer_freq={hf['moe_layer_freq']}: kvserve runs every layer "
                         "from first_k_dense_replace on as experts (moe_layer_freq 1).")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{_arch(hf)} with attention_bias or mlp_bias is not built (no published "
                         "DeepSeek-V2 / V3 has them).")
    experts = hf.get("n_routed_experts") or 0
    groups = None
    if v3:                        # sigmoid scores + e_score_correction_bias, groups by their best two
        method, scoring = hf.get("topk_method") or "noaux_tc", hf.get("scoring_func") or "sigmoid"
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"DeepseekV3ForCausalLM topk_method {method!r} / scoring_func {scoring!r}: "
                             "kvserve runs 'noaux_tc' with 'sigmoid' (as transformers does).")
        if (hf.get("n_group") or 1) > 1:
            groups = (int(hf["n_group"]), int(hf["topk_group"]))
    else:
        method = hf.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepseekV2ForCausalLM topk_method {method!r}: kvserve runs 'greedy' and "
                             "'group_limited_greedy'.")
        if method == "group_limited_greedy":
            groups = (int(hf["n_group"]), int(hf["topk_group"]))
    if groups is not None and (experts % groups[0] or not 1 <= groups[1] <= groups[0]):
        raise ValueError(f"{_arch(hf)} n_group={groups[0]}, topk_group={groups[1]} do not split "
                         f"its {experts} experts (n_group must divide them, topk_group <= n_group).")
    moe = hf.get("moe_intermediate_size") or 1407
    first_dense = hf.get("first_k_dense_replace") or 0
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    scalar = deepseek_attention_scalar(nope + rope, scaling, hf.get("max_position_embeddings"))
    return dict(head_dim=nope + rope, query_pre_attn_scalar=scalar, num_kv_heads=hf["num_attention_heads"], rotary_dim=rope,
                kv_lora_rank=hf.get("kv_lora_rank", 512), q_lora_rank=hf.get("q_lora_rank"),
                qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=hf.get("v_head_dim", 128),
                num_experts=experts, moe_intermediate_size=moe,
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False,
                router_scoring="sigmoid" if v3 else "softmax", rope_interleave=bool(hf.get("rope_interleave", True)),
                shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * moe,
                shared_expert_gated=False, routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                topk_groups=groups, mlp_only_layers=tuple(range(min(first_dense, hf["num_hidden_layers"]))))


def _phi3_fields(hf: dict) -> dict:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    out = {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        out["rotary_dim"] = int(_head_dim(hf) * partial)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("longrope", "su"):
        rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
        rope.setdefault("max_position_embeddings", hf.get("max_position_embeddings", 2048))
        out["rope_scaling"] = rope
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} for {_arch(hf)}; kvserve runs "
                         "Phi-3's 'longrope' (or 'su') and plain RoPE.")
    return out


GEMMA_CAPS = {"Gemma2ForCausalLM": (50.0, 30.0), "Gemma3ForCausalLM": (None, None)}   # transformers' defaults


def _gemma_fields(hf: dict) -> dict:
    """Gemma 2 / 3: GeGLU, query_pre_attn_scalar, soft-capping, each layer's window (layer_types,
    or the families' patterns: Gemma 2 alternates from a windowed layer 0, Gemma 3 has every
    sliding_window_pattern-th layer global), Gemma 3's RoPE base for windowed layers."""
    arch, n = _arch(hf), hf["num_hidden_layers"]
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention is not a causal LM kvserve runs.")
    types = hf.get("layer_types")
    if types is None:
        pattern = 2 if arch == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{arch} layer_types {types!r}: kvserve runs {n} layers of sliding_attention "
                         "and full_attention.")
    # a windowed layer without a window attends to everything (and keeps its own RoPE base)
    window = hf.get("sliding_window") or hf.get("max_position_embeddings", 8192)
    softcap, final_softcap = GEMMA_CAPS[arch]
    out = dict(hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
               query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
               attn_logit_softcapping=hf.get("attn_logit_softcapping", softcap),
               final_logit_softcapping=hf.get("final_logit_softcapping", final_softcap),
               sliding_window=None,
               layer_windows=[window if t == "sliding_attention" else None for t in types])
    rope = hf.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM":
        full = rope.get("full_attention") or ({} if "sliding_attention" in rope else rope)
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{arch}: RoPE scaling of the sliding-window layers "
                             f"({local.get('rope_type')!r}) is not built.")
        out["rope_theta"] = full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
        out["rope_local_theta"] = local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else (hf.get("rope_scaling") or None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        out["rope_scaling"] = scaling
    return out


def deepseek_attention_scalar(qk_head_dim: int, scaling: dict, max_positions: int | None) -> float | None:
    """DeepSeek's softmax scale with YaRN's mscale_all_dim: 1/sqrt(qk_head_dim) * mscale^2, as
    ModelConfig.query_pre_attn_scalar (scale = 1/sqrt(it)); None without it."""
    if scaling.get("rope_type", scaling.get("type")) != "yarn" or not scaling.get("mscale_all_dim"):
        return None
    factor, _ = yarn_factors(scaling, max_positions)
    return qk_head_dim / yarn_mscale(factor, scaling["mscale_all_dim"]) ** 4


def adapt_weights(weights: dict, cfg) -> dict:
    """Phi-3's fused projections split into Llama's names (views, no copy); others unchanged."""
    if cfg.architecture != "Phi3ForCausalLM":
        return weights
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, w in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, t in zip(("q", "k", "v"), torch.split(w, [q, kv, kv])):
                out[f"{base}{part}_proj.weight"] = t
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w.chunk(2)
        else:
            out[name] = w
    return out
