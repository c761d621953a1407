"""`kvserve bench serve`: an online load generator for any OpenAI-compatible server.

It streams every request (SSE), timestamps every chunk, and reports the latency vocabulary of
seed 001 (TTFT, TPOT, ITL, E2E: mean, median, p50/p90/p99), request and token throughput,
goodput under SLOs, and errors -- the same figures, flags and text block as `vllm bench serve`,
so the two can be pointed at the same server and compared. Works against kvserve, vLLM, SGLang
and llama.cpp's server: it needs only `/v1/completions` (or `/v1/chat/completions`) with
`stream: true`.

Arrivals: `--request-rate R` draws inter-arrival gaps from an exponential distribution (a
Poisson process of rate R; `--burstiness B` uses a gamma distribution of shape B instead, B=1
being Poisson); `inf` sends everything at once. `--max-concurrency C` caps requests in flight.

Sweep: `--sweep-rates 0.5,1,2,4,inf` runs one pass per rate and writes `--plot FILE.png`: p99
TTFT and p99 ITL against achieved output throughput, the latency-throughput curve of seed 001,
with its knee marked, plus a Markdown table. `--compare URL` runs the same sweep against a
second server and draws both curves on the same axes:

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
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

import httpx

from kvserve.bench.datasets import Conversation, Turn, build_dataset
from kvserve.bench.report import format_summary, format_sweep_table, plot_sweep, summarize


@dataclass
class RequestResult:
    success: bool = False
    error: str | None = None
    prompt_len: int = 0
    output_len: int = 0
    ttft: float | None = None        # seconds
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    start: float | None = None       # seconds since the pass began
    generated_text: str = ""
    usage_reported: bool = False     # prompt/output lengths came from the server's `usage`

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass
class Target:
    """One server: base URL, model name, endpoint and credentials."""
    base_url: str
    model: str | None
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    label: str = "server"

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


async def _sse_events(resp: httpx.Response) -> AsyncIterator[str]:
    """`data:` payloads of a Server-Sent Events stream (multi-line events joined)."""
    buf: list[str] = []
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            buf.append(line[5:].lstrip(" "))
        elif line == "" and buf:
            yield "\n".join(buf)
            buf = []
        # comments (":") and other fields (event:, id:) carry nothing we need
    if buf:
        yield "\n".join(buf)


async def send_request(client: httpx.AsyncClient, target: Target, turn: Turn, args,
                       history: list[dict] | None, t0: float) -> RequestResult:
    """Send one streaming request and timestamp every chunk that carries text."""
    r = RequestResult(prompt_len=turn.prompt_len)
    payload: dict = {
        "model": target.model,
        "max_tokens": turn.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.top_p is not None:
        payload["top_p"] = args.top_p
    if args.ignore_eos:
        payload["ignore_eos"] = True     # vLLM / kvserve extension, honoured by llama.cpp too
    if target.chat:
        if turn.messages is not None:
            payload["messages"] = turn.messages
        else:
            payload["messages"] = (history or []) + [{"role": "user", "content": turn.text}]
    else:
        payload["prompt"] = turn.text
    if args.extra_body:
        payload.update(json.loads(args.extra_body))
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    url = target.base_url.rstrip("/") + target.endpoint
    start = time.perf_counter()
    r.start = start - t0
    last = start
    chunks = 0
    text_parts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                r.e2e = time.perf_counter() - start
                return r
            async for data in _sse_events(resp):
                if data.strip() == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {_error_message(json.dumps(obj))}")
                usage = obj.get("usage")
                if usage:
                    r.usage_reported = True
                    r.prompt_len = int(usage.get("prompt_tokens") or r.prompt_len)
                    r.output_len = int(usage.get("completion_tokens") or 0)
                choices = obj.get("choices") or []
                if not choices:
                    continue            # the usage summary, or a keep-alive
                # Every chunk with choices is one token event, even with empty text (special
                # tokens, held-back bytes): the same rule as `vllm bench serve`.
                for ch in choices:
                    if target.chat:
                        text_parts.append((ch.get("delta") or {}).get("content") or "")
                    else:
                        text_parts.append(ch.get("text") or "")
                if r.ttft is None:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
                chunks += 1
        r.e2e = time.perf_counter() - start
        r.generated_text = "".join(text_parts)
        if not r.usage_reported:
            r.output_len = chunks       # one chunk per token is the usual server behaviour
        if r.ttft is None:
            # A legal empty answer (immediate EOS): count it, with TTFT = E2E.
            r.ttft = r.e2e
        r.success = True
    except Exception as e:  # noqa: BLE001 -- every failure is a counted, reported error
        r.error = f"{type(e).__name__}: {e}"
        r.e2e = time.perf_counter() - start
    return r


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    except (ValueError, AttributeError):
        return body[:200]


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
        if not t.model or os.path.isdir(t.model):
            # A local directory is a tokenizer source; the server knows the model by its own name.
            t.model = await resolve_model(t, args.timeout)
    rates = parse_rates(args.sweep_rates) if args.sweep_rates else [args.request_rate]
    # Fresh prompts for every pass (seed + pass index), so that a prefix cache cannot serve one
    # pass from the previous one; every server of a --compare gets the same prompts per rate.
    datasets = [build_dataset(argparse.Namespace(**{**vars(args), "seed": args.seed + i}))
                for i in range(len(rates))]

    out: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {k: v for k, v in vars(args).items() if k != "func" and not k.endswith("api_key")},
        "runs": {},
    }
    for t in targets:
        rows = []
        for rate, conversations in zip(rates, datasets):
            results, duration = await run_pass(t, conversations, args, rate)
            s = summarize(results, duration, percentiles, args.slo_ttft_ms, args.slo_tpot_ms,
                          args.slo_e2e_ms)
            s["request_rate"] = rate if not math.isinf(rate) else "inf"
            s["max_concurrency"] = args.max_concurrency
            s["label"] = t.label
            s["base_url"] = t.base_url
            s["model"] = t.model
            if args.save_detailed:
                s["requests"] = [asdict(r) | {"tpot": r.tpot} for r in results]
            printable = dict(s, request_rate=rate)
            print(format_summary(printable, f"{t.label} @ {_rate_str(rate)} req/s", percentiles))
            rows.append(s)
        out["runs"][t.label] = rows
    if len(rates) > 1 or args.compare:
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
                   help="model name sent in requests; a local directory is also used as the "
                        "tokenizer, and the name is then asked of GET /v1/models")
    g.add_argument("--served-model-name", default=None, help="model name to send, overriding --model")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json, for exact prompt lengths")
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
