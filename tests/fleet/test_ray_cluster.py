"""`kvserve serve -pp 2 --data-parallel-size 2 --distributed-executor-backend ray
--ray-placement-strategy STRICT_SPREAD` on a Ray cluster of several raylets on this machine
(Ray's own `ray.cluster_utils.Cluster`, as `ray start --head` / `ray start --address` make one):
each replica is a placement group of two one-CPU bundles on two different nodes -- its server
and pipeline stage 0 in bundle 0, stage 1's worker in bundle 1 -- the four bundles take every
CPU of the cluster (so a worker placed outside its group could not start), and the router in
front answers exactly what one process answers."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvserve.fleet.launcher import free_port, stop_server

from .live import ENV, MODEL, ROOT, STORIES_HF

ray = pytest.importorskip("ray")
PROMPTS = ["Once upon a time, a little fish", "The dog ran to the park and"]


def wait_health(proc, url: str, log_path: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.5)


@contextmanager
def serving_on_a_cluster(cpus_per_node: list[int], *flags: str):
    """A Ray cluster of a CPU-less head and one node per entry (its CPUs), and `kvserve serve
    FLAGS --distributed-executor-backend ray` on it, healthy: (the URL, the nodes)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    proc = None
    try:
        nodes = [cluster.add_node(num_cpus=n) for n in cpus_per_node]
        cluster.wait_for_nodes()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = Path(tempfile.mkstemp(prefix="kvserve-ray-cluster-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(STORIES_HF), "--port", str(port),
               *flags, "--distributed-executor-backend", "ray", "--ray-replica-num-cpus", "1",
               "--log-level", "info", "--shutdown-timeout", "5", "--engine-layout", "thread"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS=cluster.address, **ENV)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        wait_health(proc, url, log_path)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield url, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if proc is not None:
            rc = stop_server(proc, timeout=60)
            assert rc == 0, log_path.read_text()[-4000:]
        cluster.shutdown()


def expected_answers() -> list[str]:
    from kvserve import LLM, SamplingParams

    return [o.outputs[0].text for o in LLM(model=str(STORIES_HF)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16))]


def test_pipeline_replicas_spread_over_a_ray_cluster():
    expected = expected_answers()
    with serving_on_a_cluster([1, 1, 1, 1], "-pp", "2", "--data-parallel-size", "2",
                              "--ray-placement-strategy", "STRICT_SPREAD") as (url, nodes):
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["name"].startswith("kvserve-") and g["state"] == "CREATED"]
        assert len(groups) == 2
        placed = [set(g["bundles_to_node_id"].values()) for g in groups]
        assert all(len(p) == 2 for p in placed) and placed[0].isdisjoint(placed[1])
        assert placed[0] | placed[1] == {n.node_id for n in nodes}
        assert ray.available_resources().get("CPU", 0) == 0     # four ranks: every CPU, in the groups
        for prompt, want in zip(PROMPTS, expected):
            for salt in ("a", "b"):     # least loaded in turn: both replicas answer
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "cache_salt": salt}
                r = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want


def test_placement_strategy_needs_ray():
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(STORIES_HF),
                        "--ray-placement-strategy", "PACK"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0
    assert "--ray-placement-strategy places replicas on a Ray cluster" in r.stderr
    assert "--distributed-executor-backend ray" in r.stderr


def test_prefill_and_decode_pools_on_a_ray_cluster():
    """`kvserve serve --prefill-replicas 1 --decode-replicas 1 --kv-transfer stream
    --distributed-executor-backend ray`: each pool's replica is a Ray actor on its own node of a
    two-node cluster (each node has one CPU, the head none), the decode replica takes the KV stream
    on its node's address, and the proxy in front answers exactly what one process answers, the
    prompts' KV streamed from the prefill node to the decode node."""
    expected = expected_answers()
    with serving_on_a_cluster([1, 1], "--prefill-replicas", "1", "--decode-replicas", "1",
                              "--kv-transfer", "stream", "--block-size", "4") as (url, nodes):
        deadline = time.monotonic() + 30           # the proxy learns the decode's stream address
        while "kv_stream" not in (health := httpx.get(url + "/health", trust_env=False).json())["decode"][0]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == 0      # one replica on each one-CPU node
        for prompt, want in zip(PROMPTS, expected):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4     # it came streamed
        assert "kvserve:proxy_kv_streams_total 2.0" in httpx.get(url + "/metrics", trust_env=False).text
        dec = httpx.get(health["decode"][0]["url"] + "/metrics", trust_env=False).text
        assert 'event="streamed"' in dec and 'event="fallback' not in dec
