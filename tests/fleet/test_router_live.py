"""`kvserve serve --data-parallel-size 2` and `kvserve router` on live stories260K replicas
(127.0.0.1, started and stopped here): greedy answers through the router equal direct ones,
follow-up chat turns stick to their conversation's replica (measured against round-robin),
salts never match across, a Responses API conversation stays on the replica that stores it,
a replica killed mid-run loses no request that had not started
streaming, and SIGTERM stops every replica."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.fleet.launcher import free_port, stop_server

from .live import ENV, MODEL, ROOT, STORIES_HF, LiveRouter, prefix_counts, scrape

SYSTEM = "You are a storyteller. You tell short, happy stories about animals to small children."


@pytest.fixture(scope="module")
def dp():
    """`kvserve serve --data-parallel-size 2`: (router url, replica urls, replica pids)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="kvserve-dp-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(STORIES_HF), "--port", str(port),
           "--data-parallel-size", "2", "--router-health-interval", "0.3", "--log-level", "warning",
           "--shutdown-timeout", "5"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **ENV),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        backends = [r["url"] for r in httpx.get(url + "/router/replicas", trust_env=False).json()["replicas"]]
        pids = [replica_pid(int(u.rsplit(":", 1)[1])) for u in backends]
        yield url, backends, pids
    finally:
        rc = stop_server(proc, timeout=30)
    assert rc == 0, log_path.read_text()[-3000:]
    for pid in pids:            # SIGTERM stopped every replica
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"replica {pid} outlived the launcher"


def replica_pid(port: int) -> int:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                return int(d.name)
    raise AssertionError(f"no replica process serves port {port}")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout, trust_env=False)


def stream_text(url: str, path: str, body: dict) -> tuple[str, int]:
    """(the streamed text, the number of SSE events) of a streaming request."""
    text, events = "", 0
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60, trust_env=False) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                ch = json.loads(line[6:])["choices"][0]
                text += ch.get("text") or ch.get("delta", {}).get("content") or ""
    return text, events


