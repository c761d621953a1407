"""Clients that stop reading their streams (issue 9, defect 6): their outputs wait as small
per-step deltas, well-behaved clients beside them get their exact answers, and rounds of them
(with huge bodies and a disconnect storm) leave memory where the first round left it. (The abort
after --stream-stall-timeout, which needs the kernel's socket buffers full first, is tested
deterministically in test_core_client.py.)"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx

from kvserve import SamplingParams

from .live import LiveServer, reference_llm


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def open_unread_stream(port: int, body: dict) -> socket.socket:
    """Send a streaming completion and never read the answer (a tiny receive buffer, so the
    server's writes back up quickly)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps({**body, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_rounds_of_bad_clients_cost_no_memory():
    server = LiveServer("--max-num-seqs", "16")
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "logprobs": 5, "n": 2}
    good = {"prompt": "Lily went to the park", "max_tokens": 40, "temperature": 0}
    with reference_llm() as llm:
        want = llm.generate([good["prompt"]], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0].text
    huge_text = json.dumps({"prompt": "word " * 800_000, "max_tokens": 1})         # 4 MB
    many_prompts = json.dumps({"prompt": [[1]] * 300_000, "max_tokens": 1})
    try:
        rss = []
        for _ in range(3):
            socks = [open_unread_stream(server.port, body) for _ in range(4)]
            try:
                # beside them: huge bodies (refused) and a disconnect storm (aborted)
                for bad in (huge_text, many_prompts):
                    r = httpx.post(server.base_url + "/v1/completions", content=bad, trust_env=False,
                                   timeout=60, headers={"Content-Type": "application/json"})
                    assert r.status_code == 400
                for _ in range(8):
                    s = open_unread_stream(server.port, body)
                    s.recv(64)
                    s.close()
                # a well-behaved client beside them gets its exact answer
                r = httpx.post(server.base_url + "/v1/completions", json=good, trust_env=False, timeout=60)
                assert r.json()["choices"][0]["text"] == want
                server.wait_for("the unread requests done",
                                lambda m: m["kvserve:num_requests_running"] == 0, timeout=60)
            finally:
                for s in socks:
                    s.close()
            rss.append(rss_mib(server.proc.pid))
            time.sleep(0.5)
        server.wait_idle()
        # rounds after the first leave memory where the first left it
        assert max(rss[1:]) - rss[0] < 40, rss
        assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200
    finally:
        assert server.stop() == 0, server.log()
