"""One streamed request of the serving benchmark, timed chunk by chunk (`kvserve bench serve`).

`send_request` posts one completion (or chat completion) with `stream: true` and
`stream_options: {"include_usage": true}`, timestamps every SSE chunk that carries a choice
(TTFT, then one ITL sample per later chunk; chunks that the server's usage shows carry no token,
such as llama-server's closing one, are left out: `token_events`) and reads the server's own
`usage`: its `prompt_tokens` is what the server counted, kept beside the length the client asked
for (`requested_prompt_len`) so that the report can say when they differ. A turn with
`prompt_token_ids` is sent as a list of ints (`prompt: [1, 2, ...]`), which kvserve's, vLLM's and
llama.cpp's /v1/completions accept and count exactly.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx

from kvserve.bench.datasets import Turn


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
    requested_prompt_len: int = 0    # what the client asked for (prompt_len: what the server counted)
    exact_len: bool = False          # the two should agree (random / prefix datasets)
    extra_chunks: int = 0            # streamed chunks that carried no token (see token_events)

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
    r = RequestResult(prompt_len=turn.prompt_len, requested_prompt_len=turn.prompt_len,
                      exact_len=turn.exact_len)
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
    elif turn.prompt_token_ids is not None:
        payload["prompt"] = turn.prompt_token_ids
    else:
        payload["prompt"] = turn.text
    if args.extra_body:
        payload.update(json.loads(args.extra_body))
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    url = target.base_url.rstrip("/") + target.endpoint
    start = time.perf_counter()
    r.start = start - t0
    events: list[tuple[float, bool, bool, bool]] = []   # (time, has text, finishes, role only)
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
                # tokens, held-back bytes): the same rule as `vllm bench serve`; see
                # token_events for the chunks that carry no token.
                parts = [((ch.get("delta") or {}).get("content") if target.chat else ch.get("text")) or ""
                         for ch in choices]
                text_parts.extend(parts)
                role_only = target.chat and all("role" in (ch.get("delta") or {}) and not p
                                                for ch, p in zip(choices, parts))
                events.append((now, any(parts), any(ch.get("finish_reason") for ch in choices), role_only))
        r.e2e = time.perf_counter() - start
        r.generated_text = "".join(text_parts)
        times = token_events(events, r.output_len if r.usage_reported else None)
        r.extra_chunks = len(events) - len(times)
        if not r.usage_reported:
            r.output_len = len(times)   # one chunk per token is the usual server behaviour
        if times:
            r.ttft = times[0] - start
            r.itl = [b - a for a, b in zip(times, times[1:])]
        else:
            # A legal empty answer (immediate EOS): count it, with TTFT = E2E.
            r.ttft = r.e2e
        r.success = True
    except Exception as e:  # noqa: BLE001 -- every failure is a counted, reported error
        r.error = f"{type(e).__name__}: {e}"
        r.e2e = time.perf_counter() - start
    return r


def token_events(events: list[tuple[float, bool, bool, bool]], n_tokens: int | None) -> list[float]:
    """Arrival times of the chunks that carry a token.

    Servers differ in the chunks around the tokens: llama-server ends a stream with a chunk of
    empty text that only carries `finish_reason` (and usage), and chat streams may open with a
    chunk that only announces the role. When the server's `usage.completion_tokens` says there
    are fewer tokens than chunks, such chunks (trailing empty finishing ones, then leading
    role-only ones) are not token events: counting them would add a near-zero ITL sample per
    request and, for the role chunk, a TTFT before any token."""
    events = list(events)
    if n_tokens is not None:
        while len(events) > n_tokens and events and not events[-1][1] and events[-1][2]:
            events.pop()
        while len(events) > n_tokens and events and events[0][3]:
            events.pop(0)
    return [e[0] for e in events]


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    except (ValueError, AttributeError):
        return body[:200]
