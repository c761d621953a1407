"""Disaggregated prefill/decode (kvserve/fleet/pd_proxy.py): `kvserve proxy` in front of a
`--role prefill` server and two `--role decode` servers sharing a Redis KV store. Greedy answers
through the proxy equal a collocated engine's, token for token, streamed or not, and the decode
instance took the prompt's KV from the store (it never saw the prompt before); with the prefill
instance gone, or a decode instance killed, or the store gone, every request still gets its
exact answer."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.fleet.launcher import free_port, stop_server
from tests.fleet.live import ENV, ROOT, STORIES_HF, scrape, start_replicas
from tests.redis_live import redis_server
from tests.server.live import reference_llm

PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the sun",
           "Tom had a big red ball. He liked to throw it to his dog, Max, in the park every day after school",
           "The cat was sleeping on the warm mat by the door when a small bird flew into the garden"]
MAX_TOKENS = 24


class LiveProxy:
    def __init__(self, prefill: list[str], decode: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="kvserve-proxy-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "kvserve.cli", "proxy", "--prefill", ",".join(prefill),
               "--decode", ",".join(decode), "--model", str(STORIES_HF), "--port", str(self.port),
               "--log-level", "warning", "--health-interval", "0.5"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **ENV),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvserve proxy did not start:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.1)

    def stop(self) -> int:
        return stop_server(self.proc, timeout=20)


@pytest.fixture(scope="module")
def want():
    with reference_llm() as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def cluster():
    with redis_server() as (url, redis_proc):
        prefill = start_replicas(1, "--role", "prefill", "--kv-tiers", url)
        decode = start_replicas(2, "--role", "decode", "--kv-tiers", url)
        proxy = LiveProxy(prefill.urls, decode.urls)
        try:
            yield {"prefill": prefill, "decode": decode, "proxy": proxy, "redis": redis_proc}
        finally:
            proxy.stop()
            prefill.stop()
            decode.stop()


def complete(url: str, prompt: str, stream: bool = False) -> tuple[str, dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/completions", trust_env=False, timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event["choices"])
                usage = event.get("usage") or usage
    return text, usage


def test_answers_equal_collocated_and_the_kv_came_from_the_store(cluster, want):
    proxy = cluster["proxy"]
    for prompt, ref, stream in zip(PROMPTS, want, (False, True, False)):
        text, usage = complete(proxy.url, prompt, stream)
        assert text == ref
        # the decode instance never saw this prompt: its cached tokens came from the store
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    m = scrape(proxy.url)
    assert m["kvserve:proxy_prefill_requests_total"] == 3 and m["kvserve:proxy_prefill_fallbacks_total"] == 0
    decode = [scrape(u) for u in cluster["decode"].urls]
    assert sum(m["kvserve:prefix_cache_hits_total"] for m in decode) >= 3 * 16
    # the decode side loaded those blocks from the Redis tier: its /metrics says so
    assert sum(m["kvserve:kv_tier_hit_blocks_total"] for m in decode) >= 3
    assert sum(m["kvserve:kv_tier_bytes_loaded_total"] for m in decode) > 0


def test_a_killed_decode_instance_loses_no_request(cluster, want):
    dec = cluster["decode"]
    victim = dec.procs[0]
    os.killpg(victim.pid, signal.SIGKILL)        # the server and its engine core
    victim.wait(10)
    for prompt, ref in zip(PROMPTS * 2, want * 2):
        assert complete(cluster["proxy"].url, prompt)[0] == ref


def test_without_prefill_or_store_the_answer_is_still_exact(cluster, want):
    cluster["prefill"].stop()                   # no prefill instance: decode computes the prompt
    assert complete(cluster["proxy"].url, PROMPTS[0] + " again")[0] != ""
    assert scrape(cluster["proxy"].url)["kvserve:proxy_prefill_fallbacks_total"] >= 1
    cluster["redis"].terminate()                # the store gone: a miss, then a recompute
    cluster["redis"].wait(10)
    for prompt, ref in zip(PROMPTS, want):
        assert complete(cluster["proxy"].url, prompt)[0] == ref
