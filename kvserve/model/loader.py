"""Find and load a model: an HF directory (config.json + safetensors, memory-mapped), Karpathy's
llama2.c checkpoint (`*.bin` + `tok*.bin`, layout in stories260K/FORMAT.md), or a GGUF file
(gguf.py), given directly or as the only `*.gguf` in a directory without config.json."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.gguf import load_gguf
from kvserve.model.tokenizer import HFTokenizer, Llama2cTokenizer, Tokenizer


def load_model_dir(path: str, **gguf_options) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """(config, weights with HF names, tokenizer) for an HF or llama2.c model directory, or a
    GGUF file (`gguf_options`: load_gguf's native, dtype, device)."""
    root = Path(path)
    if root.is_file():
        return load_gguf(root, **gguf_options)
    if not root.is_dir():
        raise ValueError(f"model path {path!r} does not exist; pass a .gguf file, or a directory "
                         "holding config.json and *.safetensors, or a llama2.c checkpoint and tok*.bin.")
    if (root / "config.json").exists():
        return _load_hf(root)
    ggufs = sorted(root.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], **gguf_options)
    if ggufs:
        raise ValueError(f"{path!r} holds several GGUF files ({[p.name for p in ggufs]}); pass "
                         "the path of the one to load.")
    toks = sorted(root.glob("tok*.bin"))
    ckpts = sorted(p for p in root.glob("*.bin") if p not in toks)
    if len(ckpts) == 1 and len(toks) == 1:
        return _load_llama2c(ckpts[0], toks[0])
    raise ValueError(f"{path!r} is neither an HF model directory (no config.json), nor holds a "
                     f".gguf file, nor is a llama2.c one (found checkpoints {[p.name for p in ckpts]}, "
                     f"tokenizers {[p.name for p in toks]}; need exactly one of each).")


def _load_hf(root: Path):
    from safetensors import safe_open

    cfg = ModelConfig.from_hf(json.loads((root / "config.json").read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(root)!r}.")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                weights[name] = st.get_tensor(name)
    if "lm_head.weight" not in weights:
        cfg.tie_word_embeddings = True
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
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
    shared = vocab > 0
    vocab = abs(vocab)
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
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
        num_layers=n_layers, num_heads=n_heads, num_kv_heads=n_kv, head_dim=hs, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=seq_len, tie_word_embeddings=shared,
        bos_token_id=1, eos_token_id=2)
    return cfg, weights, Llama2cTokenizer(tok_path, vocab)
