"""`kvserve serve --data-parallel-size 2 --distributed-executor-backend ray`: the replicas are Ray
actors on a local Ray instance that the serve process starts (`ray.init(address="local")`) and
shuts down on SIGTERM; requests through its router are answered as a direct replica answers."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from kvserve.fleet.launcher import free_port, stop_server

from .live import ENV, MODEL, ROOT, STORIES_HF

ray = pytest.importorskip("ray")


def test_ray_replicas_behind_the_router():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkstemp(prefix="kvserve-ray-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(STORIES_HF), "--port", str(port),
           "--data-parallel-size", "2", "--distributed-executor-backend", "ray",
           "--ray-replica-num-cpus", "0", "--log-level", "warning", "--shutdown-timeout", "5",
           "--engine-layout", "thread"]     # one process per replica: a quicker start
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT), **ENV), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        backends = [r["url"] for r in httpx.get(url + "/router/replicas", trust_env=False).json()["replicas"]]
        assert len(backends) == 2
        body = {"model": MODEL, "prompt": "Once upon a time, a little fish", "max_tokens": 16, "temperature": 0}
        direct = httpx.post(backends[1] + "/v1/completions", json=body, timeout=60, trust_env=False).json()
        seen = set()
        for _ in range(2):      # least loaded in turn: both actors answer
            r = httpx.post(url + "/v1/completions", json={**body, "cache_salt": f"s{len(seen)}"}, timeout=60,
                           trust_env=False)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
            seen.add(r.headers["x-kvserve-replica"])
        assert seen == set(backends)
    finally:
        rc = stop_server(proc, timeout=60)
    assert rc == 0, log_path.read_text()[-3000:]
    for b in backends:          # the actors' servers are gone with the Ray instance
        with pytest.raises(httpx.HTTPError):
            httpx.get(b + "/health", timeout=2, trust_env=False)
