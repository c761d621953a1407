"""OpenMP's wait policy and the engine's step when another process shares the cores.

`kvserve serve` runs the engine core beside the API process on the same cores; on this 2-core
machine every token streamed costs the API process a little CPU. torch's OpenMP threads spin
while they wait for each other (libgomp's default): when one of the two is descheduled, the
other spins and every parallel region waits a scheduler slice. `OMP_WAIT_POLICY=PASSIVE` makes
waiting threads sleep at once; `GOMP_SPINCOUNT=20000` spins a little, then sleeps. This
measures the engine's decode step (batch 1, 8, 32) and a 512-token prefill step on the ~100M
benchmark Llama in bf16, with 2 threads under each policy and with 1 thread, alone and beside a
competitor that works half the time (2 ms busy, 2 ms asleep, as an API process streaming tokens
does). Each cell is a fresh process; cells alternate over repeats; figures are medians of ms
per step.

    python benchmarks/bench_omp_wait.py --repeats 3 --out benchmarks/results/omp_wait.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model_dir  # noqa: E402

CELLS = [("2 threads", 2, {}), ("2 threads PASSIVE", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
         ("2 threads spin 20k", 2, {"GOMP_SPINCOUNT": "20000"}), ("1 thread", 1, {})]
COMPETITOR = "import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.002: pass\n    time.sleep(0.002)\n"


def one(model: Path, threads: int) -> dict:
    """The child: ms per step for each shape."""
    import torch

    from kvserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(model), dtype="bfloat16", enable_prefix_caching=False, max_model_len=1024, max_num_seqs=64)
    eng = llm.engine
    out = {}
    for batch in (1, 8, 32):
        for b in range(batch):
            eng.add_request(f"b{batch}-{b}", {"prompt_token_ids": [5 + b] * 64},
                            SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(5):
            eng.step()
        t, n = time.perf_counter(), 30
        for _ in range(n):
            eng.step()
        out[f"decode b{batch}"] = 1e3 * (time.perf_counter() - t) / n
        while eng.has_unfinished_requests():
            eng.step()
    eng.add_request("prefill", {"prompt_token_ids": [7] * 512}, SamplingParams(max_tokens=1))
    t = time.perf_counter()
    eng.step()
    out["prefill 512"] = 1e3 * (time.perf_counter() - t)
    return out


def measure(threads: int, omp_env: dict, competitor: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(omp_env)
    comp = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if competitor else None
    try:
        r = subprocess.run([sys.executable, __file__, "--one", str(threads)], env=env, check=True,
                           capture_output=True, text=True)
    finally:
        if comp is not None:
            comp.kill()
            comp.wait()
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = bench_model_dir()
    if args.one:
        print(json.dumps(one(model, args.one)))
        return
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        order = [(c, comp) for comp in (False, True) for c in CELLS]
        for (name, threads, omp_env), comp in (order if rep % 2 == 0 else order[::-1]):
            key = f"{name}{' + competitor' if comp else ''}"
            r = measure(threads, omp_env, comp)
            runs.setdefault(key, []).append(r)
            print(f"[{rep}] {key:32s} " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    shapes = list(next(iter(runs.values()))[0])
    print(f"\nms per step, medians of {args.repeats} ({model.name}, bf16)")
    print("| cell | " + " | ".join(shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for key, rs in runs.items():
        print(f"| {key} | " + " | ".join(f"{statistics.median(r[s] for r in rs):.1f}" for s in shapes) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
