"""Hardware and model specifications for the analytic tools.

Seed 000 ("How to draw the Roofline for a GPU Architecture") needs two numbers per device and
precision: peak compute P_peak (FLOP/s) and peak bandwidth B_peak (bytes/s). Seed 001 ("The KV
cache size formula", "Why decode is memory-bound") and seed 003 (symbols pi, beta, N, m_KV) need
the model's shape: layers L, key-value heads n_kv, head width d_k, parameters N.

Units everywhere in kvserve.analysis: seconds, bytes, FLOP, FLOP/s, bytes/s (decimal: 1 GB = 1e9
bytes, 1 TB/s = 1e12 bytes/s), and KiB/GiB (binary) only where a seed prints them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

# bytes per stored number, by dtype name
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "float32": 4.0, "tf32": 4.0,
    "fp16": 2.0, "float16": 2.0, "bf16": 2.0, "bfloat16": 2.0,
    "fp8": 1.0, "int8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0,   # the last two: vLLM's kv_cache_dtype names
    "int4": 0.5, "fp4": 0.5,
}


def dtype_bytes(dtype: str | float) -> float:
    """Bytes per element of a dtype name ('bf16', 'int4', ...) or a number of bytes passed through."""
    if isinstance(dtype, (int, float)):
        return float(dtype)
    key = dtype.lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)} or a number of bytes")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: dense peak FLOP/s per dtype, HBM bandwidth, HBM capacity.

    `flops` maps a dtype name to dense (no sparsity) peak FLOP/s. `bandwidth` is peak memory
    bandwidth in bytes/s (seed 000's B_peak, seed 003's beta). `memory` is HBM bytes.
    """
    name: str
    flops: dict[str, float]
    bandwidth: float
    memory: float = 0.0
    note: str = ""

    def peak(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s for a dtype (seed 000's P_peak, seed 003's pi); fp16 and bf16 are aliases."""
        aliases = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "fp16": "bf16", "bf16": "fp16"}
        for key in (dtype, dtype.lower(), aliases.get(dtype.lower(), "")):
            if key in self.flops:
                return self.flops[key]
        raise ValueError(f"{self.name} has no peak FLOP/s for {dtype!r}; it knows {sorted(self.flops)}")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """Seed 000: Ridge Point = P_peak / B_peak, in FLOP/byte."""
        return self.peak(dtype) / self.bandwidth


# Presets. Numbers are the ones the seeds use where a seed states them, else the vendor's
# dense (non-sparse) datasheet figure.
HARDWARE: dict[str, HardwareSpec] = {
    # seed 000: "NVIDIA A100 40 GB PCIe, FP32: P_peak = 19,500 GFLOPs/s and B_peak = 1,555 GB/s"
    "a100-40gb-pcie": HardwareSpec(
        "A100 40GB PCIe", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12, "int8": 624e12},
        1555e9, 40e9, "seed 000's roofline example (FP32)"),
    # seed 001: "An A100 delivers roughly 312 TFLOP/s of bf16 ... against roughly 2.0 TB/s";
    # exercises 3 and 5 use 2.0 TB/s. (Datasheet: A100 80GB SXM, 2.039 TB/s.)
    "a100": HardwareSpec(
        "A100 80GB SXM", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12, "int8": 624e12},
        2.0e12, 80e9, "seed 001 rounds the bandwidth to 2.0 TB/s"),
    # seed 001: "H100 (on the order of 990 TFLOP/s dense bf16 against ~3.3 TB/s of HBM3)";
    # datasheet H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB.
    "h100": HardwareSpec(
        "H100 80GB SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12,
                          "int8": 1979e12}, 3.35e12, 80e9, "dense datasheet figures"),
    "h200": HardwareSpec(
        "H200 141GB SXM", {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12,
                           "int8": 1979e12}, 4.8e12, 141e9, "H100 compute, HBM3e"),
    # seed 001: "HBM3e bandwidth on the order of 8 TB/s alongside proportionally more tensor-core throughput"
    "b200": HardwareSpec(
        "B200 180GB", {"fp32": 75e12, "tf32": 1100e12, "bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12,
                       "int8": 4500e12, "fp4": 9000e12}, 8.0e12, 180e9, "dense datasheet figures (HGX B200)"),
}


def get_hardware(name: str | HardwareSpec) -> HardwareSpec:
    """A preset by name (case-insensitive; 'a100-40gb-pcie', 'a100', 'h100', 'h200', 'b200')."""
    if isinstance(name, HardwareSpec):
        return name
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE)} (or use --measure)")
    return HARDWARE[key]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as the seeds' formulas need it.

    n_params: N, all parameters (seed 003 uses N = 8.03e9 for Llama 3.1 8B).
    n_active: N_act, parameters multiplied per token (= N for a dense model; seed 003).
    d_attn: total width of the query heads, n_heads * head_dim (seed 003's d_attn).
    """
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    n_params: float
    n_active: float | None = None
    tie_embeddings: bool = False
    n_experts: int | None = None      # a mixture of experts: routed experts per MoE layer
    top_k: int | None = None          # and experts routed per token
    # multi-head latent attention (DeepSeek-V2): a token caches kv_lora_rank + qk_rope_head_dim
    # numbers a layer; head_dim is then a query / key head's width (nope + rope), v_head_dim a value's
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def d_attn(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def n_act(self) -> float:
        return self.n_params if self.n_active is None else self.n_active

    def weight_bytes(self, dtype: str | float = "bf16") -> float:
        """M_W = N * s_W bytes of weights (seed 003)."""
        return self.n_params * dtype_bytes(dtype)

    def with_params(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def count_params(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                 vocab_size: int, tie_embeddings: bool = False, gated_mlp: bool = True,
                 qk_norm: bool = False) -> int:
    """Parameters of a Llama-style decoder: embeddings (+ untied LM head), q/k/v/o projections,
    a SwiGLU MLP (3 matrices; 2 if not gated), two RMSNorms per layer and a final norm."""
    attn = d_model * n_heads * head_dim + 2 * d_model * n_kv_heads * head_dim + n_heads * head_dim * d_model
    mlp = (3 if gated_mlp else 2) * d_model * d_ff
    norms = 2 * d_model + (2 * head_dim if qk_norm else 0)
    emb = vocab_size * d_model * (1 if tie_embeddings else 2)
    return emb + n_layers * (attn + mlp + norms) + d_model


def _preset(name, L, d, h, kv, hd, ff, V, tie=False, qk_norm=False, n_params=None):
    n = n_params if n_params is not None else count_params(L, d, h, kv, hd, ff, V, tie, qk_norm=qk_norm)
    return ModelSpec(name, L, d, h, kv, hd, ff, V, float(n), None, tie)


MODELS: dict[str, ModelSpec] = {
    # Llama 3.1 8B: 32 layers, 8 KV heads of width 128 (seeds 001, 003); N = 8.03e9 (seed 003).
    "llama-3.1-8b": _preset("Llama 3.1 8B", 32, 4096, 32, 8, 128, 14336, 128256),
    # Llama 3.1 70B: 80 layers, 8 KV heads of width 128 (seed 001 exercise 2 uses this shape).
    "llama-3.1-70b": _preset("Llama 3.1 70B", 80, 8192, 64, 8, 128, 28672, 128256),
    # seed 001 exercise 3: "a 13B-parameter model" -- Llama 2 13B's shape (full MHA), N = 13e9 exactly.
    "llama-13b": _preset("13B (Llama 2 13B shape)", 40, 5120, 40, 40, 128, 13824, 32000, n_params=13e9),
    # Qwen3-0.6B config.json: 28 layers, 16 heads, 8 KV heads of 128, tied embeddings, qk-norm.
    # SmolLM2-135M config.json (kvserve's default model): 30 layers, 9 heads, 3 KV heads of 64, tied.
    "smollm2-135m": _preset("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie=True),
    "qwen3-0.6b": _preset("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, tie=True, qk_norm=True),
}


def model_from_hf_config(config: dict | str, name: str | None = None) -> ModelSpec:
    """ModelSpec from a Hugging Face config.json (a dict, a path to the file, or a model directory)."""
    if isinstance(config, str):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        with open(path) as f:
            config = json.load(f)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path)))
    c = config.get("text_config", config)
    d = int(c["hidden_size"])
    h = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or h)
    hd = int(c.get("head_dim") or d // h)
    L = int(c["num_hidden_layers"])
    ff = int(c.get("intermediate_size") or 4 * d)
    V = int(c["vocab_size"])
    tie = bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)))
    model_type = str(c.get("model_type", "")).lower()
    qk_norm = model_type.startswith("qwen3")
    n = count_params(L, d, h, kv, hd, ff, V, tie, qk_norm=qk_norm)
    n_active, n_experts, top_k = None, None, None
    if model_type.startswith("qwen2") or c.get("attention_bias"):   # q, k, v biases
        n += L * (h + 2 * kv) * hd
    if model_type == "olmoe":                     # its q / k norms span all heads, not one head
        n += L * (h + kv) * hd
    n_experts = int(c.get("num_local_experts") or c.get("num_experts") or 0) or None
    if n_experts:
        # A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): each MoE layer holds a router
        # (d x E), E gated experts of width moe_intermediate_size (Mixtral and OLMoE: intermediate_size)
        # and, in Qwen2-MoE, a shared expert with its sigmoid gate (d x 1); a token multiplies the
        # top-k experts only (N_act, seed 001). Layers listed in mlp_only_layers, or off the
        # decoder_sparse_step, keep the dense MLP of width intermediate_size (transformers' rule).
        top_k = int(c["num_experts_per_tok"])
        ff_e = int(c.get("moe_intermediate_size") or ff)
        ff_s = int(c.get("shared_expert_intermediate_size") or 0)
        step, dense_only = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or [])
        n_moe = sum(1 for i in range(L) if i not in dense_only and (i + 1) % step == 0)
        expert, shared = 3 * d * ff_e, 3 * d * ff_s + (d if ff_s else 0)
        per_layer = d * n_experts + n_experts * expert + shared - 3 * d * ff   # replaces the dense MLP
        n += n_moe * per_layer
        n_active = n - n_moe * (n_experts - top_k) * expert
    if c.get("kv_lora_rank"):
        return _deepseek_v2(c, name, L, d, h, ff, V, tie)
    return ModelSpec(name or str(c.get("model_type", "model")), L, d, h, kv, hd, ff, V, float(n),
                     None if n_active is None else float(n_active), tie, n_experts, top_k)


