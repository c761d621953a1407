"""KV-cache sizes, memory ceilings, decode throughput ceilings and Little's law.

Closed forms from seed 001 ("KV cache size: the formula that governs everything", "The
Tokens-Per-Second Ceiling", "Little's Law", exercises 2-5), seed 003 (m_KV) and seed 000
("Where does the compute go: MLP versus attention"). Every function is a plain formula; units are
bytes, seconds, tokens and FLOP.
"""
from __future__ import annotations

import math

from .specs import ModelSpec, dtype_bytes

KiB, MiB, GiB = 2**10, 2**20, 2**30
KV_SCALE_BYTES = 4     # one float32 scale per token and KV head of a quantized cache (kvserve/attention/kv_quant.py)


def kv_scale_bytes(kv_dtype: str | float) -> float:
    """Scale bytes per token-head row: KV_SCALE_BYTES for a named sub-2-byte (quantized) dtype, else 0."""
    return KV_SCALE_BYTES if isinstance(kv_dtype, str) and dtype_bytes(kv_dtype) < 2 else 0.0


def kv_bytes_per_token(model: ModelSpec | None = None, kv_dtype: str | float = "bf16", *,
                       n_layers: int | None = None, n_kv_heads: int | None = None,
                       head_dim: int | None = None, full_kv: bool = False) -> float:
    """Seed 003: m_KV = 2 * L * n_kv * d_k * s_KV bytes per token (one key and one value per KV head
    per layer), plus 2 * L * n_kv scales for a quantized (int8 / fp8) cache, as the engine stores
    them. Pass a ModelSpec, or the three shape numbers as keywords; a number of bytes has no scales.
    Multi-head latent attention caches L * (kv_lora_rank + qk_rope_head_dim) numbers and 2 L
    scales (kvserve/attention/mla.py); `full_kv` gives what its per-head keys (nope + rope wide)
    and values (v_head_dim) would take instead."""
    scale = kv_scale_bytes(kv_dtype)
    if model is not None and model.kv_lora_rank and n_kv_heads is None and head_dim is None:
        L = n_layers if n_layers is not None else model.n_layers
        if full_kv:
            return L * model.n_kv_heads * ((model.head_dim + model.v_head_dim) * dtype_bytes(kv_dtype) + 2 * scale)
        return L * ((model.kv_lora_rank + model.qk_rope_head_dim) * dtype_bytes(kv_dtype) + 2 * scale)
    L = n_layers if n_layers is not None else model.n_layers
    kv = n_kv_heads if n_kv_heads is not None else model.n_kv_heads
    hd = head_dim if head_dim is not None else model.head_dim
    return 2 * L * kv * (hd * dtype_bytes(kv_dtype) + scale)


def kv_cache_bytes(model: ModelSpec, seq_len: float, batch: float = 1, kv_dtype: str | float = "bf16") -> float:
    """Seed 001 `kv_cache_bytes`: 2 * B * S * L * H_kv * d_h * P bytes, for `batch` sequences of
    `seq_len` cached tokens each."""
    return kv_bytes_per_token(model, kv_dtype) * seq_len * batch


