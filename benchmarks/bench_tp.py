"""Tensor parallelism on this machine: TP=1 with 2 torch threads against TP=2 with one thread per
rank (gloo, the mp executor), on the ~100M benchmark Llama (issue 14's benchmark).

Rows: single-stream decode (one request, a 128-token prompt, 128 output tokens) and the mixed
workload of benchmarks/bench_engine.py (64 requests, prompts U[32,256], outputs U[16,256]), output
tokens/s with the prefill included. Each measurement is a fresh subprocess; the two layouts
alternate, the order flipping each repeat; figures are medians.

What TP can buy, by seed 001's ceiling: decode streams every weight once per step, so with each
rank streaming half the weights over its own memory channel a step could take half the time --
when each rank has its own memory bandwidth (a GPU each). Two cores of one CPU share one memory
system, and every layer adds two all-reduces through the loopback (gloo), so here TP=2 can at
best match TP=1; the benchmark measures the cost of the collectives.

    python benchmarks/bench_tp.py --repeats 3 --out benchmarks/results/tp.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model_dir, make_workload, model_vocab_size  # noqa: E402

def one(model: Path, dtype: str, tp: int, row: str) -> None:
    """The child: one timed run, printed as JSON."""
    import torch

    from common import run_kvserve
    from kvserve import LLM

    if tp == 1:
        torch.set_num_threads(2)
    vocab = model_vocab_size(model)
    llm = LLM(str(model), dtype=dtype, tensor_parallel_size=tp, max_num_seqs=64, enable_prefix_caching=False)
    work = (make_workload(1, (128, 128), (128, 128), vocab, seed=7) if row == "single"
            else make_workload(64, (32, 256), (16, 256), vocab, seed=0))
    run_kvserve(llm.engine, make_workload(2, (16, 16), (4, 4), vocab, seed=99), "warmup")
    r = run_kvserve(llm.engine, work, row)
    llm.engine.shutdown()
    print(json.dumps({"tok_s": r["tok_s"]}))


def measure(model: Path, dtype: str, tp: int, row: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--one", str(tp), row, "--dtype", dtype],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="single,mixed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=2, metavar=("TP", "ROW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = bench_model_dir()
    if args.one:
        return one(model, args.dtype, int(args.one[0]), args.one[1])
    runs: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for row in args.rows.split(","):
            for tp in ((1, 2) if rep % 2 == 0 else (2, 1)):
                v = measure(model, args.dtype, tp, row)
                runs.setdefault(f"{row} tp={tp}", []).append(v)
                print(f"[{rep}] {row:6s} tp={tp}: {v:.1f} tok/s", flush=True)
    print(f"\nmedians of {args.repeats} ({model.name}, {args.dtype}); TP=1 runs 2 threads, TP=2 one per rank")
    print("| row | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 |")
    print("|---|---|---|---|")
    for row in args.rows.split(","):
        a, b = (statistics.median(runs[f"{row} tp={t}"]) for t in (1, 2))
        print(f"| {row} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