def _deepseek_v2(c: dict, name, L, d, h, ff, V, tie) -> ModelSpec:
    """DeepSeek-V2's shape: multi-head latent attention (q straight or through q_lora_rank, the
    latent kv_a [d x (R + P)] with its norm, kv_b [R x H (nope + v)], o [H v x d]), the first
    first_k_dense_replace layers a dense MLP, the others n_routed_experts experts of
    moe_intermediate_size (top num_experts_per_tok) plus n_shared_experts always-on ones."""
    R, P = int(c["kv_lora_rank"]), int(c.get("qk_rope_head_dim", 64))
    nope, v, qr = int(c.get("qk_nope_head_dim", 128)), int(c.get("v_head_dim", 128)), c.get("q_lora_rank")
    q = d * qr + qr + qr * h * (nope + P) if qr else d * h * (nope + P)
    attn = q + d * (R + P) + R + R * h * (nope + v) + h * v * d + 2 * d
    E, k = int(c.get("n_routed_experts") or 0), int(c.get("num_experts_per_tok") or 0)
    ff_e = int(c.get("moe_intermediate_size") or 1407)
    shared = 3 * d * ff_e * int(c.get("n_shared_experts") or 0)
    n_dense = min(int(c.get("first_k_dense_replace") or 0), L) if E else L
    n_moe = L - n_dense
    expert = 3 * d * ff_e
    emb = V * d * (1 if tie else 2)
    n = emb + L * attn + n_dense * 3 * d * ff + n_moe * (d * E + E * expert + shared) + d
    n_active = n - n_moe * (E - k) * expert
    return ModelSpec(name or str(c.get("model_type", "deepseek_v2")), L, d, h, h, nope + P, ff, V, float(n),
                     float(n_active), tie, E or None, k or None, R, P, v)


