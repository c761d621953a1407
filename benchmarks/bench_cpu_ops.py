"""kvserve's CPU row and attention ops against the torch formulas they replace, at the shapes of
SmolLM2-135M served at 64 streams (issue 33), and optionally one kvserve tree against another.

- `decode_attention`: 64 sequences x 200 tokens of context, 30 layers (9 query heads on 3 KV heads
  of dim 64, blocks of 16 scattered at random over a bfloat16 and a float32 cache), against the
  portable backend's batched matmuls over gathered blocks (`TorchPagedAttention._decode`).
- `draw_rows`: a token from each of 64 rows of [64, 49,152] logits at temperature 1, against the
  torch path (softmax, then `draw_at`'s inverse CDF).
- `linear_bf16` (kvserve's AMX tiles where the CPU has them): every GEMM of a SmolLM2 decode step
  at 16 and 64 rows (30 layers of qkv, o, gate_up and down, and the 49,152-row lm_head: 269 MB of
  bfloat16 weights, read from memory), against torch's bfloat16 GEMM (`torch.mm`).
- `rms_norm_bf16` and `silu_mul` on 2,048 bfloat16 rows (a 2,048-token prefill step), against
  torch's ops (`F.rms_norm` in float32 around conversions; `F.silu(gate) * up`).

Each figure is the median of interleaved timings (kvserve's op, then torch's, `--repeats` times).
With `--baseline-tree`, each tree runs the kvserve ops in its own subprocess, alternating.

    python benchmarks/bench_cpu_ops.py [--baseline-tree /tmp/kvserve-base] [--repeats 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from common import run_in_tree

CHILD = r"""
import json, statistics, time, torch
import torch.nn.functional as F
from kvserve import kernels
from kvserve.sample.sampler import draw_at
if not kernels.load():
    raise SystemExit("kvserve's kernels are not built here")
torch.set_num_threads({threads})
g = torch.Generator().manual_seed(0)

def timed(fn, calls):
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3                      # ms a call

def attention_case(dtype, B=64, ctx=200, layers=30, KV=3, H=9, D=64, bs=16):
    nb = (ctx + bs - 1) // bs
    NB = B * nb + 1
    caches = [(torch.randn(NB, KV, bs, D, generator=g).to(dtype), torch.randn(NB, KV, bs, D, generator=g).to(dtype))
              for _ in range(layers)]
    tables = (torch.randperm(NB - 1, generator=g)[:B * nb] + 1).view(B, nb)
    lens = torch.full((B,), ctx, dtype=torch.long)
    q = torch.randn(B, H, D, generator=g)
    def ours():
        for k, v in caches:
            torch.ops.kvserve.decode_attention(q, k, v, None, None, tables, lens, D ** -0.5, 0)
    from kvserve.attention.torch_paged import TorchPagedAttention
    from kvserve.attention.metadata import AttentionMetadata
    backend = TorchPagedAttention.__new__(TorchPagedAttention)
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.block_size = H, KV, D, bs
    backend.scale, backend.softcap, backend.sliding_window, backend.per_layer = D ** -0.5, None, None, False
    mask = (torch.arange(nb * bs) < ctx).view(1, 1, 1, -1).expand(B, 1, 1, -1)
    class Meta:
        decode_block_tables, decode_key_mask = tables, mask
    qd = q.to(dtype)
    def theirs():
        for k, v in caches:
            backend._decode(qd, k, v, Meta)
    return ours, theirs, 1

def gemm_case(T):
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    ws = [torch.randn(N, K, generator=g).bfloat16() for _ in range(30) for N, K in shapes]
    ws.append(torch.randn(49152, 576, generator=g).bfloat16())
    xs = {{K: torch.randn(T, K, generator=g) for K in (576, 1536)}}
    xb = {{K: x.bfloat16() for K, x in xs.items()}}
    def ours():
        for w in ws:
            torch.ops.kvserve.linear_bf16(xs[w.shape[1]], w)
    def theirs():
        for w in ws:
            torch.mm(xb[w.shape[1]], w.t())
    return ours, theirs, 1

def draw_case(R=64, V=49152):
    x = torch.randn(R, V, generator=g) * 3
    u = torch.rand(R, generator=g)
    rows = torch.arange(R)
    return (lambda: torch.ops.kvserve.draw_rows(x, rows, u)), \
           (lambda: draw_at(torch.softmax(x, dim=-1), u.view(-1, 1))), 20

def rms_case(T=2048, E=576):
    x = torch.randn(T, E, generator=g).bfloat16()
    w = torch.randn(E, generator=g).bfloat16()
    return (lambda: torch.ops.kvserve.rms_norm_bf16(x, w, 1e-5)), \
           (lambda: w * F.rms_norm(x.float(), (E,), None, 1e-5).to(x.dtype)), 20

def silu_case(T=2048, I=1536):
    gu = torch.randn(T, 2 * I, generator=g).bfloat16()
    def theirs():
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up
    return (lambda: torch.ops.kvserve.silu_mul(gu)), theirs, 10

cases = {{"decode_attention bf16 cache": lambda: attention_case(torch.bfloat16),
         "decode_attention f32 cache": lambda: attention_case(torch.float32),
         "linear_bf16 step GEMMs, 16 rows": lambda: gemm_case(16),
         "linear_bf16 step GEMMs, 64 rows": lambda: gemm_case(64),
         "draw_rows 64 x 49152": draw_case, "rms_norm_bf16 2048 x 576": rms_case,
         "silu_mul 2048 x 2x1536": silu_case}}
out = {{"capability": torch.backends.cpu.get_cpu_capability(), "isa": kernels.isa(), "ops": {{}}}}
for name, make in cases.items():
    ours, theirs, calls = make()
    a, b = [], []
    for _ in range({repeats}):
        a.append(timed(ours, calls))
        if {with_torch}:
            b.append(timed(theirs, calls))
    out["ops"][name] = [statistics.median(a), statistics.median(b) if b else None]
print(json.dumps(out))
"""


def measure(tree: Path, args, with_torch: bool) -> dict:
    code = CHILD.format(threads=args.threads, repeats=args.repeats, with_torch=with_torch)
    return run_in_tree(tree, code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path("."))
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="tree/baseline alternations (with --baseline-tree)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    ours = measure(args.tree, args, with_torch=True)
    base = []
    if args.baseline_tree:
        tree_runs = [ours]
        for r in range(args.rounds):
            base.append(measure(args.baseline_tree, args, with_torch=False))
            tree_runs.append(measure(args.tree, args, with_torch=False))
        ops = {k: statistics.median(run["ops"][k][0] for run in tree_runs) for k in ours["ops"]}
    else:
        ops = {k: v[0] for k, v in ours["ops"].items()}
    load = f"{min(load, os.getloadavg()[0]):.1f}-{max(load, os.getloadavg()[0]):.1f}"
    print(f"capability {ours['capability']}, kvserve ISA {ours['isa']}, {args.threads} threads, load {load}; "
          f"ms a call, medians of {args.repeats} interleaved timings")
    head = f"{'op':32s} {'kvserve':>9s} {'torch':>9s} {'torch/kvs':>9s}"
    print(head + (f" {'baseline':>9s} {'base/tree':>9s}" if base else ""))
    for k, ms in ops.items():
        t = ours["ops"][k][1]
        line = f"{k:32s} {ms:9.2f} {t:9.2f} {t / ms:9.2f}"
        if base:
            b = statistics.median(run["ops"][k][0] for run in base)
            line += f" {b:9.2f} {b / ms:9.2f}"
        print(line)


if __name__ == "__main__":
    main()
