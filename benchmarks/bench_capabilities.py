"""The default model (SmolLM2-135M-Instruct Q4_1) under each CPU capability, in one run: kvserve
native against `quantization="dequant"` in bfloat16 and in float32, and llama.cpp built for the
same ISA, for single-stream decode, decode at batch 8 and 32, and a 128-token prefill (tokens/s).

Each kvserve measurement is a fresh subprocess under its capability's environment
(bench_cpu_paths.ENV: ATEN_CPU_CAPABILITY with the BLAS libraries capped to the same ISA), timed
as benchmarks/bench_llamacpp.py does (its KVSERVE_CHILD: 128-token prompt, 128 new tokens, the
prefill's time taken out). llama.cpp: `llama-bench` tg128 / pp128 and `llama-batched-bench`
from the build given for that capability (an AVX2 build: `-DGGML_NATIVE=OFF -DGGML_AVX512=OFF
-DGGML_AVX2=ON`). Repeats alternate every task, the order flipping each repeat; medians.

    python benchmarks/bench_capabilities.py --llama-cpp avx512_bf16=/tmp/llamacpp/build-native/bin \
        --llama-cpp avx2=/tmp/llamacpp/build-avx2/bin --repeats 3 --out benchmarks/results/capabilities.json
    git worktree add /tmp/kvserve-base <commit>      # native against an earlier tree, same run
    python benchmarks/bench_capabilities.py --entries avx512_bf16 --modes native --baseline-tree /tmp/kvserve-base
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


llamacpp = _module("bench_llamacpp")
paths = _module("bench_cpu_paths")
MODES = {"native": {}, "dequant_bf16": {"quantization": "dequant", "dtype": "bfloat16"},
         "dequant_f32": {"quantization": "dequant"}}
# DEFAULT has no SIMD in torch's own kernels: its bf16 GEMMs measured 2-14x float32's
# (bench_cpu_paths.py), a bf16 model there is not a configuration anyone should run, and timing it
# would take most of the run. (DEFAULT's native plan holds the weights in float32 already.)
SKIP = {("default", "dequant_bf16")}


def kvserve_run(entry: str, model: str, rep: int, batches: list[int], kwargs: dict,
                tree: str | None = None) -> dict:
    """One measurement in a fresh subprocess; `tree`: import kvserve from that source tree."""
    code = llamacpp.KVSERVE_CHILD.format(threads=llamacpp.THREADS, path=model, n=llamacpp.N, rep=rep,
                                         batches=batches, kwargs=kwargs)
    env = {**os.environ, **paths.ENV[entry], **({"PYTHONPATH": tree} if tree else {})}
    # `python -c` puts its working folder first on sys.path: run in the tree that is to be imported
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tree or HERE.parent)
    if out.returncode:
        raise RuntimeError(f"kvserve {entry} {kwargs} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_run(bindir: Path, model: str, batches: list[int]) -> dict:
    res = {"decode_tok_s": llamacpp.llama_bench(bindir, model, ["-p", "0", "-n", str(llamacpp.N)])["avg_ts"],
           "prefill_tok_s": llamacpp.llama_bench(bindir, model, ["-p", str(llamacpp.N), "-n", "0"])["avg_ts"]}
    if batches:
        res.update(llamacpp.llama_batched(bindir, model, batches))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="avx512_bf16,avx2,default")
    ap.add_argument("--llama-cpp", action="append", default=[], metavar="ENTRY=DIR",
                    help="a llama.cpp bin folder for a capability's row")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="also time native mode with kvserve imported from this source tree (a "
                         "`git worktree` of an earlier commit), alternating with the rest")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvserve.config.default_model import default_model_path
    model = args.gguf or default_model_path()
    batches = [int(b) for b in args.batches.split(",") if b]
    bins = dict(item.split("=", 1) for item in args.llama_cpp)
    tasks = {}
    for entry in args.entries.split(","):
        for mode in args.modes.split(","):
            if (entry, mode) in SKIP:
                continue
            tasks[(entry, mode)] = (lambda rep, e=entry, m=mode: kvserve_run(e, model, rep, batches, MODES[m]))
        if args.baseline_tree:
            tasks[(entry, "baseline")] = (lambda rep, e=entry: kvserve_run(e, model, rep, batches, {},
                                                                          args.baseline_tree))
        if entry in bins:
            tasks[(entry, "llama.cpp")] = (lambda rep, d=Path(bins[entry]): llama_run(d, model, batches))
    runs: dict = {k: [] for k in tasks}
    load = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        for key in (list(tasks) if rep % 2 == 0 else list(reversed(tasks))):
            runs[key].append(tasks[key](rep))
            r = runs[key][-1]
            print(f"  repeat {rep} {key[0]:12s} {key[1]:12s} " + "  ".join(
                f"{k.removesuffix('_tok_s')} {v:.1f}" for k, v in r.items() if k.endswith("tok_s")), flush=True)
        load.append(os.getloadavg()[0])
    cols = ["decode_tok_s", *(f"decode_b{b}_tok_s" for b in batches), "prefill_tok_s"]
    med = {f"{e}/{m}": {c: statistics.median(r[c] for r in runs[(e, m)]) for c in cols} for e, m in runs}
    print(f"\nmedians of {args.repeats}, tokens/s, 2 threads, load average {min(load):.1f}-{max(load):.1f}")
    print(f"{'capability':12s} {'engine':14s} " + " ".join(f"{c.removesuffix('_tok_s'):>12s}" for c in cols))
    for key, m in med.items():
        entry, mode = key.split("/")
        print(f"{entry:12s} {mode:14s} " + " ".join(f"{m[c]:12.1f}" for c in cols))
        for other in ("llama.cpp", "baseline"):
            if mode == "native" and f"{entry}/{other}" in med:
                ref = med[f"{entry}/{other}"]
                print(f"{'':12s} {'/ ' + other:14s} " + " ".join(f"{m[c] / ref[c]:11.2f}x" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model, "load_average": load, "medians": med,
                       "runs": {f"{e}/{m}": r for (e, m), r in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
