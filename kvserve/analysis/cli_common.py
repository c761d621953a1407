"""What `kvserve plan` and `kvserve simulate` subcommands share: plain-text tables and the
hardware / model arguments."""
from __future__ import annotations

import math

from .specs import HARDWARE, MODELS, HardwareSpec, get_hardware, get_model, measure_hardware

GB = 1e9


# -- formatting --------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1e5 or a < 1e-3:
            return f"{v:.3g}"
        if a >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if a < 1 else f"{v:.2f}"
    return str(v)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Plain-text table of dict rows (columns default to the first row's keys)."""
    if not rows:
        return "(no rows)"
    cols = columns or list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, width))
    return "\n".join([line(cols), line(["-" * w for w in width])] + [line(r) for r in cells])


def kv_table(pairs: list[tuple[str, object]]) -> str:
    w = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(w)}  {_fmt(v)}" for k, v in pairs)


# -- shared arguments ---------------------------------------------------------------------------------
def _add_hw(p, default="h100"):
    p.add_argument("--hw", default=default, help=f"hardware preset: {', '.join(HARDWARE)}")
    p.add_argument("--measure", action="store_true", help="measure this machine's bandwidth and matmul FLOP/s")
    p.add_argument("--dtype", default="bf16", help="weight / compute dtype (bf16, fp16, fp8, fp32, int4)")
    p.add_argument("--n-gpu", type=int, default=1, help="GPUs per replica (tensor parallel)")


def _add_model(p, default="llama-3.1-8b"):
    p.add_argument("--model", default=default,
                   help=f"model preset ({', '.join(MODELS)}) or a path to a HF config.json / model dir")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype")


def _hw(args) -> HardwareSpec:
    if getattr(args, "measure", False):
        hw = measure_hardware(dtype="fp32" if args.dtype not in ("fp32", "bf16", "fp16") else args.dtype)
        print(f"measured: {hw.name}: copy bandwidth {hw.bandwidth / GB:.1f} GB/s, "
              f"matmul {list(hw.flops.values())[0] / 1e9:.1f} GFLOP/s ({hw.note})")
        return HardwareSpec(hw.name, {args.dtype: list(hw.flops.values())[0]}, hw.bandwidth, hw.memory, hw.note)
    return get_hardware(args.hw)


def _step_model(args, hw=None):
    from .stepmodel import StepModel
    return StepModel(get_model(args.model), hw or _hw(args), args.n_gpu, args.dtype, args.kv_dtype,
                     mfu=args.mfu, t0=args.t0_ms / 1e3)
