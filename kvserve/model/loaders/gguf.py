"""GGUF files (llama.cpp's one-file format), read by gguf_file.py (metadata as values, tensors memory-mapped):
metadata -> ModelConfig, tensors -> weights under HF names, vocabulary -> tokenizer
(tokenizers/gguf_tokenizer.py). Tensors come either in their own types (`native`: int4 / int8 / the model
dtype, quant/gguf_types.py) or dequantized to float32 with `gguf.quants.dequantize`.

Everything is checked (every length and offset against the file size, gguf_file.py; then
architecture, tensor names, types, shapes) before the first tensor is dequantized, so a bad file
costs no memory. GGUF lists dimensions fastest-first (ne0 = columns), the reverse of torch;
llama.cpp's converter permutes the q/k rows of `llama` models for its interleaved RoPE, which
`unpermute_rope_rows` undoes. Mixture-of-experts files (Mixtral as `llama` with experts,
`qwen2moe`, `qwen3moe`, `olmoe`) hold each MoE layer's experts stacked (`ffn_*_exps` [E, ...]);
they are split into per-expert HF names for moe_models.MoeModel, each in its own type.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.registry import ARCHITECTURES, gguf_architecture
from kvserve.model.loaders.gguf_deepseek import DENSE_ALWAYS, MLA_TENSORS, deepseek2_config, join_kv_b, mla_shape
from kvserve.model.loaders.gguf_file import GGUFFile, read_gguf
from kvserve.model.quant.gguf_types import native_weight, unpermute_rope_rows
from kvserve.model.tokenizers.gguf_tokenizer import GGUFTokenizer, build_gguf_tokenizer

# general.architecture values whose q/k rows llama.cpp's converter permuted (the registry,
# kvserve/model/registry.py, maps each GGUF name to its architecture)
ROPE_PERMUTED = {"llama"}     # also Mistral, SmolLM, TinyLlama ...

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {   # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
MOE_TENSORS = {   # blk.N.<gguf> -> model.layers.N.<hf>; *_exps stacked [E, ...], split per expert at load
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
LAYER_TENSORS.update(MOE_TENSORS)
LAYER_TENSORS.update(MLA_TENSORS)
ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight", "e_score_correction_bias")   # kept in the model dtype
STACKED = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
# general.architecture -> whether llama.cpp renormalises the top-k router weights
RENORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
ROPE_FREQS = "rope_freqs.weight"   # llama.cpp's per-frequency divisors (Llama 3.1 rope scaling)
LOGITS_SIDE = ("model.embed_tokens.weight", "lm_head.weight")   # kept exact where they are Q8_0


def load_gguf(path: str | Path, native: bool = False, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> tuple[ModelConfig, dict, GGUFTokenizer | None]:
    """(config, weights with HF names, tokenizer or None) from one .gguf file. Weights are
    float32 tensors, or with `native` each in its own type for a model of `dtype` on `device`
    (gguf_types.native_weight: Int4Values, Int8Weight, or a tensor in `dtype`)."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    cfg, permuted = config_from_metadata(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    plan = _plan_tensors(tensors, cfg, path)
    tokenizer = build_gguf_tokenizer(meta)
    if ROPE_FREQS in tensors:
        factors = _dequantize(tensors[ROPE_FREQS], (cfg.head_dim // 2,))
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    weights = {}
    for gguf_name, hf_name in plan.items():
        heads = None
        if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads
        shape = _expected_shape(hf_name, cfg)
        if hf_name.endswith(STACKED):
            weights.update(_expert_weights(tensors[gguf_name], hf_name, shape, native, dtype, device))
            continue
        if native and not hf_name.endswith(ROUTERS + DENSE_ALWAYS):
            weights[hf_name] = native_weight(tensors[gguf_name], shape, heads, dtype, device,
                                             logits_side=hf_name in LOGITS_SIDE)
            continue
        w = _dequantize(tensors[gguf_name], shape)
        weights[hf_name] = torch.from_numpy(w if heads is None else unpermute_rope_rows(w, heads))
    if cfg.kv_lora_rank:
        join_kv_b(weights, cfg)
    return cfg, weights, tokenizer


class _ExpertSlice:
    """Expert e's rows of a stacked GGUF tensor, read like a 2-D `gguf.ReaderTensor`."""

    def __init__(self, t, e: int):
        self.name, self.tensor_type, self.data = f"{t.name}[{e}]", t.tensor_type, t.data[e]


def _expert_weights(t, stacked: str, shape: tuple, native: bool, dtype, device) -> dict:
    """A stacked expert tensor [E, rows, cols] -> {...experts.{e}.<part>.weight: [rows, cols]},
    dequantized (views of one float32 array) or each expert in its own type."""
    base, part = stacked.rsplit(".", 1)
    names = [f"{base}.{e}.{part}.weight" for e in range(shape[0])]
    if native:
        return {n: native_weight(_ExpertSlice(t, e), shape[1:], None, dtype, device)
                for e, n in enumerate(names)}
    w = torch.from_numpy(_dequantize(t, shape))
    return dict(zip(names, w.unbind(0)))


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path` (gguf_file.read_gguf: every length and offset checked), or
    ValueError if it is not a whole, well-formed GGUF file."""
    return read_gguf(path)


def read_metadata(reader: GGUFFile) -> dict:
    """Every key-value field as a Python value (str, int, float, bool, or a list of them)."""
    return reader.metadata


def config_from_metadata(meta: dict, path) -> tuple[ModelConfig, bool]:
    """ModelConfig from `{arch}.*` keys, and whether q/k rows need un-permuting."""
    arch = meta.get("general.architecture")
    experts = meta.get(f"{arch}.expert_count") or 0
    hf_arch = gguf_architecture(arch, experts > 0)
    if hf_arch is None and experts > 0 and gguf_architecture(arch) is not None:
        raise ValueError(f"{str(path)!r} is a mixture-of-experts model ({arch}.expert_count = {experts}), "
                         f"and kvserve loads {arch!r} GGUF files only without experts.")
    if hf_arch is None:
        known = [a.gguf for a in ARCHITECTURES.values() if a.gguf]
        raise ValueError(f"{str(path)!r} holds a GGUF model of architecture {arch!r}; kvserve loads "
                         f"GGUF architectures {', '.join(known)}.")
    defaults = ARCHITECTURES[hf_arch].defaults

    def key(name, default=None, required=False):
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"{str(path)!r} lacks metadata {arch}.{name}; the file is incomplete.")
        if isinstance(value, list):   # per-layer arrays: fine when every layer agrees
            if len(set(value)) != 1:
                raise ValueError(f"{arch}.{name} differs between layers ({value[:4]}...); kvserve "
                                 "needs every layer to have the same shape.")
            value = value[0]
        return value

    if arch == "deepseek2":
        return deepseek2_config(meta, key, hf_arch, path), False
    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    head_dim = key("attention.key_length") or hidden // heads
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{arch}.attention.value_length differs from key_length; kvserve needs "
                         "equal key and value head sizes.")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{arch}.rope.dimension_count {key('rope.dimension_count')} is not the head "
                         f"size {head_dim}; partial rotary embeddings are not supported.")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else key("vocab_size")
    cfg = ModelConfig(
        architecture=hf_arch, vocab_size=vocab or 0, hidden_size=hidden,
        intermediate_size=key("feed_forward_length", required=True),
        num_layers=key("block_count", required=True), num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads, head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(key), max_position_embeddings=key("context_length", 2048),
        attention_bias=defaults.get("attention_bias", False), qk_norm=defaults.get("qk_norm", False),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    if experts:
        _moe_config(cfg, key, arch, defaults)
    return cfg, arch in ROPE_PERMUTED


def _moe_config(cfg: ModelConfig, key, arch: str, defaults: dict) -> None:
    """The MoE fields from `{arch}.expert_*` keys (llama.cpp's names). Renormalising the top-k
    weights: `expert_weights_norm` where the file says, else what llama.cpp does for the arch
    (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE and OLMoE do not)."""
    cfg.num_experts = key("expert_count")
    cfg.num_experts_per_tok = key("expert_used_count") or 0
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"{arch}.expert_used_count = {cfg.num_experts_per_tok} must be between 1 and "
                         f"{arch}.expert_count = {cfg.num_experts}; the file is inconsistent.")
    cfg.moe_intermediate_size = key("expert_feed_forward_length")
    cfg.shared_expert_intermediate_size = key("expert_shared_feed_forward_length") or 0
    cfg.norm_topk_prob = bool(key("expert_weights_norm", RENORMALIZES.get(arch, False)))
    cfg.qk_norm_full = defaults.get("qk_norm_full", False)
    clamp = key("attention.clamp_kqv")
    cfg.clip_qkv = float(clamp) if clamp else None


def _rope_scaling(key) -> dict | None:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor") or key("rope.scale_linear")
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)} if factor and factor != 1.0 else None
    raise ValueError(f"rope scaling {kind!r} is not supported for GGUF files; kvserve supports "
                     "'linear' and Llama 3's rope_freqs tensor.")


def _plan_tensors(tensors: dict, cfg: ModelConfig, path) -> dict[str, str]:
    """gguf name -> HF name for every weight, after checking names, types and shapes;
    also settles cfg.vocab_size, tie_word_embeddings and (llama) attention_bias."""
    plan = {}
    for name in tensors:
        if name in GLOBAL_TENSORS:
            plan[name] = GLOBAL_TENSORS[name]
        elif name.startswith("blk.") and name.split(".", 2)[-1] in LAYER_TENSORS:
            _, layer, suffix = name.split(".", 2)
            if not layer.isdigit() or int(layer) >= cfg.num_layers:
                raise ValueError(f"tensor {name!r} names a layer beyond block_count {cfg.num_layers}.")
            plan[name] = f"model.layers.{layer}.{LAYER_TENSORS[suffix]}"
            if not cfg.shared_expert_gated:            # DeepSeek-V2's ungated shared_experts.
                plan[name] = plan[name].replace("mlp.shared_expert.", "mlp.shared_experts.")
        elif name != ROPE_FREQS:
            raise ValueError(f"{str(path)!r} holds tensor {name!r}, which kvserve's Llama-family "
                             "model has no place for; this GGUF variant is not supported.")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{str(path)!r} has no token_embd.weight tensor.")
    rows = int(tensors["token_embd.weight"].shape[-1])
    if cfg.vocab_size and cfg.vocab_size != rows:
        raise ValueError(f"the vocabulary has {cfg.vocab_size} tokens but token_embd.weight has "
                         f"{rows} rows; the file is inconsistent.")
    cfg.vocab_size = rows
    cfg.tie_word_embeddings = "output.weight" not in tensors
    if cfg.architecture == "LlamaForCausalLM":
        cfg.attention_bias = "blk.0.attn_q.bias" in tensors
    required = ["token_embd.weight", "output_norm.weight"]
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    if cfg.kv_lora_rank:        # deepseek2: q (or q_a, its norm, q_b), kv_a + norm, kv_b (or k_b + v_b)
        per_layer = ["attn_norm", "ffn_norm", "attn_output", "attn_kv_a_mqa", "attn_kv_a_norm",
                     *(["attn_q_a", "attn_q_a_norm", "attn_q_b"] if cfg.q_lora_rank else ["attn_q"]),
                     *(["attn_kv_b"] if "blk.0.attn_kv_b.weight" in tensors else ["attn_k_b", "attn_v_b"])]
    per_layer = [s + ".weight" for s in per_layer]
    dense_mlp = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if not cfg.num_experts:
        per_layer += dense_mlp
    if cfg.attention_bias:
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if cfg.qk_norm:
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if cfg.num_layers * len(per_layer) > len(tensors):     # before listing them: block_count is a u32
        raise ValueError(f"{str(path)!r} declares block_count {cfg.num_layers}, which needs "
                         f"{cfg.num_layers * len(per_layer)} layer tensors, but holds {len(tensors)} "
                         "tensors; the file is inconsistent.")
    required += [f"blk.{i}.{s}" for i in range(cfg.num_layers) for s in per_layer]
    if cfg.num_experts:
        required += _moe_layers(tensors, cfg)
    missing = [n for n in required if n not in tensors]
    if missing:
        more = "..." if len(missing) > 6 else ""
        raise ValueError(f"{str(path)!r} lacks tensors {missing[:6]}{more}; the file is incomplete.")
    checks = dict(plan)
    if ROPE_FREQS in tensors:
        checks[ROPE_FREQS] = None
    for name, hf_name in checks.items():
        t = tensors[name]
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {name!r} has type {t.tensor_type.name}, which kvserve cannot "
                             f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}.")
        shape = tuple(int(d) for d in reversed(t.shape))      # GGUF ne0 is the last torch dim
        want = (cfg.head_dim // 2,) if hf_name is None else _expected_shape(hf_name, cfg)
        if hf_name is not None and hf_name.endswith("shared_expert_gate.weight") and shape == want[1:]:
            continue                                            # [hidden] for [1, hidden]: the same
        if shape != want:
            why = ""
            if cfg.num_experts and ("exps" in name or "gate_inp" in name):
                why = (f" (expert_count {cfg.num_experts}, expert_feed_forward_length "
                       f"or feed_forward_length {cfg.moe_intermediate_size or cfg.intermediate_size}, "
                       f"expert_shared_feed_forward_length {cfg.shared_expert_intermediate_size})")
            raise ValueError(f"tensor {name!r} has shape {list(shape)} but the metadata implies "
                             f"{list(want)}{why}; the file is inconsistent.")
    return plan


def _moe_layers(tensors: dict, cfg: ModelConfig) -> list[str]:
    """The MLP tensors every layer needs; sets cfg.mlp_only_layers. A layer holding a router or
    any expert tensor is an MoE layer and needs the router, the three stacked expert tensors and
    (expert_shared_feed_forward_length > 0) the shared expert; any other layer is dense."""
    need, dense = [], []
    moe = [s for s in MOE_TENSORS if "shexp" not in s]
    shared = [s for s in MOE_TENSORS if "shexp" in s and (cfg.shared_expert_gated or "gate_inp" not in s)]
    for i in range(cfg.num_layers):
        if any(f"blk.{i}.{s}" in tensors for s in moe):
            need += [f"blk.{i}.{s}" for s in moe + (shared if cfg.shared_expert_intermediate_size else [])]
            if cfg.router_scoring == "sigmoid":
                need.append(f"blk.{i}.exp_probs_b.bias")
        else:
            dense.append(i)
            need += [f"blk.{i}.{s}" for s in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
    if len(dense) == cfg.num_layers:
        raise ValueError(f"the metadata says expert_count {cfg.num_experts}, but no layer holds expert "
                         "tensors (blk.N.ffn_gate_inp.weight, blk.N.ffn_{gate,up,down}_exps.weight); "
                         "the file is inconsistent.")
    cfg.mlp_only_layers = tuple(dense)
    return need


def _expected_shape(hf_name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The torch shape the forward pass expects for `hf_name`."""
    H, KV, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    X, IX, S = cfg.num_experts, cfg.moe_intermediate_size or I, cfg.shared_expert_intermediate_size
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    if cfg.kv_lora_rank and leaf.startswith(("self_attn.", "mlp.shared_experts.")):
        return mla_shape(leaf, cfg)
    if cfg.qk_norm_full and leaf in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return (H,) if "q_norm" in leaf else (KV,)     # OLMoE: q and k norms over all heads' width
    return {
        "model.embed_tokens.weight": (V, E), "lm_head.weight": (V, E), "model.norm.weight": (E,),
        "input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
        "self_attn.q_proj.weight": (H, E), "self_attn.k_proj.weight": (KV, E),
        "self_attn.v_proj.weight": (KV, E), "self_attn.o_proj.weight": (E, H),
        "self_attn.q_proj.bias": (H,), "self_attn.k_proj.bias": (KV,), "self_attn.v_proj.bias": (KV,),
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I, E), "mlp.up_proj.weight": (I, E), "mlp.down_proj.weight": (E, I),
        "mlp.gate.weight": (X, E), "mlp.gate.e_score_correction_bias": (X,), "mlp.experts.gate_proj": (X, IX, E), "mlp.experts.up_proj": (X, IX, E),
        "mlp.experts.down_proj": (X, E, IX), "mlp.shared_expert.gate_proj.weight": (S, E),
        "mlp.shared_expert.up_proj.weight": (S, E), "mlp.shared_expert.down_proj.weight": (E, S),
        "mlp.shared_expert_gate.weight": (1, E),
    }[leaf]


def _dequantize(t, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor as a fresh, writable float32 array of torch `shape`."""
    from gguf.quants import dequantize

    w = dequantize(t.data, t.tensor_type)
    if w.dtype != np.float32 or np.may_share_memory(w, t.data):
        w = np.array(w, dtype=np.float32)   # F32 comes back as a view of the file mapping
    assert w.size == math.prod(shape), (t.name, w.shape, shape)
    return w.reshape(shape)
