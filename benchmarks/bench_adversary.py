"""Well-behaved clients' latency with and without an adversary on the same `kvserve serve`
(issue 9's benchmark).

The well-behaved load is `kvserve bench serve` at a steady Poisson rate. The adversary, in
threads beside it for the whole pass, sends what issue 9 found harmful: 4 MB text prompts, a
300,000-prompt body, JSON nested 100,000 deep, 4 million `stop_token_ids` with `min_tokens`,
`text/plain` bodies, streams whose clients never read, and a disconnect storm (streams closed
after their first bytes). Passes with and without the adversary alternate (the order flipping
each repeat) on one server; the table gives the medians of the good clients' TTFT and ITL
(p50 / p99) and output throughput, and what the adversary got back (status codes).

    python benchmarks/bench_adversary.py --repeats 3 --out benchmarks/results/adversary.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.server.live import STORIES_HF, LiveServer  # noqa: E402

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


class Adversary:
    """Bad requests in a loop, from several threads, until stopped; counts what came back."""

    def __init__(self, base_url: str, port: int):
        self.base, self.port = base_url, port
        self.stop = threading.Event()
        self.codes: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        huge = "word " * ((4 << 20) // 5)                                   # 4 MB
        self.bodies = [
            ("json", json.dumps({"prompt": huge, "max_tokens": 1})),
            ("json", json.dumps({"prompt": [[1]] * 300_000, "max_tokens": 1})),
            ("json", "[" * 100_000 + "]" * 100_000),
            ("json", json.dumps({"prompt": "Hi", "max_tokens": 200, "min_tokens": 200,
                                 "stop_token_ids": list(range(4_000_000))})),
            ("text", json.dumps({"prompt": "Hi", "max_tokens": 5})),
        ]

    def _count(self, what) -> None:
        with self.lock:
            self.codes[what] += 1

    def _posts(self) -> None:
        with httpx.Client(trust_env=False, timeout=60) as c:
            while not self.stop.is_set():
                for kind, body in self.bodies:
                    ctype = "application/json" if kind == "json" else "text/plain"
                    try:
                        r = c.post(self.base + "/v1/completions", content=body, headers={"Content-Type": ctype})
                        self._count(r.status_code)
                    except httpx.HTTPError as e:
                        self._count(type(e).__name__)

    def _stream_open(self, read_first: bool) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", self.port))
        data = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                           "logprobs": 5, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        if read_first:
            s.recv(64)
        return s

    def _non_readers(self) -> None:
        held: collections.deque = collections.deque()
        while not self.stop.is_set():
            held.append(self._stream_open(read_first=False))
            self._count("unread stream")
            if len(held) > 8:
                held.popleft().close()
            self.stop.wait(0.5)
        for s in held:
            s.close()

    def _disconnects(self) -> None:
        while not self.stop.is_set():
            self._stream_open(read_first=True).close()
            self._count("disconnected stream")
            self.stop.wait(0.05)

    def __enter__(self):
        self.threads = [threading.Thread(target=f, daemon=True)
                        for f in (self._posts, self._non_readers, self._disconnects)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def good_pass(server: LiveServer, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", server.base_url,
                        "--model", str(args.model), "--dataset-name", "random",
                        "--random-input-len", "32", "--random-output-len", str(args.output_len),
                        "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                        "--ignore-eos", "--disable-tqdm", "--seed", "0", "--save-result", f.name],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, NO_PROXY="*"))
        s = next(iter(json.load(open(f.name))["runs"].values()))[0]
    return {k: s[k] for k in KEYS} | {"failed": s["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(STORIES_HF))
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    server = LiveServer("--model", args.model, "--max-num-seqs", "64")
    runs: dict[str, list[dict]] = {"alone": [], "with adversary": []}
    adversary_codes: collections.Counter = collections.Counter()
    rss = []
    try:
        for rep in range(args.repeats):
            for mode in (("alone", "with adversary") if rep % 2 == 0 else ("with adversary", "alone")):
                if mode == "alone":
                    r = good_pass(server, args)
                else:
                    with Adversary(server.base_url, server.port) as adv:
                        time.sleep(1.0)
                        r = good_pass(server, args)
                    adversary_codes.update(adv.codes)
                server.wait_idle(timeout=120)
                rss.append(int(Path(f"/proc/{server.proc.pid}/status").read_text()
                               .split("VmRSS:")[1].split()[0]) // 1024)
                runs[mode].append(r)
                print(f"[{rep}] {mode:15s} {json.dumps({k: round(v, 1) for k, v in r.items()})}", flush=True)
        health = httpx.get(server.base_url + "/health", trust_env=False).status_code
    finally:
        server.stop()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in KEYS} for mode, rs in runs.items()}
    print(f"\nmedians of {args.repeats}: {Path(args.model).name}, {args.rate} req/s, {args.num_prompts} "
          f"prompts of 32 tokens, {args.output_len} output tokens")
    print("| well-behaved clients | TTFT p50 / p99 ms | ITL p50 / p99 ms | out tok/s |")
    print("|---|---|---|---|")
    for mode, m in med.items():
        print(f"| {mode} | {m['median_ttft_ms']:.1f} / {m['p99_ttft_ms']:.1f} | {m['median_itl_ms']:.2f} / "
              f"{m['p99_itl_ms']:.2f} | {m['output_throughput']:.1f} |")
    print(f"adversary's requests: {dict(adversary_codes)}; /health after: {health}; "
          f"server RSS after each pass (MiB): {rss}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "medians": med, "runs": runs,
                                              "adversary": dict(adversary_codes), "rss_mib": rss}, indent=1))


if __name__ == "__main__":
    main()
