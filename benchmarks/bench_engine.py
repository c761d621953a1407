"""Issue 2's engine benchmark: kvserve against `transformers` on the same ~100M random Llama,
in one process, each figure printed beside its baseline from the same run.

    python benchmarks/bench_engine.py [--repeats 3] [--dtypes bfloat16 float32] [--quick] [--out results/engine.json]

Rows (output tokens/s, prefill included): the mixed workload (64 requests, prompts U[32,256],
outputs U[16,256]) against transformers `generate` in padded static batches of 32; single-stream
decode (prompt 128, 128 new tokens) and its ceiling (weight bytes per step / measured copy
bandwidth); decode at batch 8 and 32. Both sides get the identical requests (token ids, output
lengths, ignore_eos). Every repeat draws fresh random prompts (seed 1000 * row + repeat; the
mixed workload's first repeat is seed 0) and warm-ups use other seeds, so no prompt shares a
prefix with an earlier one. The kvserve rows run with prefix caching off; prefix caching on vs
off is one more side of the mixed row (a 0% hit rate). Every kvserve run checks from
engine.stats() that it got no prefix-cache hit. Each repeat runs every row once and, within a
row, every side once (kvserve, transformers, caching on; the order rotates by repeat); a figure
is the median of the repeats, printed and saved with all its runs. Also kvserve's engine
overhead: step wall time outside the model's forward pass, and its share of the step.
`--quick` is a smoke run: a 2-layer width-64 model of the same vocabulary, shorter outputs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (TORCH_DTYPES, bench_model_dir, copy_bandwidth_gbs,  # noqa: E402
                               make_workload, model_vocab_size, run_kvserve, run_transformers,
                               summary, weight_bytes)
from kvserve import EngineConfig, LLMEngine  # noqa: E402

# name: (label, requests, prompt length range, output length range)
ROWS = {"mixed": ("mixed workload (64 req)", 64, (32, 256), (16, 256)),
        "single": ("single stream", 1, (128, 128), (128, 128)),
        "decode_b8": ("decode batch 8", 8, (128, 128), (128, 128)),
        "decode_b32": ("decode batch 32", 32, (128, 128), (128, 128))}
QUICK_ROWS = {"mixed": ("mixed workload (16 req)", 16, (32, 256), (16, 64)),
              "single": ("single stream", 1, (128, 128), (32, 32)),
              "decode_b8": ("decode batch 8", 8, (128, 128), (32, 32)),
              "decode_b32": ("decode batch 32", 32, (128, 128), (32, 32))}
WARM_SEED = 10 ** 6          # warm-up prompts: seeds no timed run uses
KV, HF, KV_ON = "kvserve", "transformers", "kvserve_prefix_cache_on"


def row_seed(row_index: int, repeat: int) -> int:
    return 1000 * row_index + repeat


def bench_dtype(model_dir: Path, dtype: str, rows: dict, repeats: int, skip_hf: bool) -> dict:
    """Every (row, side) run `repeats` times, interleaved; returns the runs and their medians."""
    vocab = model_vocab_size(model_dir)
    engines = {side: LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=64,
                                            enable_prefix_caching=side == KV_ON)) for side in (KV, KV_ON)}
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()

    def sides(name: str) -> list[str]:
        return [KV] + ([] if skip_hf else [HF]) + ([KV_ON] if name == "mixed" else [])

    def run(side: str, work, label: str) -> dict:
        return run_transformers(hf, work) if side == HF else run_kvserve(engines[side], work, label)

    for i, (name, (_, n, prompt_len, _)) in enumerate(rows.items()):   # warm every shape, 4 tokens
        warm = make_workload(n, prompt_len, (4, 4), vocab, WARM_SEED + i)
        for side in sides(name):
            run(side, warm, f"{dtype} {name} warm-up ({side})")
    runs: dict = {name: {side: [] for side in sides(name)} for name in rows}
    for r in range(repeats):
        for i, (name, (_, n, prompt_len, output_len)) in enumerate(rows.items()):
            work = make_workload(n, prompt_len, output_len, vocab, row_seed(i, r))
            order = sides(name)
            for side in order[r % len(order):] + order[:r % len(order)]:
                runs[name][side].append(run(side, work, f"{dtype} {name} repeat {r} ({side})"))
                print(f"  {dtype} repeat {r} {name:10s} {side:24s} {runs[name][side][-1]['tok_s']:8.1f} tok/s",
                      flush=True)
    del engines, hf
    gc.collect()

    res: dict = {}
    for i, (name, (label, n, prompt_len, output_len)) in enumerate(rows.items()):
        row = res[name] = {"label": label, "requests": n, "prompt_len": prompt_len, "output_len": output_len,
                           "seeds": [row_seed(i, r) for r in range(repeats)]}
        for side, side_runs in runs[name].items():
            row[side] = {key: summary([run_[key] for run_ in side_runs]) for key in side_runs[0]}
        if HF in row:
            row["ratio"] = row[KV]["tok_s"]["median"] / row[HF]["tok_s"]["median"]
        if KV_ON in row:
            row["prefix_cache_on_off"] = row[KV_ON]["tok_s"]["median"] / row[KV]["tok_s"]["median"]
    return res


def fmt_runs(s: dict) -> str:
    return " ".join(f"{x:.1f}" for x in s["runs"])


def report(dtype: str, res: dict, wbytes: int, ceiling: float, repeats: int) -> None:
    print(f"\n== {dtype}  (weights {wbytes / 1e6:.0f} MB, single-stream ceiling {ceiling:.0f} tok/s); "
          f"medians of {repeats} interleaved runs, then every run")
    print(f"{'output tok/s':26s}{'kvserve':>9s}{'transformers':>14s}{'ratio':>8s}   kvserve runs | transformers runs")
    for name, row in res.items():
        ours, theirs = row[KV]["tok_s"], row.get(HF, {}).get("tok_s")
        if theirs:
            print(f"{row['label']:26s}{ours['median']:9.1f}{theirs['median']:14.1f}{row['ratio']:7.2f}x"
                  f"   {fmt_runs(ours)} | {fmt_runs(theirs)}")
        else:
            print(f"{row['label']:26s}{ours['median']:9.1f}{'-':>14s}{'':8s}   {fmt_runs(ours)}")
    mixed = res["mixed"]
    on, off = mixed[KV_ON]["tok_s"], mixed[KV]["tok_s"]
    print(f"prefix caching, mixed workload at a 0% hit rate (0 hits checked): on {on['median']:.1f}, "
          f"off {off['median']:.1f} tok/s, on/off {mixed['prefix_cache_on_off']:.3f}   "
          f"on runs {fmt_runs(on)} | off runs {fmt_runs(off)}")
    def share(name: str, side: str = KV) -> float:
        return 100 * res[name][side]["overhead_share"]["median"]

    print(f"engine overhead (step time outside the forward pass, median): mixed {share('mixed'):.1f}% "
          f"of the step ({mixed[KV]['overhead_ms_per_step']['median']:.2f} ms/step; caching on "
          f"{share('mixed', KV_ON):.1f}%), decode batch 32 {share('decode_b32'):.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(TORCH_DTYPES))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per figure (median reported)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, short outputs (~1 min)")
    ap.add_argument("--skip-hf", action="store_true", help="kvserve figures only")
    ap.add_argument("--out", default=None, help="write the figures and every run as JSON here")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    t_start = time.perf_counter()
    model_dir = bench_model_dir(tiny=args.quick)
    rows = QUICK_ROWS if args.quick else ROWS
    bw = copy_bandwidth_gbs()
    out: dict = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                 "torch": torch.__version__, "model": str(model_dir), "quick": args.quick,
                 "repeats": args.repeats, "copy_bandwidth_GBps": bw, "load_avg_start": os.getloadavg(),
                 "results": {}}
    print(f"model {model_dir}  threads {torch.get_num_threads()}  copy bandwidth {bw:.1f} GB/s  "
          f"load average {os.getloadavg()[0]:.2f}")
    for dtype in args.dtypes:
        res = bench_dtype(model_dir, dtype, rows, args.repeats, args.skip_hf)
        wbytes = weight_bytes(model_dir, dtype)
        res["weight_bytes"], res["ceiling_tok_s"] = wbytes, bw * 1e9 / wbytes
        out["results"][dtype] = res
        report(dtype, {k: v for k, v in res.items() if k in rows}, wbytes, res["ceiling_tok_s"], args.repeats)
    out["load_avg_end"], out["wall_s"] = os.getloadavg(), time.perf_counter() - t_start
    print(f"\nwall time {out['wall_s']:.0f} s, load average at the end {out['load_avg_end'][0]:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
