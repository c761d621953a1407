"""The engine core in its own process (engine/core_loop.py, server/core_client.py): tokens
cross the process boundary in order, with no duplicate and no gap, and a dead core is a clear
error for every client and an unhealthy server, never a hang."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams

from .live import LiveServer, reference_llm

PROMPTS = ["Once upon a time", "Lily went to the park", "The cat was", "Tom had a big red ball"]


def engine_children(server: LiveServer) -> list[int]:
    """The server process's children but multiprocessing's resource tracker and the grammar
    sandbox's workers (kvserve/structured/sandbox.py)."""
    pid = server.proc.pid
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if not any(w in Path(f"/proc/{c}/cmdline").read_bytes()
                                           for w in (b"resource_tracker", b"sandbox_worker"))]


def core_pid(server: LiveServer) -> int:
    """The engine core: the server process's one spawned child."""
    cores = engine_children(server)
    assert len(cores) == 1, cores
    return cores[0]


async def stream_tokens(ac: httpx.AsyncClient, url: str, body: dict) -> tuple[list, list]:
    """(per-chunk (tokens, token_logprobs), error events) of one streamed completion."""
    chunks, errors = [], []
    async with ac.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            lp = event["choices"][0]["logprobs"]
            chunks.append((lp["tokens"], lp["token_logprobs"]) if lp else ([], []))
    return chunks, errors


def test_32_streams_cross_the_process_boundary_in_order():
    prompts = [f"{PROMPTS[i % 4]} {'and ' * (i // 4)}".strip() for i in range(32)]
    lengths = [10 + (i * 5) % 31 for i in range(32)]
    with reference_llm() as llm:
        want = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                 logprobs=0))[0].outputs[0]
                for p, n in zip(prompts, lengths)]
    server = LiveServer("--max-num-seqs", "32")
    try:
        assert core_pid(server) != server.proc.pid

        async def main():
            async with httpx.AsyncClient(trust_env=False, timeout=120) as ac:
                return await asyncio.gather(*(
                    stream_tokens(ac, server.base_url + "/v1/completions",
                                  {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                   "logprobs": 0})
                    for p, n in zip(prompts, lengths)))

        for (chunks, errors), ref in zip(asyncio.run(main()), want):
            assert errors == []
            # one chunk per token: nothing dropped, nothing sent twice, in the engine's order
            assert [len(t) for t, _ in chunks] == [1] * len(ref.token_ids)
            got_lp = [lp[0] for _, lp in chunks]
            ref_lp = [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
            assert got_lp == pytest.approx(ref_lp, abs=1e-4)
            assert "".join(t[0] for t, _ in chunks) == ref.text
        server.wait_idle()
    finally:
        assert server.stop() == 0, server.log()


def test_killed_engine_process_fails_every_stream_and_health():
    server = LiveServer()
    try:
        pid = core_pid(server)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "logprobs": 0}

        async def main():
            async with httpx.AsyncClient(trust_env=False, timeout=60) as ac:
                streams = [asyncio.ensure_future(stream_tokens(ac, server.base_url + "/v1/completions", body))
                           for _ in range(3)]
                # let them start streaming, then kill the core mid-stream
                await asyncio.to_thread(server.wait_for, "three requests running",
                                        lambda m: m["kvserve:num_requests_running"] == 3, 30)
                await asyncio.sleep(0.2)
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*streams), timeout=20)
                return results, time.monotonic() - t0

        results, waited = asyncio.run(main())
        assert waited < 10
        for chunks, errors in results:
            assert len(chunks) < 400
            assert len(errors) == 1 and "the engine failed" in errors[0]["message"], errors
        health = httpx.get(server.base_url + "/health", trust_env=False)
        assert health.status_code == 500
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       trust_env=False, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()


def test_the_thread_layout_still_serves():
    """--engine-layout thread keeps the engine in a thread of the server process."""
    server = LiveServer("--engine-layout", "thread")
    try:
        assert not engine_children(server)
        r = httpx.post(server.base_url + "/v1/completions", trust_env=False, timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        with reference_llm() as llm:
            want = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    finally:
        assert server.stop() == 0, server.log()
