"""2 data-parallel replicas behind `kvserve router` vs 1 engine, on a multi-turn chat trace with
shared system prompts (issue 14 part 3; seed 003's chat trace, "Radix trees": a prefix-aware
router; Mooncake's cache-centric scheduling).

    python benchmarks/bench_router.py [--conversations 48] [--concurrency 8] [--repeats 2]
                                        [--out benchmarks/results/router.md]

The trace (seed 003's shape, scaled down to minutes on 2 CPU cores): `--conversations` chats, each
opening with one of 2 system prompts (300-600 tokens), 2-4 turns of a user message (20-60 tokens)
and a generated answer (16-32 tokens, ignore_eos), each turn resending the whole history through
/v1/chat/completions (streamed). A closed loop keeps `--concurrency` conversations in flight.

Configurations, each run with a `cache_salt` of its own so that no run hits another's blocks:
  1 engine         one `kvserve serve` (1 torch thread), clients talk to it directly
  1 engine, 2 thr. the same with 2 torch threads (both cores for one engine)
  1 engine behind the router: the 1-thread engine through `kvserve router` (the router's own cost)
  2 x cache-aware  two replicas (1 torch thread each) behind `kvserve router --policy cache-aware`
  2 x round-robin  the same replicas, `--policy round-robin`
  2 x least-loaded the same replicas, `--policy least-loaded`

Reported: requests/s, output tokens/s, TTFT p50/p99 (first content chunk, seen by the client),
the replicas' own prefix hit rate (kvserve:prefix_cache_hits_total / queries_total, in tokens),
the router's routing hit rate, and how often a follow-up turn landed on its conversation's replica.

Each figure is the median over `--repeats` passes (configurations interleaved; req/s also as
min-max), every pass with a cache_salt of its own.

What a 2-core machine cannot show: data parallelism buys throughput by adding hardware, and here
the two replicas, the router and the client share the same two cores (with other work), so
"2 replicas" cannot beat "1 engine" on req/s or TTFT; those columns measure contention and the
router's extra hop (compare "1 engine" with "1 engine behind the router"), not scaling. The
prefix hit rates do not depend on the hardware: they are what the routing policy preserves of
the single engine's hit rate when the cache is split over replicas. On N GPUs, each replica a
whole engine on its own device, throughput scales up to N x while each replica's KV cache holds
only the conversations routed to it: that is when cache-aware routing keeps the 1-engine hit
rate and round-robin spends prefill compute on prefixes another replica already holds.

The model is a random-weight Llama (2 layers, hidden 64, 4,096 positions) with stories260K's
tokenizer: hit rates do not depend on the weights; times are those of a tiny model on a shared
2-core machine, where the router, both replicas and the client compete for the same two cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.fleet.launcher import LocalReplicas, free_port, stop_server, wait_healthy  # noqa: E402

STORIES_HF = ROOT.parent / "shared" / "models" / "stories260K-hf"
MODEL_DIR = Path(tempfile.gettempdir()) / "kvserve-bench-router-llama"
WORDS = ("the a little big dog cat bird sun tree park ball happy sad red blue green play run jump "
         "mom dad friend home school fish cake boat rain snow star moon hill river girl boy").split()


def build_model() -> Path:
    if (MODEL_DIR / "model.safetensors").exists():
        return MODEL_DIR
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.15)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(MODEL_DIR, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_HF / name, MODEL_DIR / name)
    return MODEL_DIR


def trace(n_conv: int, seed: int = 0) -> list[tuple[str, list[tuple[str, int]]]]:
    """(system prompt, [(user message, answer tokens)]) per conversation; ~2.5 chars per token."""
    rng = random.Random(seed)
    text = lambda n_tokens: " ".join(rng.choice(WORDS) for _ in range(int(n_tokens * 2.5 / 4.5)))  # noqa: E731
    systems = [f"System {i}. " + text(rng.randint(300, 600)) for i in range(2)]
    return [(rng.choice(systems), [(text(rng.randint(20, 60)), rng.randint(16, 32))
                                   for _ in range(rng.randint(2, 4))]) for _ in range(n_conv)]


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            name = k.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(v)
    return out


def prefix_tokens(urls: list[str]) -> tuple[float, float]:
    ms = [scrape(u) for u in urls]
    return (sum(m.get("kvserve:prefix_cache_hits_total", 0.0) for m in ms),
            sum(m.get("kvserve:prefix_cache_queries_total", 0.0) for m in ms))


async def run_trace(url: str, convs, concurrency: int, salt: str, model: str) -> dict:
    queue = list(enumerate(convs))
    ttfts, out_tokens, sticky = [], [0], [0, 0]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        async def one_turn(msgs, max_tokens):
            body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "cache_salt": salt,
                    "stream_options": {"include_usage": True}}
            t0, first, text, replica = time.perf_counter(), None, "", None
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                replica = r.headers.get("x-kvserve-replica")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        out_tokens[0] += obj["usage"]["completion_tokens"]
                    for ch in obj["choices"]:
                        if first is None and ch["delta"].get("content") is not None:
                            first = time.perf_counter()
                        text += ch["delta"].get("content") or ""
            ttfts.append((first or time.perf_counter()) - t0)
            return text, replica

        async def worker():
            while queue:
                _, (system, turns) = queue.pop(0)
                msgs, home = [{"role": "system", "content": system}], None
                for user, n in turns:
                    msgs.append({"role": "user", "content": user})
                    answer, replica = await one_turn(msgs, n)
                    msgs.append({"role": "assistant", "content": answer})
                    if home is None:
                        home = replica
                    else:
                        sticky[0] += replica == home
                        sticky[1] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts.sort()
    return {"requests": len(ttfts), "wall_s": wall, "req_per_s": len(ttfts) / wall,
            "out_tok_per_s": out_tokens[0] / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "sticky": sticky[0] / sticky[1] if sticky[1] else float("nan")}


def start_router(backends: list[str], policy: str, model: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "router", "--backends", ",".join(backends), "--model",
           str(model), "--policy", policy, "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([url], lambda i: proc.poll() is None, timeout=60)
    return proc, url


def run_config(label, policy, backends, model, convs, concurrency, salt, name) -> dict:
    """One pass of the trace against `backends`, directly (policy None) or through a new router."""
    router, url = None, backends[0]
    if policy is not None:
        router, url = start_router(backends, policy, model)
    try:
        h0, q0 = prefix_tokens(backends)
        res = asyncio.run(run_trace(url, convs, concurrency, salt, name))
        h1, q1 = prefix_tokens(backends)
        res["engine_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")
        res["routing_hit_rate"] = (json.loads(httpx.get(url + "/router/replicas", trust_env=False).text)
                                   ["prefix_hit_rate"] if router else float("nan"))
    finally:
        if router is not None:
            stop_server(router)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="passes over every configuration")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    model = build_model()
    convs = trace(args.conversations)
    flags = ["--model", str(model), "--log-level", "warning", "--max-model-len", "4096"]
    single = LocalReplicas(1, flags + ["--engine-threads", "1"], env={"OMP_NUM_THREADS": "1"})
    single2 = LocalReplicas(1, flags + ["--engine-threads", "2"], env={"OMP_NUM_THREADS": "2"})
    pair = LocalReplicas(2, flags + ["--engine-threads", "1"], env={"OMP_NUM_THREADS": "1"})
    rows: dict[str, list[dict]] = {}
    try:
        for s in (single, single2, pair):
            s.wait_healthy()
        name = json.loads(httpx.get(single.urls[0] + "/v1/models", trust_env=False).text)["data"][0]["id"]
        for u in single.urls + single2.urls + pair.urls:       # warm up every server (first requests are slow)
            asyncio.run(run_trace(u, trace(args.concurrency, seed=1), args.concurrency, "warm-up", name))
        configs = [("1 engine", None, single.urls), ("1 engine, 2 threads", None, single2.urls),
                   ("1 engine behind the router", "cache-aware", single.urls),
                   ("2 x cache-aware", "cache-aware", pair.urls),
                   ("2 x round-robin", "round-robin", pair.urls), ("2 x least-loaded", "least-loaded", pair.urls)]
        for rep in range(args.repeats):         # configurations interleaved, so drift hits all alike
            for label, policy, backends in configs:
                res = run_config(label, policy, backends, model, convs, args.concurrency, f"run{rep}-{label}", name)
                rows.setdefault(label, []).append(res)
                print(label, json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
    finally:
        for s in (single, single2, pair):
            s.stop()
    head = ("| configuration | requests | req/s (median, min-max) | output tok/s | TTFT p50 ms | TTFT p99 ms | "
            "engine prefix hit rate | routing hit rate | follow-ups on their replica |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    for label, runs in rows.items():
        routing = "-" if runs[0]["routing_hit_rate"] != runs[0]["routing_hit_rate"] else \
            f"{med(runs, 'routing_hit_rate'):.1%}"
        sticky = "-" if label.startswith("1 engine") and "router" not in label else f"{med(runs, 'sticky'):.0%}"
        rps = [r["req_per_s"] for r in runs]
        lines.append(f"| {label} | {sum(r['requests'] for r in runs)} | {med(runs, 'req_per_s'):.1f} "
                     f"({min(rps):.1f}-{max(rps):.1f}) | {med(runs, 'out_tok_per_s'):.0f} | "
                     f"{med(runs, 'ttft_p50_ms'):.0f} | {med(runs, 'ttft_p99_ms'):.0f} | "
                     f"{med(runs, 'engine_hit_rate'):.1%} | {routing} | {sticky} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        title = " ".join(__doc__.split("\n\n")[0].split())
        Path(args.out).write_text(f"{title}\n\nLoad average at the start and end of the run (2 cores): "
                                  f"{load0:.1f}, {os.getloadavg()[0]:.1f}.\n\n`python benchmarks/bench_router.py "
                                  f"--conversations {args.conversations} --concurrency {args.concurrency} "
                                  f"--repeats {args.repeats}`\n\n"
                                  f"{table}\n\n" + __doc__[__doc__.index("What a 2-core"):
                                                             __doc__.index("The model is")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
