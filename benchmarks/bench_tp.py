"""Tensor or pipeline parallelism on this machine: one process with 2 torch threads against TP=2
or PP=2 with one thread per rank or stage (gloo, the mp executor), on the ~100M benchmark Llama
(issue 14's benchmark; `--split pp` issue 37's).

Rows: single-stream decode (one request, a 128-token prompt, 128 output tokens) and the mixed
workload of benchmarks/bench_engine.py (64 requests, prompts U[32,256], outputs U[16,256]), output
tokens/s with the prefill included. Each measurement is a fresh subprocess; the two layouts
alternate, the order flipping each repeat; figures are medians.

What TP can buy, by seed 001's ceiling: decode streams every weight once per step, so with each
rank streaming half the weights over its own memory channel a step could take half the time --
when each rank has its own memory bandwidth (a GPU each). Two cores of one CPU share one memory
system, and every layer adds two all-reduces through the loopback (gloo), so here TP=2 can at
best match TP=1; the benchmark measures the cost of the collectives.

Pipeline parallelism runs one step at a time through the stages (kvserve/distributed/pipeline.py),
cut into M micro-batches (--pipeline-micro-batches; by default 1 on the CPU) that flow through
the stages at once; each stage idles (P - 1) / (M + P - 1) of its time: with M = 1 the stages take
turns (at best one single-thread process's throughput), with M = 2 a third of the time idles
(4/3 of it). Single-stream decode is one micro-batch whatever M. But a decode step reads
every weight once per micro-batch, and two processes on one CPU share its memory system, so M = 2
doubles the traffic that bounds decode. Layouts: one process, PP=2 with M = 1, PP=2 with M = 2.

    python benchmarks/bench_tp.py --repeats 3 --out benchmarks/results/tp.json
    python benchmarks/bench_tp.py --split pp --repeats 3 --out benchmarks/results/pp.json
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
sys.path.insert(0, str(HERE))
from common import bench_model_dir, make_workload, model_vocab_size  # noqa: E402

LAYOUTS = {"tp": ("one", "tp=2"), "pp": ("one", "pp=2 M=1", "pp=2 M=2")}     # M: micro-batches a step


def layout_kwargs(layout: str) -> dict:
    if layout == "one":
        return {}
    if layout.startswith("tp"):
        return {"tensor_parallel_size": 2}
    return {"pipeline_parallel_size": 2, "pipeline_micro_batches": int(layout.split("M=")[1])}


def one(model: Path, dtype: str, layout: str, row: str, threads: int) -> None:
    """The child: one timed run, printed as JSON."""
    import torch

    from common import run_kvserve
    from kvserve import LLM

    if layout == "one":
        torch.set_num_threads(threads)
    vocab = model_vocab_size(model)
    llm = LLM(str(model), dtype=dtype, max_num_seqs=64, enable_prefix_caching=False, **layout_kwargs(layout))
    work = (make_workload(1, (128, 128), (128, 128), vocab, seed=7) if row == "single"
            else make_workload(64, (32, 256), (16, 256), vocab, seed=0))
    run_kvserve(llm.engine, make_workload(2, (16, 16), (4, 4), vocab, seed=99), "warmup")
    r = run_kvserve(llm.engine, work, row)
    llm.engine.shutdown()
    print(json.dumps({"tok_s": r["tok_s"]}))


def measure(model: Path, dtype: str, layout: str, row: str, threads: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--one", layout, row, "--dtype", dtype,
                          "--baseline-threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--split", choices=("tp", "pp"), default="tp", help="tensor or pipeline parallelism")
    ap.add_argument("--baseline-threads", type=int, default=2,
                    help="torch threads of the one process (1: the throughput a bubble-free PP=2 would double)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="single,mixed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", nargs=2, metavar=("LAYOUT", "ROW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = bench_model_dir()
    if args.one:
        return one(model, args.dtype, args.one[0], args.one[1], args.baseline_threads)
    import torch

    layouts = LAYOUTS[args.split]
    runs: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for row in args.rows.split(","):
            shift = rep % len(layouts)                   # the order rotates each repeat
            for layout in layouts[shift:] + layouts[:shift]:
                v = measure(model, args.dtype, layout, row, args.baseline_threads)
                runs.setdefault(f"{row} {layout}", []).append(v)
                print(f"[{rep}] {row:6s} {layout}: {v:.1f} tok/s", flush=True)
    print(f"\nmedians of {args.repeats} ({model.name}, {args.dtype}, {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {os.getloadavg()[0]:.2f}); one process runs {args.baseline_threads} threads, "
          "the others one per process")
    head = " | ".join(f"{x} tok/s" for x in layouts) + " | " + " | ".join(f"{x} / one" for x in layouts[1:])
    print(f"| row | {head} |")
    print("|---" * (2 * len(layouts)) + "|")
    for row in args.rows.split(","):
        med = [statistics.median(runs[f"{row} {x}"]) for x in layouts]
        print(f"| {row} | " + " | ".join(f"{v:.1f}" for v in med) + " | "
              + " | ".join(f"{v / med[0]:.2f}" for v in med[1:]) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
