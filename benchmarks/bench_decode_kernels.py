"""kvserve's int4 kernel (`torch.ops.kvserve.linear_int4`: the int16 route for <= 3 rows, float
register blocks to 8, dequantized tiles above) against torch's int4 kernel on its packed copy (bf16 activations), on
SmolLM2-135M's matrices (group 32), by rows; the best of 5 interleaved timings of each.

    python benchmarks/bench_decode_kernels.py --threads 1 --rows 1,2,3,4,8,32
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kvserve import kernels
from kvserve.model.quant.formats import Int4Weight, quantize_int4

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head planes": (49152, 1152)}


def best_us(fn, calls: int = 40) -> float:
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,8,32")
    args = ap.parse_args()
    if not kernels.load():
        raise SystemExit("kvserve's kernels are not built here")
    torch.set_num_threads(args.threads)
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, kvserve ISA {kernels.isa()}, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'matrix':16s} {'rows':>4s} {'kvserve us':>11s} {'GB/s':>6s} {'torch us':>9s} {'ratio':>6s}")
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        q, s = quantize_int4(torch.randn(N, K, generator=g), 32, torch.bfloat16)
        w = Int4Weight(q, s, dtype=torch.float32)
        packed = w._torch_packed()                    # torch's kernel reads its own copy
        torch_scales = w.scales.permute(2, 0, 1).contiguous()
        read = w.nibbles.numel() + w.scales.numel() * 2
        for T in (int(r) for r in args.rows.split(",")):
            x = torch.randn(T, K, generator=g)
            xb = x.bfloat16()
            ours = best_us(lambda: torch.ops.kvserve.linear_int4(x, w.nibbles, w.scales, 32))
            theirs = best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, torch_scales))
            print(f"{name:16s} {T:4d} {ours:11.1f} {read / ours / 1e3:6.1f} {theirs:9.1f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()
