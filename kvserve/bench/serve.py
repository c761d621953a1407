"""`kvserve bench serve`: an online load generator for any OpenAI-compatible server.

It streams every request (SSE), timestamps every chunk, and reports the latency vocabulary of
seed 001 (TTFT, TPOT, ITL, E2E: mean, median, p50/p90/p99), request and token throughput,
goodput under SLOs, and errors -- the same figures, flags and text block as `vllm bench serve`,
so the two can be pointed at the same server and compared. Works against kvserve, vLLM, SGLang
and llama.cpp's server: it needs only `/v1/completions` (or `/v1/chat/completions`) with
`stream: true`.

Prompts: the random and prefix datasets send random token ids as the prompt (a list of ints,
which kvserve's, vLLM's and llama.cpp's /v1/completions accept) when a tokenizer is known
(`--tokenizer`, or `--model` as a local path), or with `--prompt-format text` (and on chat) text
re-encoded until it has the requested length (bench/prompts.py). Every request asks for
`stream_options.include_usage`; the report puts the server's `usage.prompt_tokens` beside the
requested length and warns loudly when they differ (bench/report.py's length_warning).

Arrivals: `--request-rate R` draws inter-arrival gaps from an exponential distribution (a
Poisson process of rate R; `--burstiness B` uses a gamma distribution of shape B instead, B=1
being Poisson); `inf` sends everything at once. `--max-concurrency C` caps requests in flight.

Sweep: `--sweep-rates 0.5,1,2,4,inf` runs one pass per rate and writes `--plot FILE.png`: p99
TTFT and p99 ITL against achieved output throughput, the latency-throughput curve of seed 001,
with its knee marked, plus a Markdown table. `--sweep-concurrency 1,8,32` (seed 004) runs one pass
per cap on requests in flight instead and plots throughput and latency at the largest
`--metric-percentiles` against concurrency; `--gpu-cost-per-hour` adds cost per million tokens, and
every pass reads the server's /metrics (KV cache, memory) while it runs (bench/seed004.py).
`--compare URL` runs the same sweep against a second server and draws both curves on the same axes:

    kvserve bench serve --base-url http://127.0.0.1:8000 --model stories260K-hf \\
        --dataset-name random --random-input-len 64 --random-output-len 64 --ignore-eos \\
        --sweep-rates 1,4,16,inf --num-prompts 100 --plot curve.png \\
        --compare http://127.0.0.1:8001 --compare-label vllm
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict

import httpx

from kvserve.bench.client import RequestResult, Target, send_request  # noqa: F401 (re-exported)
from kvserve.bench.datasets import Conversation, Turn, build_dataset
from kvserve.bench.prompts import PromptMaker, tokenizer_source
from kvserve.bench.tenants import add_cli_args as add_tenant_args, run_tenants
from kvserve.bench.seed004 import (add_costs, format_concurrency_table, format_extras, parse_concurrencies,
                                   pass_with_metrics, percentile_name, plot_concurrency)
from kvserve.bench.report import format_summary, format_sweep_table, length_warning, plot_sweep, summarize


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gaps between consecutive arrivals: gamma(shape=burstiness, mean=1/rate); 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("--request-rate must be positive (or inf)")
    theta = 1.0 / (rate * burstiness)
    # The first request goes at t = 0; each later one after a random gap.
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)] if n else []


async def run_pass(target: Target, conversations: list[Conversation], args, rate: float,
                   quiet: bool = False) -> tuple[list[RequestResult], float]:
    """One benchmark pass at one request rate. Returns (results, duration in seconds)."""
    rng = random.Random(args.seed)
    gaps = arrival_gaps(len(conversations), rate, args.burstiness, rng)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    total = sum(len(c.turns) for c in conversations)
    pbar = None
    if not quiet and not args.disable_tqdm:
        from tqdm import tqdm
        pbar = tqdm(total=total, desc=f"{target.label} @ {_rate_str(rate)} req/s", file=sys.stderr)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    results: list[RequestResult] = []

    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(turn: Turn, history):
            if sem is None:
                res = await send_request(client, target, turn, args, history, t0)
            else:
                async with sem:
                    res = await send_request(client, target, turn, args, history, t0)
            results.append(res)
            if pbar is not None:
                pbar.update(1)
            return res

        async def conversation(conv: Conversation):
            history: list[dict] = [{"role": "system", "content": conv.system}] if conv.system else []
            for turn in conv.turns:
                res = await one(turn, history)
                if not res.success:
                    # Later turns depend on this answer: count them as failed too.
                    for _ in conv.turns[conv.turns.index(turn) + 1:]:
                        results.append(RequestResult(error="skipped: an earlier turn failed",
                                                     start=time.perf_counter() - t0, e2e=0.0))
                        if pbar is not None:
                            pbar.update(1)
                    return
                history = history + [{"role": "user", "content": turn.text},
                                     {"role": "assistant", "content": res.generated_text}]

        tasks = []
        for conv, gap in zip(conversations, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(conversation(conv)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    return results, duration


def _rate_str(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        v = float(part)          # float("inf") parses "inf"
        if v <= 0:
            raise ValueError(f"request rates must be positive, got {part}")
        rates.append(v)
    if not rates:
        raise ValueError("--sweep-rates needs at least one rate")
    return rates


async def resolve_model(target: Target, timeout: float) -> str:
    """The first model the server lists, when `--model` was not given."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        resp = await client.get(target.base_url.rstrip("/") + "/v1/models", headers=headers)
        resp.raise_for_status()
        data = resp.json()["data"]
        if not data:
            raise RuntimeError(f"{target.base_url} serves no models")
        return data[0]["id"]


