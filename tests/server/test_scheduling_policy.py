"""`--scheduling-policy priority` end to end: the request's `priority` field reaches the
scheduler. One seat: while a long request holds it, a low-priority request is queued before a
high-priority one; the high-priority one runs first. The order of arrival is the server's own
signal, not a sleep: each next request is sent once /metrics shows the previous one waiting.
The seat holder is 4,000 tokens of stories260K with its position limit raised (seconds, not
the 0.4 s that its own 512-token limit allows: the queueing must not race it), cancelled by its
client once both small requests wait.
(The engine runs in a thread of the server here; tests/server/test_tenants.py covers the
process layout.)"""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from kvserve.server.metrics import tenant_pseudonym
from tests.server.live import LiveServer, long_stories


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text('[keys."k-low"]\ntenant = "low"\npriority = 3\n\n[keys."k-any"]\ntenant = "any"\n')
    srv = LiveServer("--scheduling-policy", "priority", "--max-num-seqs", "1", "--engine-layout", "thread",
                     "--max-num-batched-tokens", "64", "--api-keys", str(keys),
                     model=long_stories(tmp_path_factory.mktemp("long-stories")))
    yield srv
    srv.stop()


# The seat holder, of the most urgent level (0: tenant "any"'s floor): 4,000 decode steps (seconds),
# while the two small requests need only a few /metrics round trips to be queued behind it.
HOG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
SMALL = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


def _in_engine(running: int, waiting: int):
    return lambda m: m["kvserve:num_requests_running"] == running and m["kvserve:num_requests_waiting"] == waiting


async def _order(server, first, second) -> list[str]:
    """Send the hog, then `first`, then `second` (each (name, key, body)), each once the server
    shows the one before it in the engine; once both wait, cancel the hog (its client goes away,
    the server aborts it); the names of the other two in the order they finished."""
    done: list[str] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, trust_env=False) as client:
        async def one(name, key, body):
            r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, (r.text, server.log())
            done.append(name)

        hog = asyncio.create_task(one("hog", "k-any", HOG))
        tasks = []
        for i, job in enumerate((first, second)):
            await asyncio.to_thread(server.wait_for, f"the hog running, {i} queued behind it", _in_engine(1, i))
            tasks.append(asyncio.create_task(one(*job)))
        # Both small requests wait while the hog still holds the seat: only the scheduler orders them.
        await asyncio.to_thread(server.wait_for, "the hog running, 2 queued behind it", _in_engine(1, 2))
        hog.cancel()
        await asyncio.gather(*tasks)
        assert hog.cancelled() and "hog" not in done
    return done


def test_priority_field_orders_the_queue(server):
    done = asyncio.run(_order(server, ("low", "k-any", {**SMALL, "priority": 5}),
                              ("high", "k-any", {**SMALL, "priority": 1})))
    assert done == ["high", "low"], done


def _tenant_requests(m: dict, tenant: str) -> float:
    """kvserve:tenant_requests_total of `tenant`, whose label is its pseudonym."""
    label = f'tenant="{tenant_pseudonym(tenant)}"'
    return sum(v for k, v in m.items() if k.startswith("kvserve:tenant_requests_total{") and label in k)


def test_tenant_priority_floor(server):
    """Tenant "low" (priority 3) cannot jump ahead of a level-2 request by asking for 0."""
    before = server.metrics()
    done = asyncio.run(_order(server, ("low-tenant", "k-low", {**SMALL, "priority": 0}),
                              ("other", "k-any", {**SMALL, "priority": 2})))
    assert done == ["other", "low-tenant"], done
    after = server.metrics()
    # Counted per tenant (the hog and "other" are tenant "any"'s), under pseudonyms, never names.
    assert _tenant_requests(after, "low") - _tenant_requests(before, "low") == 1
    assert _tenant_requests(after, "any") - _tenant_requests(before, "any") == 2
    assert not [k for k in after if re.search(r'tenant="(low|any)"', k)]
