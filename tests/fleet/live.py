"""Live replicas (`kvserve.fleet.launcher.LocalReplicas`) and `kvserve router` subprocesses on
127.0.0.1, started and stopped by the tests, and Prometheus scraping helpers."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.fleet.launcher import LocalReplicas, free_port, stop_server

ROOT = Path(__file__).resolve().parents[2]
STORIES_HF = ROOT.parent / "shared" / "models" / "stories260K-hf"
MODEL = "stories260K-hf"
ENV = {"OMP_NUM_THREADS": "1", "NO_PROXY": "*"}


def start_replicas(n: int, *flags: str) -> LocalReplicas:
    """n `kvserve serve` replicas of stories260K (one torch thread each), healthy."""
    log_dir = tempfile.mkdtemp(prefix="kvserve-dist-")
    reps = LocalReplicas(n, ["--model", str(STORIES_HF), "--log-level", "warning", *flags], env=ENV,
                         log_dir=log_dir)
    reps.log_dir = log_dir
    try:
        reps.wait_healthy(timeout=120)
    except BaseException:
        reps.stop()
        raise
    return reps


class LiveRouter:
    """`kvserve router --backends URLS --model stories260K` in a subprocess."""

    def __init__(self, urls: list[str], policy: str = "cache-aware", *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="kvserve-router-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "kvserve.cli", "router", "--backends", ",".join(urls),
               "--model", str(STORIES_HF), "--policy", policy, "--port", str(self.port),
               "--log-level", "warning", *flags]
        env = dict(os.environ, PYTHONPATH=str(ROOT), **ENV)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve router exited:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvserve router did not start:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def replicas(self) -> dict:
        return httpx.get(self.url + "/router/replicas", timeout=10, trust_env=False).json()

    def stop(self) -> int:
        return stop_server(self.proc, timeout=20)


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples as {'name{labels}': value}, and {'name': value} summed over labels."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        k, _, v = line.rpartition(" ")
        out[k] = float(v)
        if "{" in k:
            name = k.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(v)
    return out


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the replicas' own prefix caches, summed."""
    hits = queries = 0.0
    for u in urls:
        m = scrape(u)
        hits += m.get("kvserve:prefix_cache_hits_total", 0.0)
        queries += m.get("kvserve:prefix_cache_queries_total", 0.0)
    return hits, queries