# Mixtures of experts from their published config.json shapes: Mixtral 8x7B (46.7B parameters,
# 12.9B active, Mistral's figures) and Qwen3-30B-A3B (30.5B, 3.3B active, Qwen's).
MODELS["mixtral-8x7b"] = model_from_hf_config(dict(
    model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2), "Mixtral 8x7B")
MODELS["qwen3-30b-a3b"] = model_from_hf_config(dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    num_experts=128, num_experts_per_tok=8), "Qwen3-30B-A3B")


# DeepSeek-V2-Lite's config.json shape (15.7B parameters, 2.4B active, DeepSeek's figures).
MODELS["deepseek-v2-lite"] = model_from_hf_config(dict(
    model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1), "DeepSeek-V2-Lite")
# DeepSeek-V3's (and R1's) config.json shape: 671B parameters, 37B active (DeepSeek's figures; the
# multi-token-prediction layer's 14B are not counted, kvserve does not run it).
MODELS["deepseek-v3"] = model_from_hf_config(dict(
    model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, kv_lora_rank=512,
    q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3), "DeepSeek-V3")


def get_model(name: str | ModelSpec) -> ModelSpec:
    """A preset by name ('llama-3.1-8b', 'llama-3.1-70b', 'llama-13b', 'qwen3-0.6b', 'mixtral-8x7b',
    'qwen3-30b-a3b', 'deepseek-v2-lite', 'deepseek-v3'), or a path to a
    config.json / model directory."""
    if isinstance(name, ModelSpec):
        return name
    key = name.lower()
    if key in MODELS:
        return MODELS[key]
    if os.path.exists(name):
        return model_from_hf_config(name)
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODELS)}, or a path to a config.json")


