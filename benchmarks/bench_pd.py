"""Collocated serving against disaggregated prefill/decode on this machine (issue 13's benchmark).

Collocated: one `kvserve serve` with 2 torch threads. Disaggregated: `kvserve serve --role
prefill` and `--role decode` with one thread each (one core per process), sharing a Redis KV
store, behind `kvserve proxy`. Both run the same model; `kvserve bench serve` sends the same
token-id prompts at the same Poisson rate to each, on two workloads: long prompts with short
answers, and short prompts with long answers. Reported: output tok/s, TTFT and ITL (p50 / p99),
and the proxy's mean prefill request time (the prompt computed and its KV written to the store).

    python benchmarks/bench_pd.py --out benchmarks/results/pd.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from kvserve.fleet.launcher import free_port  # noqa: E402

WORKLOADS = {"long prompt, short answer": (512, 16), "short prompt, long answer": (32, 128)}


def start(cmd: list[str], url: str, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *cmd], env=dict(os.environ, NO_PROXY="*", **env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:2]} exited")
        time.sleep(0.3)
    raise RuntimeError(f"{cmd[:2]} did not start")


def server(model: str, dtype: str, threads: int, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start(["serve", "--model", model, "--dtype", dtype, "--port", str(port), "--log-level", "warning",
                  "--engine-threads", str(threads), *flags], url, {}), url


def bench(url: str, model: str, inp: int, out: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url, "--model", model,
                        "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(out),
                        "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
                        "--request-rate", str(args.rate), "--ignore-eos", "--disable-tqdm", "--seed", "0",
                        "--save-result", f.name], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, NO_PROXY="*"))
        return next(iter(json.load(open(f.name))["runs"].values()))[0]


def prefill_mean_s(proxy_url: str) -> float:
    m = {}
    for line in httpx.get(proxy_url + "/metrics", trust_env=False).text.splitlines():
        if line.startswith("kvserve:proxy_prefill_time_seconds_"):
            k, _, v = line.rpartition(" ")
            m[k.split("{")[0]] = float(v)
    n = m.get("kvserve:proxy_prefill_time_seconds_count", 0)
    return m.get("kvserve:proxy_prefill_time_seconds_sum", 0) / n if n else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the ~100M benchmark Llama")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from common import bench_model_dir
        args.model = str(bench_model_dir())
    from tests.redis_live import redis_server

    rows = []
    with redis_server() as (redis_url, _):
        procs = []
        try:
            col, col_url = server(args.model, args.dtype, 2)
            procs.append(col)
            pre, pre_url = server(args.model, args.dtype, 1, "--role", "prefill", "--kv-tiers", redis_url)
            dec, dec_url = server(args.model, args.dtype, 1, "--role", "decode", "--kv-tiers", redis_url)
            procs += [pre, dec]
            port = free_port()
            proxy_url = f"http://127.0.0.1:{port}"
            procs.append(start(["proxy", "--prefill", pre_url, "--decode", dec_url, "--model", args.model,
                                "--port", str(port), "--log-level", "warning"], proxy_url, {}))
            for name, (inp, out) in WORKLOADS.items():
                for label, url in (("collocated", col_url), ("disaggregated", proxy_url)):
                    s = bench(url, args.model, inp, out, args)
                    rows.append((name, label, s))
                    print(f"{name:28s} {label:14s} out {s['output_throughput']:.1f} tok/s  TTFT "
                          f"{s['median_ttft_ms']:.0f}/{s['p99_ttft_ms']:.0f} ms  ITL {s['median_itl_ms']:.1f}/"
                          f"{s['p99_itl_ms']:.1f} ms", flush=True)
            mean_prefill = prefill_mean_s(proxy_url)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
    lines = [f"{Path(args.model).name}, {args.dtype}, {args.num_prompts} requests per row at {args.rate} req/s; "
             "collocated: 1 server, 2 threads; disaggregated: prefill + decode servers, 1 thread each, Redis store",
             "", "| workload | layout | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|"]
    for name, label, s in rows:
        lines.append(f"| {name} | {label} | {s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} / "
                     f"{s['p99_ttft_ms']:.0f} | {s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} |")
    lines += ["", f"proxy's mean prefill request (prompt computed, KV written to Redis): {1e3 * mean_prefill:.0f} ms"]
    print("\n" + "\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
