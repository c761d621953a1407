"""The int8 matmul paths of kvserve/model/quant/formats.py, per matrix and step size: the weight-only
kernel (`_weight_int8pack_mm`), the dequantize path (dequantize in row blocks + bf16 GEMM), W8A8
(`Int8Weight.linear` after `use_w8a8()`: activation quantization included, 128-row blocks) and,
for reference, the dense bfloat16 GEMM of an unquantized model, in microseconds (best of 5
timings of a loop), with the engine's 2 threads.

    python benchmarks/bench_int8_paths.py
    python benchmarks/bench_int8_paths.py --shapes 4096x768 --rows 128,2048
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.model.quant.formats import quantize


def best_us(f, seconds: float = 0.05) -> float:
    f()
    n = max(1, int(seconds / max(1e-6, _once(f))))
    return min(_loop(f, n) for _ in range(5)) * 1e6


def _once(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _loop(f, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3072x576,960x576,576x1536,4096x768",
                    help="N x K weights: SmolLM2's gate_up, qkv, down; the benchmark Llama's gate_up")
    ap.add_argument("--rows", default="1,8,16,32,64,256,2048")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"microseconds: weight-only kernel / dequantize + GEMM / W8A8 / dense bf16 (W8A8's speed-up over "
          f"the faster weight-only path; over dense bf16); {args.threads} threads")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
        kernel = quantize(w, "int8", None, torch.bfloat16)
        dequant = quantize(w, "int8", None, torch.bfloat16)
        dequant.kernel_max_rows = -1              # the dequantize path at every row count
        w8a8 = quantize(w, "int8", None, torch.bfloat16)
        w8a8.use_w8a8()
        w8a8.kernel_max_rows = -1                 # W8A8 at every row count, for the table
        dense = w.bfloat16()
        cells = []
        for r in rows:
            x = torch.randn(r, K).bfloat16()
            k = best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, kernel.q, kernel.scale))
            q = best_us(lambda: dequant.linear(x))
            a = best_us(lambda: w8a8.linear(x))
            d = best_us(lambda: F.linear(x, dense))
            cells.append(f"{r}: {k:.0f}/{q:.0f}/{a:.0f}/{d:.0f} ({min(k, q) / a:.2f}x; {d / a:.2f}x)")
        print(f"{N}x{K}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
