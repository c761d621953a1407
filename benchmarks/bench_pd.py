"""Collocated serving against disaggregated prefill/decode on this machine (issue 13's benchmark).

Collocated: one `kvserve serve` with 2 torch threads. Disaggregated: `kvserve serve --role
prefill` and `--role decode` with one thread each (one core per process), sharing a Redis KV
store, behind `kvserve proxy`. Both run the same model; `kvserve bench serve` sends the same
token-id prompts at the same Poisson rate to each, on two workloads: long prompts with short
answers, and short prompts with long answers. Reported: output tok/s, TTFT and ITL (p50 / p99),
and the proxy's mean prefill request time (the prompt computed and its KV written to the store).

    python benchmarks/bench_pd.py --out benchmarks/results/pd.md

`--streaming`: TTFT of a PD pair whose prompt KV goes layer by layer over TCP while the prefill
runs (`--kv-transfer stream`), against the same link carrying the whole prompt's KV once the
prefill ends (`--kv-stream-unit prompt`), for 512- and 4,096-token prompts; the link is limited
by a token bucket on the sender (`--kv-stream-rate`) so that the transfer matters. The default
model (SmolLM2-135M, 30 layers), one engine thread per server, one request at a time, the two
modes interleaved; reported: median TTFT, the proxy's prefill request time, and what is left on
TTFT past the prefill (TTFT - prefill) beside the decode's first step, the whole transfer's time
and one layer's share.

    python benchmarks/bench_pd.py --streaming --out benchmarks/results/pd_stream.md
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


def ttft_s(url: str, prompt: list[int]) -> float:
    """Seconds from the POST to the first streamed token of a one-request completion."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token came")


def streaming(args) -> list[str]:
    import random
    import statistics

    import torch

    from kvserve.config.default_model import default_model_path
    model = args.model or str(default_model_path())
    common = ["--engine-threads", "1", "--block-size", "16"]
    procs, lines = [], []
    try:
        dec, dec_url = server(model, args.dtype, 1, "--role", "decode", "--kv-transfer", "stream", *common[2:])
        procs.append(dec)
        proxies = {}
        for unit in ("layer", "prompt"):
            pre, pre_url = server(model, args.dtype, 1, "--role", "prefill", "--kv-transfer", "stream",
                                  "--kv-stream-unit", unit, "--kv-stream-rate", args.link, *common[2:])
            procs.append(pre)
            port = free_port()
            proxies[unit] = f"http://127.0.0.1:{port}"
            procs.append(start(["proxy", "--prefill", pre_url, "--decode", dec_url, "--model", model,
                                "--port", str(port), "--log-level", "warning", "--health-interval", "0.5"],
                               proxies[unit], {}))
        time.sleep(1.5)                          # the proxies learn the decode instance's stream address
        layers = num_layers(model)
        from kvserve.kv.tiers import parse_size
        rate = parse_size(args.link)
        rng = random.Random(0)
        rows = []
        load0 = os.getloadavg()[0]
        for n in args.prompt_lens:
            ttft = {u: [] for u in proxies}
            pre_t = {u: [] for u in proxies}
            first = {u: [] for u in proxies}
            for rep in range(args.repeats + 1):          # the first round warms up, not counted
                for unit, url in proxies.items():
                    prompt = [rng.randrange(1000, 30000) for _ in range(n)]    # no prefix hit anywhere
                    before, got = prefill_totals(url), streamed_bytes(dec_url)
                    t = ttft_s(url, prompt)
                    after = prefill_totals(url)
                    kv_bytes = streamed_bytes(dec_url) - got
                    # the decode's first step: the same prompt again, its blocks now in the decode's pool
                    step = ttft_s(dec_url, prompt)
                    if rep:
                        ttft[unit].append(t)
                        pre_t[unit].append(after[0] - before[0])
                        first[unit].append(step)
                    print(f"{n:5d} tokens  {unit:6s}  TTFT {t:.3f} s  prefill {after[0] - before[0]:.3f} s",
                          flush=True)
            whole = kv_bytes / rate                      # the prompt's KV over the link, measured bytes
            for unit in proxies:
                a, b = statistics.median(ttft[unit]), statistics.median(pre_t[unit])
                c = statistics.median(first[unit])
                label = "layer by layer (streamed)" if unit == "layer" else "whole prompt after the prefill"
                rows.append(f"| {n} | {label} | {a:.3f} | {b:.3f} | {a - b:.3f} | {c:.3f} | {kv_bytes / 2**20:.1f} | "
                            f"{whole:.3f} | {whole / layers:.3f} |")
            r = statistics.median(ttft["prompt"]) / statistics.median(ttft["layer"])
            rows.append(f"| {n} | whole / streamed TTFT | {r:.2f}x | | | | | | |")
        lines += [f"{Path(model).name}, {args.dtype}, {layers} layers; link {args.link}/s (a token bucket on the "
                  f"sender); 1 engine thread per server; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
                  f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at the end; {args.repeats} "
                  "interleaved repeats per row (medians)", "",
                  "| prompt | KV transfer | TTFT p50 s | prefill p50 s | left on TTFT (TTFT - prefill) s | decode's "
                  "first step s | KV MiB | whole transfer s | one layer's share s |", "|---|---|---|---|---|---|---|---|---|",
                  *rows, "", "prefill: the proxy's prefill request (the prompt computed on the prefill instance); "
                  "decode's first step: the same prompt sent again straight to the decode instance, its blocks "
                  "then in its pool (its TTFT there); whole transfer: the KV bytes the decode instance received "
                  "over the link's rate"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    return lines


def streamed_bytes(decode_url: str) -> float:
    """The decode instance's KV bytes received over streams so far."""
    for line in httpx.get(decode_url + "/metrics", trust_env=False).text.splitlines():
        if line.startswith("kvserve:kv_stream_bytes_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def num_layers(model: str) -> int:
    path = Path(model)
    if (path / "config.json").exists():
        return json.loads((path / "config.json").read_text())["num_hidden_layers"]
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    return int(r.fields[f"{arch}.block_count"].parts[-1][0])


def prefill_totals(proxy_url: str) -> tuple[float, float]:
    """(sum, count) of the proxy's prefill request times so far."""
    m = {}
    for line in httpx.get(proxy_url + "/metrics", trust_env=False).text.splitlines():
        if line.startswith("kvserve:proxy_prefill_time_seconds_"):
            k, _, v = line.rpartition(" ")
            m[k.split("{")[0]] = float(v)
    return m.get("kvserve:proxy_prefill_time_seconds_sum", 0.0), m.get("kvserve:proxy_prefill_time_seconds_count", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the ~100M benchmark Llama")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--streaming", action="store_true", help="layer-wise KV streaming against whole-prompt transfer")
    ap.add_argument("--link", default="20MB", help="--streaming: the link's rate per second (token bucket)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.streaming:
        lines = streaming(args)
        print("\n" + "\n".join(lines))
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return
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
