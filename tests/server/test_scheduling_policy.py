"""`--scheduling-policy priority` end to end: the request's `priority` field reaches the
scheduler. One seat: while a long request holds it, a low-priority request arrives before a
high-priority one; the high-priority one runs first. (The engine runs in a thread of the server
here; tests/server/test_tenants.py covers the process layout.)"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.live import LiveServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text('[keys."k-low"]\ntenant = "low"\npriority = 3\n\n[keys."k-any"]\ntenant = "any"\n')
    srv = LiveServer("--scheduling-policy", "priority", "--max-num-seqs", "1", "--engine-layout", "thread",
                     "--max-num-batched-tokens", "64", "--api-keys", str(keys))
    yield srv
    srv.stop()


async def _order(server, jobs):
    done: list[str] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, trust_env=False) as client:
        async def one(name, key, body, delay):
            await asyncio.sleep(delay)
            r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            done.append(name)
        await asyncio.gather(*(one(*j) for j in jobs))
    return done


# Three long requests of the most urgent level (0: tenant "any"'s floor) hold the one seat, one
# after the other, for 3 x 480 decode steps: the small ones arrive (0.1 s, 0.2 s) long before.
HOG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
HOGS = [(f"hog{i}", "k-any", HOG, 0.0) for i in range(3)]
SMALL = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


def test_priority_field_orders_the_queue(server):
    done = asyncio.run(_order(server, HOGS + [
        ("low", "k-any", {**SMALL, "priority": 5}, 0.1),
        ("high", "k-any", {**SMALL, "priority": 1}, 0.2)]))
    assert done[3:] == ["high", "low"], done


def test_tenant_priority_floor(server):
    """Tenant "low" (priority 3) cannot jump ahead of a level-2 request by asking for 0."""
    done = asyncio.run(_order(server, HOGS + [
        ("low-tenant", "k-low", {**SMALL, "priority": 0}, 0.1),
        ("other", "k-any", {**SMALL, "priority": 2}, 0.2)]))
    assert done[3:] == ["other", "low-tenant"], done
    m = server.metrics()
    assert json.dumps(sorted(k for k in m if "tenant_requests_total{" in k))
