"""Writing GGUF test files with gguf-py's GGUFWriter: an HF model directory converted the way
llama.cpp's convert_hf_to_gguf does (names, q/k row permutation for `llama`, 2-D weights
quantized, norms kept F32), with stories260K's SentencePiece tokenizer metadata."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.conftest import STORIES_C

STORIES_GGUF = STORIES_C / "stories260K-f32.gguf"

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, leaf = hf_name.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[leaf]}"
    return HF_TO_GGUF[hf_name]


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate_half halves -> llama.cpp's interleaved pairs (convert_hf_to_gguf's permute)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stories_tokenizer_fields() -> dict:
    """tokenizer.ggml.* values of the stories260K GGUF (a 512-piece SentencePiece BPE)."""
    from gguf import GGUFReader

    reader = GGUFReader(STORIES_GGUF)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def add_stories_tokenizer(writer) -> None:
    tok = stories_tokenizer_fields()
    writer.add_tokenizer_model(tok["tokenizer.ggml.model"])
    writer.add_token_list(tok["tokenizer.ggml.tokens"])
    writer.add_token_scores(tok["tokenizer.ggml.scores"])
    writer.add_token_types(tok["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)


def add_decoder_hparams(w, cfg: dict) -> tuple[int, int, int]:
    """A Llama-style decoder's hyperparameters from an HF config.json, as llama.cpp's converter
    writes them; returns (heads, kv heads, head_dim)."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    return heads, kv, head_dim


def write_out(w) -> None:
    """Header, metadata and tensors of a GGUFWriter written, the file closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_as_gguf(hf_dir: Path, out: Path, qtype: str, arch: str = "llama",
                     rope_freqs: np.ndarray | None = None) -> Path:
    """Convert the random-weight HF model in `hf_dir` to a GGUF file at `out`."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv, head_dim = add_decoder_hparams(w, cfg)
    add_stories_tokenizer(w)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        a = t.float().numpy()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            a = permute_rope_rows(a, heads if "q_proj" in name else kv)
        if a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    write_out(w)
    return out


# K-quant block layouts: bytes per 256 values, and the offsets of their float16 scale fields.
K_QUANTS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
            "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_k_quant(rows: int, cols: int, qtype: str, rng: np.random.Generator,
                   std: float = 0.05) -> np.ndarray:
    """Random K-quant blocks [rows, cols / 256 * block_bytes] whose values have about `std`
    (gguf-py cannot quantize to K-quants): random bits, float16 scales set to one shared value."""
    import gguf

    size, scale_at = K_QUANTS[qtype]
    qt = gguf.GGMLQuantizationType[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)

    def set_scales(value):
        for off in scale_at:
            blocks[:, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    set_scales(1.0)
    spread = gguf.quants.dequantize(blocks.reshape(rows, -1), qt).std()
    set_scales(std / spread)
    return blocks.reshape(rows, -1)


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q4_K blocks [rows, cols / 256 * 144], by plain rounding (not
    llama.cpp's search, but its layout and its way of deriving d and dmin from the weights):
    per sub-block of 32, scale = range / 15 and min = -min(w, 0), both 6-bit against the
    super-block's d = max scale / 63 and dmin = max min / 63."""
    rows = a.shape[0]
    x = a.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - lo) / 15, -lo                                # [n, 8]
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-6).astype(np.float16)
    dmin = np.maximum(mins.max(-1, keepdims=True) / 63, 1e-6).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    q = np.clip(np.round((x + (dmin.astype(np.float32) * m)[..., None]) / step[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4 << 6), m[:, :4] | (m[:, 4:] >> 4 << 6),
                             (sc[:, 4:] & 15) | (m[:, 4:] << 4)], axis=1)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, nibbles], axis=1)
    return blocks.reshape(rows, -1)


def write_mixed_types(out: Path, seed: int = 0, types: dict[str, str] | None = None) -> Path:
    """A one-layer Llama (hidden 256, so K-quant rows fit) whose tensors use BF16, Q5_0, Q5_1
    and the K-quants, written directly (no HF model behind it); `types` overrides some."""
    import gguf

    rng = np.random.default_rng(seed)
    E, I, V, H, KV, D = 256, 256, 512, 4, 2, 64
    w = gguf.GGUFWriter(str(out), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, E),
                   (w.add_feed_forward_length, I), (w.add_head_count, H), (w.add_head_count_kv, KV),
                   (w.add_rope_dimension_count, D), (w.add_rope_freq_base, 10000.0),
                   (w.add_layer_norm_rms_eps, 1e-5)]:
        add(v)
    add_stories_tokenizer(w)
    plan = {"token_embd.weight": ((V, E), "Q6_K"), "output.weight": ((V, E), "Q5_K"),
            "blk.0.attn_q.weight": ((H * D, E), "Q4_K"), "blk.0.attn_k.weight": ((KV * D, E), "Q3_K"),
            "blk.0.attn_v.weight": ((KV * D, E), "Q2_K"),
            "blk.0.attn_output.weight": ((E, H * D), "BF16"),
            "blk.0.ffn_gate.weight": ((I, E), "Q5_0"), "blk.0.ffn_up.weight": ((I, E), "Q5_1"),
            "blk.0.ffn_down.weight": ((E, I), "F16")}
    plan.update({name: (plan[name][0], qtype) for name, qtype in (types or {}).items()})
    for name, (shape, qtype) in plan.items():
        qt = gguf.GGMLQuantizationType[qtype]
        std = 0.5 if name == "token_embd.weight" else 0.05
        if qtype in K_QUANTS:
            w.add_tensor(name, random_k_quant(*shape, qtype, rng, std), raw_dtype=qt)
        else:
            a = rng.normal(0, 0.05, size=shape).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    write_out(w)
    return out


def llama3_rope_freqs(hf_dir: Path) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a Llama-3 rope_scaling config: per-frequency divisors."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}),
                                          "rope_theta": cfg.get("rope_theta")}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out
