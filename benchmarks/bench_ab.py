"""A/B of two kvserve source trees on the same workloads, on the same machine, in one run.

Each measurement is one subprocess that imports kvserve from tree A or tree B (PYTHONPATH) and
runs one row of `bench_engine.py`'s workloads (same model, same seeded fresh prompts, prefix
caching off); A and B alternate, the order flipping every repeat, and each side's figure is the
median of its runs. Use it to show that a change costs no speed:

    git worktree add /tmp/kvserve-base <commit>
    python benchmarks/bench_ab.py --a /tmp/kvserve-base --b . --dtype bfloat16 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = {  # name: (requests, prompt length range, output length range)
    "mixed": (64, (32, 256), (16, 256)),
    "single": (1, (128, 128), (128, 128)),
    "decode_b32": (32, (128, 128), (128, 128)),
}

CHILD = r"""
import json, sys, torch
sys.path.insert(0, {bench!r})
from common import bench_model_dir, make_workload, model_vocab_size, run_kvserve
from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
torch.set_num_threads({threads})
model = bench_model_dir()
n, p, o = {row}
engine = LLMEngine(EngineConfig(model=str(model), dtype={dtype!r}, enable_prefix_caching=False,
                                max_num_seqs=max(n, 8)))
vocab = model_vocab_size(model)
run_kvserve(engine, make_workload(min(n, 4), p, (4, 4), vocab, 10**6 + {seed}), "warm-up")
print(json.dumps(run_kvserve(engine, make_workload(n, p, o, vocab, {seed}), {name!r})))
"""


def measure(tree: Path, name: str, dtype: str, seed: int, threads: int) -> dict:
    code = CHILD.format(bench=str(HERE), threads=threads, row=ROWS[name], dtype=dtype, seed=seed, name=name)
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="baseline kvserve source tree")
    ap.add_argument("--b", default=".", help="candidate kvserve source tree")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every run as JSON")
    args = ap.parse_args()
    trees = {"A": Path(args.a), "B": Path(args.b)}
    runs: dict = {row: {"A": [], "B": []} for row in args.rows}
    for rep in range(args.repeats):
        for row in args.rows:
            for side in ("AB" if rep % 2 == 0 else "BA"):
                r = measure(trees[side], row, args.dtype, seed=100 * rep + args.rows.index(row),
                            threads=args.threads)
                runs[row][side].append(r)
                print(f"  repeat {rep} {row:11s} {side}  {r['tok_s']:8.1f} tok/s  "
                      f"overhead {100 * r['overhead_share']:.1f}%", flush=True)
    print(f"\n{args.dtype}: A = {args.a}, B = {args.b}; medians of {args.repeats} alternating runs")
    print(f"{'row':12s} {'A tok/s':>9s} {'B tok/s':>9s} {'B/A':>6s}  {'A overhead':>10s} {'B overhead':>10s}")
    for row in args.rows:
        med = {s: statistics.median(r["tok_s"] for r in runs[row][s]) for s in "AB"}
        ovh = {s: statistics.median(r["overhead_share"] for r in runs[row][s]) for s in "AB"}
        print(f"{row:12s} {med['A']:9.1f} {med['B']:9.1f} {med['B'] / med['A']:6.3f}  "
              f"{100 * ovh['A']:9.1f}% {100 * ovh['B']:9.1f}%")
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "a": args.a, "b": args.b, "runs": runs},
                                             indent=1))


if __name__ == "__main__":
    main()
