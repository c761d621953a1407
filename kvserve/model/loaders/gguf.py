"""GGUF files (llama.cpp's one-file format), read with gguf-py's `GGUFReader` (memory-mapped):
metadata -> ModelConfig, tensors -> weights under HF names, vocabulary -> tokenizer
(tokenizers/gguf_tokenizer.py). Tensors come either in their own types (`native`: int4 / int8 / the model
dtype, quant/gguf_types.py) or dequantized to float32 with `gguf.quants.dequantize`.

Everything is checked (every length and offset against the file size, gguf_check.py; then
architecture, tensor names, types, shapes) before the first tensor is dequantized, so a bad file
costs no memory. GGUF lists dimensions fastest-first (ne0 = columns), the reverse of torch;
llama.cpp's converter permutes the q/k rows of `llama` models for its interleaved RoPE, which
`unpermute_rope_rows` undoes.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.registry import ARCHITECTURES, gguf_architecture
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
        if native:
            weights[hf_name] = native_weight(tensors[gguf_name], shape, heads, dtype, device,
                                             logits_side=hf_name in LOGITS_SIDE)
            continue
        w = _dequantize(tensors[gguf_name], shape)
        weights[hf_name] = torch.from_numpy(w if heads is None else unpermute_rope_rows(w, heads))
    return cfg, weights, tokenizer


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path`, or ValueError if it is not a whole, well-formed GGUF
    file: gguf_check.check_gguf walks every length and offset first (GGUFReader trusts them)."""
    from gguf import GGUFReader

    from kvserve.model.loaders.gguf_check import check_gguf

    check_gguf(path)
    try:
        return GGUFReader(path)
    except Exception as e:  # what the walk does not check (e.g. a value gguf-py rejects)
        raise ValueError(f"{str(path)!r} is truncated or corrupt (reading its GGUF header failed: "
                         f"{e}); download or write the file again.") from e


def read_metadata(reader) -> dict:
    """Every key-value field as a Python value (str, int, float, bool, or a list of them)."""
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = field.contents()
        except Exception as e:
            raise ValueError(f"metadata field {name!r} is corrupt ({e}); the file is damaged.") from e
    return meta


def config_from_metadata(meta: dict, path) -> tuple[ModelConfig, bool]:
    """ModelConfig from `{arch}.*` keys, and whether q/k rows need un-permuting."""
    arch = meta.get("general.architecture")
    hf_arch = gguf_architecture(arch)
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

    if (key("expert_count") or 0) > 0:
        raise ValueError(f"{str(path)!r} is a mixture-of-experts model ({arch}.expert_count = "
                         f"{key('expert_count')}); kvserve runs dense models only.")
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
    return cfg, arch in ROPE_PERMUTED


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
    per_layer = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_gate", "ffn_up", "ffn_down"]
    per_layer = [s + ".weight" for s in per_layer]
    if cfg.attention_bias:
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if cfg.qk_norm:
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if cfg.num_layers * len(per_layer) > len(tensors):     # before listing them: block_count is a u32
        raise ValueError(f"{str(path)!r} declares block_count {cfg.num_layers}, which needs "
                         f"{cfg.num_layers * len(per_layer)} layer tensors, but holds {len(tensors)} "
                         "tensors; the file is inconsistent.")
    required += [f"blk.{i}.{s}" for i in range(cfg.num_layers) for s in per_layer]
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
        if shape != want:
            raise ValueError(f"tensor {name!r} has shape {list(shape)} but the metadata implies "
                             f"{list(want)}; the file is inconsistent.")
    return plan


def _expected_shape(hf_name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The torch shape the forward pass expects for `hf_name`."""
    H, KV, D = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    leaf = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    return {
        "model.embed_tokens.weight": (V, E), "lm_head.weight": (V, E), "model.norm.weight": (E,),
        "input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
        "self_attn.q_proj.weight": (H, E), "self_attn.k_proj.weight": (KV, E),
        "self_attn.v_proj.weight": (KV, E), "self_attn.o_proj.weight": (E, H),
        "self_attn.q_proj.bias": (H,), "self_attn.k_proj.bias": (KV,), "self_attn.v_proj.bias": (KV,),
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I, E), "mlp.up_proj.weight": (I, E), "mlp.down_proj.weight": (E, I),
    }[leaf]


def _dequantize(t, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor as a fresh, writable float32 array of torch `shape`."""
    from gguf.quants import dequantize

    w = dequantize(t.data, t.tensor_type)
    if w.dtype != np.float32 or np.may_share_memory(w, t.data):
        w = np.array(w, dtype=np.float32)   # F32 comes back as a view of the file mapping
    assert w.size == math.prod(shape), (t.name, w.shape, shape)
    return w.reshape(shape)
