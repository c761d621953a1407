"""The quantized-matmul paths of kvserve/model/quant/formats.py under each CPU capability, per matrix and
step size, in microseconds (best of 5 timed loops, 2 threads): the source of the table in
kvserve/model/quant/cpu_paths.py.

Each capability runs in a subprocess of its own with ATEN_CPU_CAPABILITY set, and with the BLAS
libraries capped to the same ISA, so that an AVX-512 host stands in for an older CPU as a whole:
  avx512_bf16  the host as it is (needs AVX-512 BF16)
  avx512       ATEN_CPU_CAPABILITY=avx512, ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI (no bf16 GEMMs)
  avx2         ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2
  default      ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=SSE41, MKL_ENABLE_INSTRUCTIONS=SSE4_2
(A real CPU of the older kind differs in memory bandwidth and cache sizes: the ratios between
paths carry over, the absolute figures do not.)

Paths, for SmolLM2-135M's matrices (gate_up 3072x576, qkv 960x576, down 576x1536):
  i4o         kvserve's int4 kernel (float32 activations; where it is built, the plan's int4
              kernel, and torch's only stands beside it for comparison)
  i4k / i8k   torch's int4 / int8 kernel (bfloat16 activations; `.f`: float32 activations, at
              up to 8 rows, the reason the kernels run in bfloat16)
  i4d / i8d   dequantize + GEMM, in bfloat16 and in float32 (`.b` / `.f`)
  w8a8        int8 activations and torch._int_mm (int8 only)
  dense       the unquantized matrix, bfloat16 and float32 GEMMs
and per capability the largest step (of the rows measured) at which each kernel still beats the
best dequantize path on every matrix, and the dequantize dtype that wins above it.

    python benchmarks/bench_cpu_paths.py
    python benchmarks/bench_cpu_paths.py --entries avx2 --rows 1,16,32,64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ENV = {
    "avx512_bf16": {},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
SHAPES = "3072x576,960x576,576x1536"


def best_us(f, seconds: float = 0.03) -> float:
    f()
    t = time.perf_counter()
    f()
    n = max(1, int(seconds / max(1e-6, time.perf_counter() - t)))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t) / n)
    return min(times) * 1e6


def measure(shapes: str, rows: list[int], threads: int) -> dict:
    """This process's capability: {shape: {rows: {path: us}}}."""
    import torch
    import torch.nn.functional as F

    from kvserve import kernels
    from kvserve.model.quant.formats import quantize

    torch.set_num_threads(threads)
    out: dict = {}
    for shape in shapes.split(","):
        N, K = map(int, shape.split("x"))
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
        i4, i8 = quantize(w, "int4", 32, torch.float32), quantize(w, "int8", None, torch.float32)
        packed = i4._torch_packed()                   # torch's kernel, measured beside kvserve's
        torch_scales = i4.scales.permute(2, 0, 1).contiguous()
        own = kernels.available()
        dense = {"b": w.bfloat16(), "f": w}
        cells: dict = {}
        for r in rows:
            x = torch.randn(r, K, generator=torch.Generator().manual_seed(r))
            xb = x.bfloat16()
            c = {"i4k": best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                     xb, packed, 32, torch_scales)),
                 "i8k": best_us(lambda: torch.ops.aten._weight_int8pack_mm(xb, i8.q, i8.scale))}
            if own:
                c["i4o"] = best_us(lambda: torch.ops.kvserve.linear_int4(x, i4.nibbles, i4.scales, 32))
            if r <= 8:
                c["i4k.f"] = best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, packed, 32, torch_scales.float()))
                c["i8k.f"] = best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, i8.q, i8.scale.float()))
            for d, dt in (("b", torch.bfloat16), ("f", torch.float32)):
                xd = x.to(dt)
                i4.dense_dtype = i8.dense_dtype = dt
                c[f"i4d.{d}"] = best_us(lambda: i4._dense(xd))
                c[f"i8d.{d}"] = best_us(lambda: i8._dense(xd))
                c[f"dense.{d}"] = best_us(lambda: F.linear(xd, dense[d]))
            if r > 1:
                c["w8a8"] = best_us(lambda: i8._w8a8(x))
            cells[r] = c
        out[shape] = cells
    return out


def crossovers(table: dict) -> dict:
    """Summed over the matrices (a layer holds each once): per kernel, the largest measured row
    count up to which it beats the better dequantize dtype (and every smaller count too); the
    dequantize dtype that wins at the largest step; and the smallest count above 1 from which
    W8A8 beats the best weight-only path."""
    rows = sorted(next(iter(table.values())))

    def total(path: str, r: int) -> float:
        return sum(c[r][path] for c in table.values())

    res = {}
    own = "i4o" in next(iter(table.values()))[rows[0]]
    for kind in ("i4", "i8"):
        best = -1
        kernel = "i4o" if kind == "i4" and own else f"{kind}k"   # the int4 kernel the plan runs
        for r in rows:
            if total(kernel, r) >= min(total(f"{kind}d.b", r), total(f"{kind}d.f", r)):
                break
            best = r
        big = rows[-1]
        res[kind] = {"kernel_max_rows": best,
                     "dense_dtype": "bfloat16" if total(f"{kind}d.b", big) < total(f"{kind}d.f", big) else "float32"}
    wins = [r for r in rows if r > 1 and total("w8a8", r) < min(total("i8k", r), total("i8d.b", r), total("i8d.f", r))]
    res["w8a8_faster_from_rows"] = wins[0] if wins else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default=",".join(ENV), help="capabilities to measure, in order")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write every figure as JSON")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(args.shapes, rows, args.threads)))
        return
    results = {}
    for entry in args.entries.split(","):
        env = {**os.environ, **ENV[entry]}
        probe = subprocess.run([sys.executable, "-c", "from kvserve.model.quant.cpu_paths import kernel_plan; "
                                "print(kernel_plan().name)"], env=env, capture_output=True, text=True)
        plan = probe.stdout.strip()
        if plan != entry:
            print(f"== {entry}: this host gives plan {plan!r} under that environment; skipped\n")
            continue
        rows_here = ",".join(str(r) for r in rows if entry != "default" or r <= 128)   # DEFAULT's kernels take seconds
        run = subprocess.run([sys.executable, __file__, "--child", "--shapes", args.shapes, "--rows", rows_here,
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{entry} failed:\n{run.stderr[-3000:]}")
        table = {shape: {int(r): c for r, c in cells.items()}
                 for shape, cells in json.loads(run.stdout.strip().splitlines()[-1]).items()}
        results[entry] = {"table": table, "crossovers": crossovers(table)}
        print(f"== {entry} ({' '.join(f'{k}={v}' for k, v in ENV[entry].items()) or 'the host as it is'}), "
              f"{args.threads} threads, microseconds")
        for shape, cells in table.items():
            print(f"  {shape}")
            for r, c in cells.items():
                print(f"    {r:>4} rows  " + "  ".join(f"{k} {v:.0f}" for k, v in c.items()))
        print(f"  crossovers: {results[entry]['crossovers']}\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_average": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