def contexts_that_fit(budget_bytes: float, seq_len: float, model: ModelSpec, kv_dtype: str | float = "bf16") -> int:
    """How many whole contexts of `seq_len` tokens fit in a KV budget: floor(budget / (S * m_KV))
    (seed 001 exercise 2c)."""
    return int(budget_bytes // kv_cache_bytes(model, seq_len, 1, kv_dtype))


def kv_budget(hw_memory: float, model: ModelSpec, n_gpu: int = 1, weight_dtype: str | float = "bf16",
              gpu_memory_utilization: float = 0.9, activation_reserve: float = 0.0) -> float:
    """Bytes left for the KV block pool on a replica of n_gpu GPUs: vLLM's rule of thumb,
    utilization * total memory - weights - activation reserve (seed 003's paging cell uses 90%)."""
    return gpu_memory_utilization * hw_memory * n_gpu - model.weight_bytes(weight_dtype) - activation_reserve


def decode_ceiling_weights_only(n_params: float, bandwidth: float, weight_dtype: str | float = "bf16",
                                batch: int = 1) -> float:
    """Seed 001 "The Tokens-Per-Second Ceiling": tokens/s <= B * BW / (N_params * P). With batch=1 it is
    the single-stream ceiling of exercise 3; with batch=B the weight-only aggregate of exercise 5."""
    return batch * bandwidth / (n_params * dtype_bytes(weight_dtype))


def decode_ceiling_tps(weight_bytes: float, bandwidth: float, batch: int, seq_len: float, model: ModelSpec,
                       kv_dtype: str | float = "bf16") -> float:
    """Seed 001 exercise 5 `decode_ceiling_tps`: aggregate tokens/s for a memory-bound decode step of
    `batch` sequences at `seq_len` cached tokens each, reading the weights once and every KV cache:
    t_step = (M_W + B * S * m_KV) / BW, tokens/s = B / t_step."""
    t_step = (weight_bytes + kv_cache_bytes(model, seq_len, batch, kv_dtype)) / bandwidth  # s
    return batch / t_step


def littles_law(concurrency: float, latency_s: float) -> float:
    """Seed 001 Little's law L = lambda * W, solved for the throughput lambda = L / W."""
    return concurrency / latency_s


def fleet_throughput(concurrency: float, output_tokens: float, tpot_s: float) -> dict:
    """Seed 001 exercise 4: W ~ T * TPOT, lambda = L / W requests/s, and lambda * T output tokens/s."""
    W = output_tokens * tpot_s
    lam = littles_law(concurrency, W)
    return {"latency_s": W, "requests_per_s": lam, "tokens_per_s": lam * output_tokens}


def attention_crossover_tokens(d_model: int) -> int:
    """Seed 000: a token costs ~24 d^2 FLOPs in the linear layers and ~4 T d in attention, so attention
    dominates once T > 6d (24,576 tokens for d = 4096)."""
    return 6 * d_model


def flops_per_token_seed000(d_model: int, context: float) -> tuple[float, float]:
    """Seed 000: (linear, attention) FLOPs per token per layer: (24 d^2, 4 T d), MLP hidden 4d."""
    return 24.0 * d_model**2, 4.0 * context * d_model


def decode_attention_intensity(model: ModelSpec, kv_dtype: str | float = "bf16") -> float:
    """Seed 001: arithmetic intensity of decode attention, 4 S H_q d_h FLOPs over 2 S H_kv d_h P bytes
    = 2 H_q / (H_kv P) FLOP/byte, independent of S and B (4 for Llama 3 8B in bf16). Absorbed
    multi-head latent attention: 2 S H (2 R + P) FLOPs over S (R + P) P bytes a layer."""
    if model.kv_lora_rank:
        R, P = model.kv_lora_rank, model.qk_rope_head_dim
        return 2 * model.n_heads * (2 * R + P) / ((R + P) * dtype_bytes(kv_dtype))
    return 2 * model.n_heads / (model.n_kv_heads * dtype_bytes(kv_dtype))


def paging_waste_slots(block_size: int) -> float:
    """Seed 003 "Choosing the block size": a paged sequence wastes on average (n_blk - 1) / 2 token slots
    in its last block (for lengths uniform modulo n_blk)."""
    return (block_size - 1) / 2


def block_table_entries(tokens: int, block_size: int) -> int:
    """Seed 003: ceil(T / n_blk) block-table entries per sequence."""
    return math.ceil(tokens / block_size)


def exponential_tail(x: float, mean: float) -> float:
    """Seed 003: a length exponential with mean E[l] exceeds x steps with chance e^{-x / E[l]}; at mean
    200, about 37% of answers run past 200 steps and about 5% past 600."""
    return math.exp(-x / mean)


def moe_split(n_params: float, n_active: float, n_experts: int, top_k: int) -> tuple[float, float]:
    """(trunk, per-expert) parameters of a mixture of experts from its totals: N = trunk + E p and
    N_act = trunk + k p, so p = (N - N_act) / (E - k) and trunk = N_act - k p."""
    if not 0 < top_k < n_experts:
        raise ValueError(f"top_k must be in [1, n_experts), got top_k={top_k}, n_experts={n_experts}")
    per_expert = (n_params - n_active) / (n_experts - top_k)
    return n_active - top_k * per_expert, per_expert


def moe_params_read(n_params: float, n_active: float, batch: int = 1, n_experts: int | None = None,
                    top_k: int | None = None) -> float:
    """Seed 001: for a mixture of experts a decode step reads "every active weight -- the dense trunk plus
    only the experts routed to this step's tokens". One token reads N_act. With E experts and top-k
    routing, each layer's B tokens touch E (1 - (1 - k/E)^B) distinct experts in expectation (routing
    uniform and independent, an assumption), so the step reads trunk + that many experts' weights,
    growing from N_act at B = 1 towards N. Without E and k, N_act (the batch-1 figure)."""
    if n_experts is None or top_k is None or batch <= 1:
        return n_active
    trunk, per_expert = moe_split(n_params, n_active, n_experts, top_k)
    return trunk + n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch) * per_expert


def moe_decode_ceiling(n_params: float, n_active: float, bandwidth: float, weight_dtype: str | float = "bf16",
                       batch: int = 1, n_experts: int | None = None, top_k: int | None = None) -> float:
    """Seed 001's tokens/s ceiling for a mixture of experts: B * BW / (weights read per step * P), the
    weights read being `moe_params_read` (only active weights at batch 1)."""
    return batch * bandwidth / (moe_params_read(n_params, n_active, batch, n_experts, top_k) *
                                dtype_bytes(weight_dtype))
