"""The roofline model: arithmetic intensity and attainable performance (seed 000, "Roofline model",
"How to calculate the roofline point", "How to draw the Roofline for a GPU Architecture"; seed 001,
"Why Decode Is Memory-Bound and Prefill Is Compute-Bound").

An `Op` carries FLOPs and bytes moved; its intensity is X = FLOPs / bytes, its roof is
min(P_peak, B_peak * X), and with a measured time its point is Y = FLOPs / time.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kvmath import kv_bytes_per_token
from .specs import HardwareSpec, ModelSpec, dtype_bytes


@dataclass(frozen=True)
class Op:
    """One operation: `flops` FLOP and `bytes` bytes read + written; `seconds` if it was timed."""
    name: str
    flops: float
    bytes: float
    seconds: float | None = None

    @property
    def intensity(self) -> float:
        """Seed 000: Arithmetic Intensity X = total FLOPs / total bytes read and written."""
        return self.flops / self.bytes

    @property
    def achieved(self) -> float | None:
        """Seed 000: Performance Y = total FLOPs / time, in FLOP/s (seed prints GFLOP/s = this / 1e9)."""
        return None if self.seconds is None else self.flops / self.seconds

    def timed(self, seconds: float) -> "Op":
        return Op(self.name, self.flops, self.bytes, seconds)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Seed 000: Ridge Point = P_peak / B_peak (FLOP/byte)."""
    return peak_flops / bandwidth


