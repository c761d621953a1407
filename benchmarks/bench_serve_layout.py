"""`kvserve serve` with the engine in its own process against the engine in a thread of the server,
and both against the offline engine (`LLM.generate`), on the same model and request shapes.

Issue 10's aims: the engine's step inside the server within 10% of the same step offline, and
the server's output throughput at rate inf at least 90% of the offline engine's. Per layout and
rate it reports the client's figures (`kvserve bench serve`: output tok/s, TTFT and ITL p50/p99)
and the server's own step and forward-pass times per step (from /metrics:
`kvserve:engine_step_time_seconds_total` and `kvserve:engine_forward_time_seconds_total` over
`kvserve:engine_steps_total`). Offline, `LLM.generate` runs all the requests at once (what rate
inf asks of a server) with the same prompt and output lengths and threads, after a warm-up
pass over other prompts of the same shapes. Layouts alternate, the order
flipping each repeat; every server and the offline run are fresh processes; figures are medians.

    python benchmarks/bench_serve_layout.py --repeats 3 --out benchmarks/results/serve_layout.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from common import bench_model_dir  # noqa: E402

from tests.server.live import free_port  # noqa: E402

STEP_METRICS = ("kvserve:engine_steps_total", "kvserve:engine_step_time_seconds_total",
                "kvserve:engine_forward_time_seconds_total")

OFFLINE = r"""
import json, random, sys, time
from kvserve import LLM, SamplingParams
model, dtype, n, inp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, dtype=dtype, max_num_seqs=max(n, 32))
rng = random.Random(0)
vocab = llm.engine.model_config.vocab_size
def make():
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(inp)]} for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
llm.generate(make(), params)        # warm up on other prompts: every batch shape seen once
prompts = make()
s0 = llm.engine.stats()
t = time.perf_counter()
outs = llm.generate(prompts, params)
wall = time.perf_counter() - t
s1 = llm.engine.stats()
steps = s1.num_steps - s0.num_steps
print(json.dumps({"output_throughput": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                  "step_ms": 1e3 * (s1.step_time_total - s0.step_time_total) / steps,
                  "forward_ms": 1e3 * (s1.forward_time_total - s0.forward_time_total) / steps,
                  "steps": steps}))
"""


def metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key.split("{", 1)[0]] = float(value)
    return out


def start_server(model: Path, dtype: str, layout: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--dtype", dtype,
           "--port", str(port), "--log-level", "warning", "--engine-layout", layout, "--max-num-seqs", "64"]
    if threads:
        cmd += ["--engine-threads", str(threads)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, NO_PROXY="*"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("kvserve serve did not become healthy")


def one_pass(url: str, model: Path, rate: str, args) -> dict:
    before = metrics(url)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url,
                        "--model", str(model), "--dataset-name", "random",
                        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                        "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
                        "--request-rate", rate, "--ignore-eos", "--disable-tqdm", "--seed", "0",
                        "--save-result", f.name], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, NO_PROXY="*"))
        s = next(iter(json.load(open(f.name))["runs"].values()))[0]
    after = metrics(url)
    d = {k: after[k] - before[k] for k in STEP_METRICS}
    steps = max(d[STEP_METRICS[0]], 1)
    return {"output_throughput": s["output_throughput"], "ttft_p50_ms": s["median_ttft_ms"],
            "ttft_p99_ms": s["p99_ttft_ms"], "itl_p50_ms": s["median_itl_ms"], "itl_p99_ms": s["p99_itl_ms"],
            "step_ms": 1e3 * d[STEP_METRICS[1]] / steps, "forward_ms": 1e3 * d[STEP_METRICS[2]] / steps,
            "failed": s["failed"]}


def offline(model: Path, args) -> dict:
    out = subprocess.run([sys.executable, "-c", OFFLINE, str(model), args.dtype, str(args.num_prompts),
                          str(args.input_len), str(args.output_len)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: the ~100M benchmark Llama)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="1,inf")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-threads", type=int, default=None)
    ap.add_argument("--layouts", default="process,thread",
                    help="comma-separated: process | thread, optionally :N engine threads (process:1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = Path(args.model) if args.model else bench_model_dir()
    rates = args.rates.split(",")
    layouts = args.layouts.split(",")         # "process", "process:1" (1 engine thread), "thread"
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for layout in (layouts if rep % 2 == 0 else layouts[::-1]):
            name, _, threads = layout.partition(":")
            proc, url = start_server(model, args.dtype, name, int(threads) if threads else args.engine_threads)
            try:
                one_pass(url, model, "inf", argparse.Namespace(**{**vars(args), "num_prompts": 4}))  # warm up
                for rate in rates:
                    r = one_pass(url, model, rate, args)
                    runs.setdefault(f"{layout} rate={rate}", []).append(r)
                    print(f"[{rep}] {layout:7s} rate={rate:4s} {json.dumps({k: round(v, 1) for k, v in r.items()})}",
                          flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
        r = offline(model, args)
        runs.setdefault("offline", []).append(r)
        print(f"[{rep}] offline  {json.dumps({k: round(v, 1) for k, v in r.items()})}", flush=True)
    table = {k: median_of(v) for k, v in runs.items()}
    off = table["offline"]
    print(f"\nmedians of {args.repeats} ({model.name}, {args.dtype}, {args.num_prompts} x {args.input_len} "
          f"in / {args.output_len} out)")
    print("| run | out tok/s | vs offline | TTFT p50/p99 ms | ITL p50/p99 ms | step ms | forward ms |")
    print("|---|---|---|---|---|---|---|")
    for k, v in table.items():
        ratio = v["output_throughput"] / off["output_throughput"]
        lat = (f"{v['ttft_p50_ms']:.0f} / {v['ttft_p99_ms']:.0f} | {v['itl_p50_ms']:.1f} / {v['itl_p99_ms']:.1f}"
               if "ttft_p50_ms" in v else "- | -")
        print(f"| {k} | {v['output_throughput']:.1f} | {ratio:.2f} | {lat} | {v['step_ms']:.1f} | "
              f"{v['forward_ms']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "medians": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