async def benchmark(args) -> dict:
    """Run the whole benchmark described by parsed `args`; returns the result dictionary."""
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    targets = [Target(args.base_url, args.served_model_name or args.model, args.endpoint,
                      args.api_key, args.label)]
    if args.compare:
        targets.append(Target(args.compare, args.compare_model or args.served_model_name or args.model,
                              args.endpoint, args.compare_api_key or args.api_key, args.compare_label))
    if args.dataset_name == "chat" and not targets[0].chat:
        for t in targets:
            t.endpoint = "/v1/chat/completions"
    for t in targets:
        if not t.model or os.path.exists(t.model):
            # A local path (directory or .gguf) is a tokenizer source; the server knows the model
            # by its own name.
            t.model = await resolve_model(t, args.timeout)
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    # seed 004: "at 1, 8 and 32 concurrent requests": one pass per cap, all at --request-rate
    concurrencies = parse_concurrencies(args.sweep_concurrency) if args.sweep_concurrency else None
    if concurrencies:
        if args.sweep_rates:
            raise ValueError("give --sweep-rates or --sweep-concurrency, not both")
        rates = [args.request_rate] * len(concurrencies)
    caps = concurrencies or [args.max_concurrency] * len(rates)
    cost_per_hour = args.gpu_cost_per_hour if args.gpu_cost_per_hour is not None else args.machine_cost_per_hour
    # Fresh prompts for every pass (seed + pass index), so that a prefix cache cannot serve one
    # pass from the previous one; every server of a --compare gets the same prompts per rate.
    maker = PromptMaker(tokenizer_source(args), random.Random(args.seed))
    datasets = [build_dataset(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), maker)
                for i in range(len(rates))]
    print(describe_prompts(args, maker, targets[0]), flush=True)
    if getattr(args, "tenant", None):          # several tenants at once (bench/tenants.py)
        return await run_tenants(args, targets[0], maker, run_pass, summarize, format_summary)

    out: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {k: v for k, v in vars(args).items() if k != "func" and not k.endswith("api_key")},
        "runs": {},
    }
    for t in targets:
        rows = []
        for rate, cap, conversations in zip(rates, caps, datasets):
            pass_args = argparse.Namespace(**{**vars(args), "max_concurrency": cap})
            results, duration, server_metrics = await pass_with_metrics(run_pass, t, conversations, pass_args,
                                                                        rate)
            s = summarize(results, duration, percentiles, args.slo_ttft_ms, args.slo_tpot_ms,
                          args.slo_e2e_ms)
            s["request_rate"] = rate if not math.isinf(rate) else "inf"
            s["max_concurrency"] = cap
            add_costs(s, cost_per_hour)
            if server_metrics:
                s["server_metrics"] = server_metrics
            s["label"] = t.label
            s["base_url"] = t.base_url
            s["model"] = t.model
            if args.save_detailed:
                s["requests"] = [asdict(r) | {"tpot": r.tpot} for r in results]
            printable = dict(s, request_rate=rate)
            print(format_summary(printable, f"{t.label} @ {_rate_str(rate)} req/s"
                                 + (f", {cap} concurrent" if concurrencies else ""), percentiles))
            extras = format_extras(s)
            if extras:
                print(extras, flush=True)
            warning = length_warning(s)
            if warning:
                print(f"\n{t.label} @ {_rate_str(rate)} req/s: {warning}\n", file=sys.stderr, flush=True)
            rows.append(s)
        out["runs"][t.label] = rows
    if concurrencies:
        pct = percentile_name(max(percentiles))
        for label, rows in out["runs"].items():
            print(f"\n{label}:\n" + format_concurrency_table(rows, pct))
        plot_path = args.plot or (os.path.splitext(args.save_result)[0] + ".png"
                                  if args.save_result else "bench_serve_concurrency.png")
        out["plot"] = plot_concurrency(out["runs"], plot_path, pct)
        print(f"plot written to {plot_path}")
    elif len(rates) > 1 or args.compare:
        for label, rows in out["runs"].items():
            rows_f = [dict(r, request_rate=float(r["request_rate"])) for r in rows]
            print(f"\n{label}:\n" + format_sweep_table(rows_f))
        plot_path = args.plot or (os.path.splitext(args.save_result)[0] + ".png"
                                  if args.save_result else "bench_serve_sweep.png")
        curves = {label: [dict(r, request_rate=float(r["request_rate"])) for r in rows]
                  for label, rows in out["runs"].items()}
        knees = plot_sweep(curves, plot_path)
        out["plot"] = plot_path
        out["knee_request_rate"] = {
            label: (curves[label][k]["request_rate"] if k is not None else None)
            for label, k in knees.items()}
        for label, k in knees.items():
            where = (f"{_rate_str(curves[label][k]['request_rate'])} req/s" if k is not None
                     else "none found (too few points or a flat curve)")
            print(f"knee of {label}'s p99 TTFT curve: {where}")
        print(f"plot written to {plot_path}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(_jsonable(out), f, indent=2)
        print(f"results written to {args.save_result}")
    return out


def describe_prompts(args, maker: PromptMaker, target: Target) -> str:
    """One line saying how prompts are sent, so that a reader knows what the lengths mean."""
    src = tokenizer_source(args)
    if args.dataset_name not in ("random", "prefix"):
        return (f"prompts: {args.dataset_name} dataset as text; prompt lengths below are the "
                f"server's counts (chat template and history included)")
    if maker.tokenizer is None:
        return ("prompts: random words as text (no tokenizer: give --tokenizer PATH for exact "
                "lengths); the server's usage.prompt_tokens is compared with the requested length")
    if target.chat:
        return (f"prompts: message contents fitted to the requested length with the tokenizer of "
                f"{src}; the server's count adds the chat template (reported, not checked)")
    if args.prompt_format == "text":
        return (f"prompts: text re-encoded with the tokenizer of {src} until it counts as the "
                f"requested length (special tokens included); checked against the server's usage")
    return (f"prompts: random token ids of the tokenizer of {src}, sent as token-id lists; "
            f"checked against the server's usage.prompt_tokens")


def _jsonable(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None if math.isnan(x) else "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (without /v1)")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--model", default=None,
                   help="model name sent in requests; a local directory or .gguf file is used as "
                        "the tokenizer instead, and the name is then asked of GET /v1/models")
    g.add_argument("--served-model-name", default=None, help="model name to send, overriding --model")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for exact prompt lengths: an HF or llama2.c model directory, or a "
                        ".gguf file (default: --model when it is a local path)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--label", default="kvserve", help="name of this server in tables and plots")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "prefix", "chat", "jsonl"])
    g.add_argument("--dataset-path", default=None, help="jsonl dataset file")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per pass (chat: total turns)")
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--prompt-format", choices=["token-ids", "text"], default="token-ids",
                   help="random/prefix datasets on /v1/completions: send token-id lists (exact "
                        "lengths; needs a tokenizer) or text re-encoded to the requested length "
                        "(chat endpoints always get text)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-num-prefixes", type=int, default=4, help="prefix: distinct shared system prompts")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="prefix: tokens of each shared prefix (chat: of the system prompt)")
    g.add_argument("--prefix-question-len", type=int, default=32, help="prefix: tokens of each question")
    g.add_argument("--chat-turns", type=int, default=3, help="chat: user turns per conversation")
    g.add_argument("--chat-num-conversations", type=int, default=None,
                   help="chat: conversations (default num-prompts / chat-turns)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s (chat: conversations started per second; "
                        "each next turn follows its answer); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add_tenant_args(g)          # --tenant KEY:RATE[:N] (bench/tenants.py)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (sends ignore_eos=true)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--disable-tqdm", action="store_true")

    g = p.add_argument_group("report")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    g.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on end-to-end latency")
    g.add_argument("--save-result", default=None, help="write the results as JSON to this file")
    g.add_argument("--save-detailed", action="store_true", help="include every request in the JSON")
    g.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates (inf allowed): one pass each, plus a plot")
    g.add_argument("--plot", default=None, help="PNG path for the sweep plot")
    g.add_argument("--sweep-concurrency", default=None, metavar="1,8,32",
                   help="comma-separated caps on requests in flight: one pass each (at --request-rate), "
                        "a table and a plot of throughput and latency at the largest --metric-percentiles")
    g.add_argument("--gpu-cost-per-hour", type=float, default=None,
                   help="report cost per million input and output tokens at this price per hour")
    g.add_argument("--machine-cost-per-hour", type=float, default=None,
                   help="as --gpu-cost-per-hour, for the whole machine")
    g.add_argument("--metrics-interval", type=float, default=0.5,
                   help="scrape the server's /metrics every this many seconds during a pass "
                        "(KV-cache usage, memory); 0 = off")
    g.add_argument("--compare", default=None, metavar="URL",
                   help="a second server: run the same passes against it and plot both curves")
    g.add_argument("--compare-model", default=None, help="model name on the --compare server")
    g.add_argument("--compare-api-key", default=None)
    g.add_argument("--compare-label", default="compare")


def cmd_bench_serve(args) -> int:
    out = asyncio.run(benchmark(args))
    failed = sum(r["failed"] for rows in out["runs"].values() for r in rows)
    completed = sum(r["completed"] for rows in out["runs"].values() for r in rows)
    return 0 if completed > 0 or failed == 0 else 1


def register(bench_subparsers) -> None:
    """Adds `serve` under the `kvserve bench` group."""
    p = bench_subparsers.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    p.set_defaults(func=cmd_bench_serve)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvserve bench serve")
    add_cli_args(p)
    return cmd_bench_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