def attainable(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Seed 000: P <= min(P_peak, B_peak * I), in FLOP/s."""
    return min(peak_flops, bandwidth * intensity)


def bound(op: Op, peak_flops: float, bandwidth: float) -> str:
    """'memory' left of the ridge point, 'compute' at or right of it (seed 000)."""
    return "memory" if op.intensity < ridge_point(peak_flops, bandwidth) else "compute"


def min_time(op: Op, peak_flops: float, bandwidth: float) -> float:
    """Roofline lower bound on time: max(FLOPs / P_peak, bytes / B_peak), seconds (perfect overlap)."""
    return max(op.flops / peak_flops, op.bytes / bandwidth)


def vector_op(n: int, flops_per_element: float = 1, n_inputs: int = 2, n_outputs: int = 1,
              dtype: str | float = "fp32", name: str = "vector add") -> Op:
    """Seed 000 "Vector Sum": C[i] = A[i] + B[i] over n elements: n FLOPs, (inputs + outputs) * n * dt
    bytes; X = 1 / 12 = 0.083 for fp32."""
    dt = dtype_bytes(dtype)
    return Op(name, flops_per_element * n, (n_inputs + n_outputs) * n * dt)


def matmul(A: int, B: int, C: int, dtype: str | float = "fp32", cached: bool = True, batch: int = 1,
           name: str | None = None) -> Op:
    """Seed 000 "Matrix Multiplication" [A x B] @ [B x C]: FLOPs = 2ABC. Bytes with cache:
    (AB + BC + AC) dt; naive (every operand fetched per use): 2ABC dt. `batch` multiplies both
    (seed 000 "Tensor multiplication": the extra dims D*E*F cancel in X)."""
    dt = dtype_bytes(dtype)
    flops = 2.0 * A * B * C * batch
    nbytes = ((A * B + B * C + A * C) if cached else 2.0 * A * B * C) * dt * batch
    return Op(name or f"matmul {A}x{B}x{C}{'' if cached else ' (naive)'}", flops, nbytes)


def linear_intensity_approx(n_tokens: int, dtype: str | float = "bf16") -> float:
    """Seed 001: for X[N x d] @ W[d x d] with the weight read dominating, I ~ 2 N d^2 / (d^2 P) = 2N/P."""
    return 2.0 * n_tokens / dtype_bytes(dtype)


def decode_step(model: ModelSpec, batch: int, context: float, weight_dtype: str | float = "bf16",
                kv_dtype: str | float = "bf16") -> Op:
    """One decode step of `batch` sequences at `context` cached tokens each (seed 001, seed 003's step
    model): FLOPs = B (2 N_act + 4 L d_attn S); bytes = N s_W (weights once) + B S m_KV (every cache)."""
    flops = batch * (2.0 * model.n_act + 4.0 * model.n_layers * model.d_attn * context)
    nbytes = model.weight_bytes(weight_dtype) + batch * context * kv_bytes_per_token(model, kv_dtype)
    return Op(f"decode B={batch} S={int(context)}", flops, nbytes)


def prefill_flops(model: ModelSpec, n_tokens: float, cached: float = 0.0) -> float:
    """Seed 003: prefill FLOPs of n_tokens new tokens after `cached` tokens,
    2 N_act T_new + 2 L d_attn ((T_hit + T_new)^2 - T_hit^2): weight arithmetic plus causal attention
    (4 L d_attn j FLOPs for the token at position j, summed over the new positions)."""
    total = cached + n_tokens
    return 2.0 * model.n_act * n_tokens + 2.0 * model.n_layers * model.d_attn * (total**2 - cached**2)


def prefill_step(model: ModelSpec, n_tokens: int, weight_dtype: str | float = "bf16",
                 kv_dtype: str | float = "bf16") -> Op:
    """One prefill pass over n_tokens: FLOPs from `prefill_flops`; bytes = weights once + KV written."""
    nbytes = model.weight_bytes(weight_dtype) + n_tokens * kv_bytes_per_token(model, kv_dtype)
    return Op(f"prefill T={n_tokens}", prefill_flops(model, n_tokens), nbytes)


def decode_attention(model: ModelSpec, context: float, kv_dtype: str | float = "bf16") -> Op:
    """Seed 001: decode attention of one sequence: 4 S H_q d_h L FLOPs over 2 S H_kv d_h P L bytes."""
    L, hd = model.n_layers, model.head_dim
    return Op(f"decode attention S={int(context)}", 4.0 * context * model.n_heads * hd * L,
              context * kv_bytes_per_token(model, kv_dtype))


def plot_roofline(hw: HardwareSpec | tuple[float, float], ops: list[Op], path: str, dtype: str = "bf16",
                  title: str | None = None) -> str:
    """Seed 000's roofline chart, log-log: min(P_peak, B_peak x) with the ridge point marked, and each
    op as a point at (intensity, achieved) if timed, else on the roof. Writes a PNG; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if isinstance(hw, HardwareSpec):
        P, Bw, label = hw.peak(dtype), hw.bandwidth, f"{hw.name} {dtype}"
    else:
        (P, Bw), label = hw, "roofline"
    ridge = ridge_point(P, Bw)
    xs = [op.intensity for op in ops] + [ridge]
    x = np.logspace(np.log10(min(xs) / 4), np.log10(max(xs) * 4), 400)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(x, np.minimum(P, Bw * x) / 1e9, color="red", lw=2, label=f"{label} roof")
    ax.scatter([ridge], [P / 1e9], color="red", marker="^", zorder=5)
    ax.annotate(f"ridge {ridge:.2f} FLOP/B", (ridge, P / 1e9), textcoords="offset points", xytext=(-8, -4),
                color="red", ha="right")
    n_flat = 0
    for op in ops:
        y = op.achieved if op.achieved is not None else attainable(op.intensity, P, Bw)
        ax.scatter([op.intensity], [y / 1e9], s=50, zorder=6)
        if y >= P * 0.999:  # on the flat roof: stagger the labels above it
            n_flat += 1
            offset, ha = (0, 6 + 12 * (n_flat - 1)), "center"
        else:
            offset, ha = (6, -4), "left"
        ax.annotate(f"{op.name} ({op.intensity:.3g}, {y / 1e9:.3g})", (op.intensity, y / 1e9),
                    textcoords="offset points", xytext=offset, fontsize=8, ha=ha)
    ax.set_ylim(top=P / 1e9 * 8)
    ax.set_xlabel("Arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("Attainable performance (GFLOP/s)")
    ax.set_title(title or "Roofline")
    ax.grid(True, which="both", ls="--", alpha=0.5)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