def measure_hardware(seconds: float = 1.0, dtype: str = "fp32", size_mb: int = 64,
                     n: int = 1024) -> HardwareSpec:
    """Measure this machine: copy bandwidth (read + write bytes / s of a large tensor copy) and
    dense matmul FLOP/s (2 n^3 per n x n matmul), each the best of repeated runs for ~`seconds`.

    Uses torch if importable (CUDA if available), else numpy. The result is a HardwareSpec whose
    `flops` has the one measured dtype; it is a lower bound on the true peaks.
    """
    try:
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        src = torch.empty(size_mb * 2**20 // 4, dtype=torch.float32, device=dev).fill_(1.0)
        dst = torch.empty_like(src)
        a = torch.randn(n, n, device=dev).to(tdt)
        b = torch.randn(n, n, device=dev).to(tdt)
        copy = lambda: dst.copy_(src)
        mm = lambda: torch.mm(a, b)
        name = f"measured ({torch.cuda.get_device_name() if dev == 'cuda' else 'cpu, torch'})"
    except ImportError:  # pragma: no cover - torch is in the venv
        import numpy as np
        src = np.ones(size_mb * 2**20 // 4, dtype=np.float32)
        dst = np.empty_like(src)
        a = np.random.rand(n, n).astype(np.float32)
        b = np.random.rand(n, n).astype(np.float32)
        copy = lambda: np.copyto(dst, src)
        mm = lambda: a @ b
        sync = lambda: None
        name = "measured (cpu, numpy)"

    def best(fn) -> float:
        fn(); sync()
        t_end, best_t = time.perf_counter() + seconds / 2, math.inf
        while time.perf_counter() < t_end:
            t0 = time.perf_counter(); fn(); sync()
            best_t = min(best_t, time.perf_counter() - t0)
        return best_t

    nbytes = 2 * src.numel() * 4 if hasattr(src, "numel") else 2 * src.nbytes
    bw = nbytes / best(copy)
    flops = 2 * n ** 3 / best(mm)
    return HardwareSpec(name, {dtype: flops}, bw, 0.0, f"copy {size_mb} MiB, matmul {n}x{n} {dtype}")
