"""Find and load a model: an HF directory (config.json + safetensors, memory-mapped), Karpathy's
llama2.c checkpoint (`*.bin` + `tok*.bin`, layout in stories260K/FORMAT.md), or a GGUF file
(loaders/gguf.py), given directly or as the only `*.gguf` in a directory without config.json.
`checkpoint_dtype` and `read_model_config` read what a checkpoint is without loading its
tensors; `resolve_dtype` decides `dtype="auto"` from the first."""
from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvserve.config.names import DTYPE_NAMES
from kvserve.model.config import ModelConfig
from kvserve.model.loaders.gguf import load_gguf
from kvserve.model.moe import check_expert_tensors
from kvserve.model.registry import architecture
from kvserve.model.tokenizers.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer

# Checkpoint tensor types (safetensors' and GGUF's names) that are plain floating point.
FLOAT_TYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_model_dir(path: str, **gguf_options) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """(config, weights with HF names, tokenizer) for an HF or llama2.c model directory, or a
    GGUF file (`gguf_options`: load_gguf's native, dtype, device)."""
    kind, files = _locate(path)
    if kind == "gguf":
        return load_gguf(files[0], **gguf_options)
    return _load_hf(*files) if kind == "hf" else _load_llama2c(*files)


def _locate(path: str) -> tuple[str, tuple]:
    """What `path` holds: ("gguf", (file,)), ("hf", (directory,)) or ("llama2c", (checkpoint,
    tokenizer)); ValueError naming what to pass otherwise."""
    root = Path(path)
    if root.is_file():
        return "gguf", (root,)
    if not root.is_dir():
        raise ValueError(f"model path {path!r} does not exist; pass a .gguf file, or a directory "
                         "holding config.json and *.safetensors, or a llama2.c checkpoint and tok*.bin.")
    if (root / "config.json").exists():
        return "hf", (root,)
    ggufs = sorted(root.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", (ggufs[0],)
    if ggufs:
        raise ValueError(f"{path!r} holds several GGUF files ({[p.name for p in ggufs]}); pass "
                         "the path of the one to load.")
    toks = sorted(root.glob("tok*.bin"))
    ckpts = sorted(p for p in root.glob("*.bin") if p not in toks)
    if len(ckpts) == 1 and len(toks) == 1:
        return "llama2c", (ckpts[0], toks[0])
    raise ValueError(f"{path!r} is neither an HF model directory (no config.json), nor holds a "
                     f".gguf file, nor is a llama2.c one (found checkpoints {[p.name for p in ckpts]}, "
                     f"tokenizers {[p.name for p in toks]}; need exactly one of each).")


class CheckpointTypes(NamedTuple):
    dtype: torch.dtype            # checkpoint_dtype's
    quantized_gguf: bool          # a GGUF file whose tensors are mostly of a quantized type (Q4_1, Q8_0, ...)


def checkpoint_types(path: str) -> CheckpointTypes:
    """What a checkpoint stores its weights as, from one read of its headers (checkpoint_dtype)."""
    kind, counts = _type_counts(path)
    quantized = kind == "gguf" and bool(counts) and counts.most_common(1)[0][0] not in FLOAT_TYPES
    floats = [(n, t) for t, n in counts.most_common() if t in FLOAT_TYPES]
    dtype = FLOAT_TYPES[floats[0][1]] if floats and not quantized else torch.float32
    return CheckpointTypes(dtype, quantized)


def checkpoint_dtype(path: str) -> torch.dtype:
    """The floating-point dtype a checkpoint stores its weights in, read from its headers: the
    float type (F32, BF16, F16) holding the most elements of every safetensors tensor; of a GGUF
    file's tensors the type holding the most elements, float32 when that is a quantized type
    (a quantized file computes in float32, as llama.cpp does); float32 for llama2.c."""
    return checkpoint_types(path).dtype


def _type_counts(path: str) -> tuple[str, Counter]:
    """(checkpoint kind, elements per tensor type name), from the headers."""
    kind, files = _locate(path)
    counts: Counter = Counter()
    if kind == "hf":
        from safetensors import safe_open
        for f in sorted(files[0].glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    part = st.get_slice(name)
                    counts[part.get_dtype()] += int(np.prod(part.get_shape()))
    elif kind == "gguf":
        from kvserve.model.loaders.gguf import open_gguf
        for t in open_gguf(files[0]).tensors:
            counts[t.tensor_type.name] += int(t.n_elements)
    return kind, counts


def resolve_dtype(config_dtype: str, checkpoint_dtype: torch.dtype, device) -> torch.dtype:
    """The model dtype for `dtype=config_dtype` (a name: "float32", "bf16", ... or "auto").
    "auto" is the checkpoint's dtype on a GPU (bf16 stays bf16, fp16 fp16, float32 float32). On
    the CPU it is what runs fastest there for that weight type (`python
    benchmarks/bench_auto_dtype.py --threads 1`, benchmarks/results/auto_dtype.json, AVX-512 BF16):
    bf16 checkpoints run in bf16 where the CPU has bf16 instructions (quant/cpu_paths' plan computes
    in bf16; 1.1-2.2x float32 on prefill and decode), else in float32 (emulated bf16 GEMMs are
    2-4x float32's, quant/cpu_paths' table); fp16 and float32 checkpoints run in float32 (fp16 decodes
    one sequence 1.9x faster but prefills at 0.27x and decodes batch 16 at 0.49x)."""
    if config_dtype != "auto":
        if config_dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {config_dtype!r}.")
        return getattr(torch, DTYPE_NAMES[config_dtype])
    if torch.device(device).type != "cpu":
        return checkpoint_dtype
    from kvserve.model.quant.cpu_paths import kernel_plan
    if checkpoint_dtype == torch.bfloat16 and kernel_plan().dense_dtype == torch.bfloat16:
        return torch.bfloat16
    return torch.float32


def read_model_config(path: str) -> ModelConfig:
    """The model's ModelConfig without loading its weights (headers and config.json only; a
    GGUF file's Llama 3 rope_freqs factors are left to the load)."""
    kind, files = _locate(path)
    if kind == "hf":
        return _hf_config(files[0])
    if kind == "gguf":
        from kvserve.model.loaders.gguf import _plan_tensors, config_from_metadata, open_gguf, read_metadata
        reader = open_gguf(files[0])
        cfg = config_from_metadata(read_metadata(reader), files[0])[0]
        _plan_tensors({t.name: t for t in reader.tensors}, cfg, files[0])    # vocabulary, tying
        return cfg
    with open(files[0], "rb") as f:
        return _llama2c_config(struct.unpack("<7i", f.read(28)))


def _hf_config(root: Path) -> ModelConfig:
    from safetensors import safe_open

    cfg = ModelConfig.from_hf(json.loads((root / "config.json").read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(root)!r}.")
    shapes: dict[str, tuple] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            shapes.update((name, tuple(st.get_slice(name).get_shape())) for name in st.keys())
    if "lm_head.weight" not in shapes:
        cfg.tie_word_embeddings = True
    if architecture(cfg.architecture).experts:
        check_expert_tensors(cfg, shapes)        # before any model is built from them
    return cfg


def _load_hf(root: Path):
    from safetensors import safe_open

    cfg = _hf_config(root)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                weights[name] = st.get_tensor(name)
    adapt = architecture(cfg.architecture).adapt("adapt_weights")
    if adapt is not None:                                # a family's names -> Llama's (families.py)
        weights = adapt(weights, cfg)
    tok = HFTokenizer(root) if (root / "tokenizer.json").exists() else None
    if tok is not None and tok.eos_token_id is None and isinstance(cfg.eos_token_id, int):
        tok.eos_token_id = cfg.eos_token_id
    return cfg, weights, tok


def _permute_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Adjacent-pair RoPE rows (2j, 2j+1) -> HF's rotate_half order (j, j + d/2), per head."""
    out_dim, dim = w.shape
    hs = out_dim // n_heads
    return w.reshape(n_heads, hs // 2, 2, dim).transpose(1, 2).reshape(out_dim, dim)


def _load_llama2c(ckpt: Path, tok_path: Path):
    raw = ckpt.read_bytes()
    cfg = _llama2c_config(struct.unpack_from("<7i", raw, 0))
    dim, hidden, n_layers, n_heads, n_kv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                                            cfg.num_heads, cfg.num_kv_heads)
    vocab, seq_len, shared = cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings
    hs = dim // n_heads
    kvd = n_kv * hs
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    off = 0

    def take(*shape):
        nonlocal off
        n = int(np.prod(shape))
        if off + n > data.size:
            raise ValueError(f"{ckpt} is truncated or not a llama2.c version-0 checkpoint.")
        t = torch.from_numpy(data[off:off + n].copy()).reshape(shape)
        off += n
        return t

    emb = take(vocab, dim)
    rms_att = take(n_layers, dim)
    wq, wk, wv = take(n_layers, dim, dim), take(n_layers, kvd, dim), take(n_layers, kvd, dim)
    wo = take(n_layers, dim, dim)
    rms_ffn = take(n_layers, dim)
    w1, w2, w3 = take(n_layers, hidden, dim), take(n_layers, dim, hidden), take(n_layers, hidden, dim)
    rms_final = take(dim)
    take(seq_len, hs // 2)
    take(seq_len, hs // 2)  # legacy RoPE tables: recomputed instead
    weights = {"model.embed_tokens.weight": emb, "model.norm.weight": rms_final}
    if not shared:
        weights["lm_head.weight"] = take(vocab, dim)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": rms_att[i],
            p + "post_attention_layernorm.weight": rms_ffn[i],
            p + "self_attn.q_proj.weight": _permute_rotate_half(wq[i], n_heads),
            p + "self_attn.k_proj.weight": _permute_rotate_half(wk[i], n_kv),
            p + "self_attn.v_proj.weight": wv[i],
            p + "self_attn.o_proj.weight": wo[i],
            p + "mlp.gate_proj.weight": w1[i],
            p + "mlp.down_proj.weight": w2[i],
            p + "mlp.up_proj.weight": w3[i],
        })
    return cfg, weights, Llama2cTokenizer(tok_path, vocab)


def _llama2c_config(header: tuple) -> ModelConfig:
    """A llama2.c version-0 header (dim, hidden, layers, heads, KV heads, vocab, seq_len; a
    negative vocab: an unshared classifier follows the weights) as a ModelConfig."""
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = header
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=abs(vocab), hidden_size=dim, intermediate_size=hidden,
        num_layers=n_layers, num_heads=n_heads, num_kv_heads=n_kv, head_dim=dim // n_heads,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=seq_len,
        tie_word_embeddings=vocab > 0, bos_token_id=1, eos_token_id=2)