def test_router_answers_equal_direct_answers(dp):
    router, backends, _ = dp
    comp = {"model": MODEL, "prompt": "Once upon a time, a little bird", "max_tokens": 24, "temperature": 0}
    chat = {"model": MODEL, "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A dog?"}]}
    for path, body, field in (("/v1/completions", comp, lambda j: j["choices"][0]["text"]),
                              ("/v1/chat/completions", chat, lambda j: j["choices"][0]["message"]["content"])):
        direct = field(post(backends[0], path, body).json())
        via = post(router, path, body)
        assert via.status_code == 200 and via.headers["x-kvserve-replica"] in backends
        assert field(via.json()) == direct
        text, events = stream_text(router, path, body)
        assert text == direct and events > 3           # passed through chunk by chunk
    models = httpx.get(router + "/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert post(router, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}).status_code == 400


def test_responses_conversations_and_the_other_routes_through_the_router(dp):
    """A Responses API conversation continues on the replica that stores it, turn after turn
    (the default policy alone would move it); /tokenize and friends are relayed."""
    router, backends, _ = dp
    rid, replicas, inputs = None, [], []
    for turn in ("Tell me about a cat.", "And a dog?", "And a bird?", "And a fish?"):
        body = {"model": MODEL, "input": turn, "max_output_tokens": 8, "temperature": 0}
        if rid is not None:
            body["previous_response_id"] = rid
        r = post(router, "/v1/responses", body)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        replicas.append(r.headers["x-kvserve-replica"])
        inputs.append(r.json()["usage"]["input_tokens"])
    assert len(set(replicas)) == 1 and inputs == sorted(inputs) and inputs[0] < inputs[-1]
    got = httpx.get(f"{router}/v1/responses/{rid}", trust_env=False)
    assert got.status_code == 200 and got.json()["id"] == rid
    ids = post(router, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    assert post(router, "/detokenize", {"tokens": ids}).json()["prompt"].endswith("Once upon a time")
    for path in ("/version", "/tokenizer_info", f"/v1/models/{MODEL}"):
        assert httpx.get(router + path, trust_env=False).status_code == 200, path


def test_a_client_that_leaves_mid_stream_frees_its_replica(dp):
    router, backends, _ = dp
    body = {"model": MODEL, "prompt": "A long tale:", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60, trust_env=False) as r:
        replica = r.headers["x-kvserve-replica"]
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    deadline = time.monotonic() + 10        # the router lets go, and the replica aborts the request
    while True:
        reps = httpx.get(router + "/router/replicas", trust_env=False).json()["replicas"]
        running = scrape(replica)["kvserve:num_requests_running"]
        if all(x["in_flight"] == 0 for x in reps) and running == 0:
            break
        assert time.monotonic() < deadline, (reps, running)
        time.sleep(0.05)


ANIMALS = ["dog", "cat", "bird", "fish", "frog", "bear", "duck", "lion"]


def run_conversations(router: str, tag: str, n_conv: int = 6, turns: int = 4) -> list[list[str]]:
    """n_conv multi-turn chats, one after another (so that round-robin's turns are deterministic:
    a conversation's turns alternate between the replicas), each turn a follow-up of the last:
    the replica of each turn. Balancing under load is test_routing.py's."""
    def conversation(k: int) -> list[str]:
        # Nothing shared across conversations: a hit is a follow-up finding its own history.
        msgs = [{"role": "system", "content": f"Chat {tag}{k}. {SYSTEM}"},
                {"role": "user", "content": f"Tell me a story about a {ANIMALS[k % 8]} named {tag}{k}."}]
        served = []
        for t in range(turns):
            r = post(router, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 12,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            served.append(r.headers["x-kvserve-replica"])
            msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                           {"role": "user", "content": f"What happened next, part {t + 2}?"}]
        return served

    return [conversation(k) for k in range(n_conv)]


def test_follow_up_turns_land_on_the_conversations_replica(dp):
    _, backends, _ = dp
    results = {}
    for policy in ("cache-aware", "round-robin"):
        router = LiveRouter(backends, policy)
        try:
            h0, q0 = prefix_counts(backends)
            served = run_conversations(router.url, policy.split("-")[0])
            h1, q1 = prefix_counts(backends)
            routing = router.replicas()["prefix_hit_rate"]
        finally:
            assert router.stop() == 0, router.log()
        sticky = sum(s == conv[0] for conv in served for s in conv[1:]) / sum(len(c) - 1 for c in served)
        results[policy] = (sticky, (h1 - h0) / (q1 - q0), routing)
    (ca_sticky, ca_hit, ca_route), (rr_sticky, rr_hit, rr_route) = results["cache-aware"], results["round-robin"]
    print(f"cache-aware: sticky {ca_sticky:.2f} engine hit rate {ca_hit:.2f} routing hit rate {ca_route:.2f}; "
          f"round-robin: sticky {rr_sticky:.2f} engine hit rate {rr_hit:.2f} routing hit rate {rr_route:.2f}")
    assert ca_sticky == 1.0 and rr_sticky < 0.5
    assert ca_hit > 1.25 * rr_hit and ca_route > 1.25 * rr_route


def test_salted_requests_never_match_another_salt(dp):
    router, backends, _ = dp
    body = {"model": MODEL, "prompt": "The little red hen found a seed in the garden and said", "max_tokens": 4,
            "temperature": 0}

    def send(salt):
        r = post(router, "/v1/completions", {**body, **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        hit, query = map(int, r.headers["x-kvserve-prefix-blocks"].split("/"))
        return r.headers["x-kvserve-replica"], hit, query

    alice, hit, query = send("alice")
    assert hit == 0 and query > 0
    h0, _ = prefix_counts(backends)
    for other in ("bob", None):
        assert send(other)[1] == 0           # the same tokens, another salt: no routing match ...
    assert prefix_counts(backends)[0] == h0  # ... and no engine hit either, wherever it went
    assert send("alice") == (alice, query, query)


def test_a_killed_replica_loses_no_request_that_had_not_started_streaming(dp):
    router, backends, pids = dp
    victim, survivor = backends[1], backends[0]
    prompts = [f"Story {i}: once upon a time there was a {ANIMALS[i % 8]} who" for i in range(12)]
    # long enough that the poll below sees them in flight on a loaded host (150 tokens of
    # stories260K were over before it looked, now and then)
    n = 400

    def one(i: int):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": n, "temperature": 0,
                "ignore_eos": True}
        if i % 3:                   # unstreamed: nothing reaches the client before the answer
            r = post(router, "/v1/completions", body)
            return "plain", r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        text, events, failed = "", 0, False
        with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True}, timeout=60,
                          trust_env=False) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        failed = True
                    else:
                        events += 1
                        text += obj["choices"][0]["text"]
        return "stream", events, (failed, text)

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        deadline = time.monotonic() + 30
        while True:         # kill the victim while it has requests in flight
            reps = {r["url"]: r for r in httpx.get(router + "/router/replicas", trust_env=False).json()["replicas"]}
            if reps[victim]["in_flight"] >= 3:
                break
            assert time.monotonic() < deadline, reps
            time.sleep(0.01)
        os.killpg(pids[1], signal.SIGKILL)
        results = [f.result(timeout=90) for f in futures]
    metrics = httpx.get(router + "/router/replicas", trust_env=False).json()
    assert not {r["url"]: r for r in metrics["replicas"]}[victim]["healthy"]
    want = {i: post(survivor, "/v1/completions", {"model": MODEL, "prompt": prompts[i], "max_tokens": n,
                                                  "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
            for i in range(12)}
    for i, (kind, a, b) in enumerate(results):
        if kind == "plain":
            assert a == 200 and b == want[i], (i, a, b)
        else:
            failed, text = b
            assert (not failed and text == want[i]) or (failed and a > 0), (i, a, b)
    retried = sum(v for k, v in scrape(router).items() if k.startswith("kvserve:router_retries_total{"))
    assert retried >= 1
    # new requests go to the survivor
    for _ in range(3):
        r = post(router, "/v1/completions", {"model": MODEL, "prompt": prompts[0], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvserve-replica"] == survivor

