"""Adapters of the dense families beyond Llama (the registry's `adapter`): what a family's config.json
says that ModelConfig holds (`config_fields(hf) -> dict of ModelConfig fields`), and its checkpoint
names turned into the ones kvserve's model classes read (`adapt_weights(weights, cfg) -> weights`),
applied once at load so tensor parallelism and pipeline stages see Llama's names.

Phi-3 / Phi-4 (Phi3ForCausalLM) run as LlamaModel: fused qkv_proj and gate_up_proj split into
q/k/v and gate/up, partial_rotary_factor as ModelConfig.rotary_dim, LongRoPE ("longrope", formerly
"su") as a rope_scaling that layers.rope_tables reads. Gemma 2 / 3 run as model/gemma.py's GemmaModel.
"""
from __future__ import annotations

import torch


def _arch(hf: dict) -> str:
    return next(iter(hf.get("architectures") or []), "")


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a Phi-3 or Gemma config.json that the generic reading leaves out."""
    if _arch(hf).startswith("Gemma"):
        return _gemma_fields(hf)
    return _phi3_fields(hf)


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


def _gemma_fields(hf: dict) -> dict:
    raise ValueError(f"{_arch(hf)} is not built yet.")


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
