"""The keys file (JSON / TOML), its errors, the rate limiter and tenant salts (server/tenants.py);
no server."""
from __future__ import annotations

import json

import pytest

from kvserve.server.tenants import DEFAULT_TENANT, RateLimiter, Tenant, TenantRegistry


def test_json_and_toml_give_the_same_tenants(tmp_path):
    j = tmp_path / "k.json"
    j.write_text(json.dumps({"keys": {"sk-1": {"tenant": "a", "weight": 2, "priority": 1, "rate_limit": 60},
                                      "sk-2": "b", "sk-3": {"tenant": "a"}}}))
    t = tmp_path / "k.toml"
    t.write_text('[keys."sk-1"]\ntenant = "a"\nweight = 2\npriority = 1\nrate_limit = 60\n'
                 '[keys."sk-2"]\ntenant = "b"\n[keys."sk-3"]\ntenant = "a"\n')
    for path in (j, t):
        reg = TenantRegistry.load(str(path), api_key="single")
        assert reg.resolve(b"sk-1") == Tenant("a", 2.0, 1, 60.0) == reg.resolve(b"sk-3")   # first entry wins
        assert reg.resolve(b"sk-2").name == "b" and reg.resolve(b"nope") is None
        assert reg.resolve(b"single") == DEFAULT_TENANT      # --api-key beside the file
        assert reg.salt(reg.resolve(b"sk-1")) != reg.salt(reg.resolve(b"sk-2"))


@pytest.mark.parametrize("data, msg", [
    ({}, "non-empty table"),
    ({"keys": {"k": {"weight": 1}}}, "'tenant' name"),
    ({"keys": {"k": {"tenant": "a", "weight": 0}}}, "weight must be a positive"),
    ({"keys": {"k": {"tenant": "a", "rate_limit": -1}}}, "rate_limit"),
    ({"keys": {"k": {"tenant": "a", "colour": "red"}}}, "unknown field"),
])
def test_bad_files_say_what_to_change(data, msg):
    with pytest.raises(ValueError, match=msg):
        TenantRegistry.from_dict(data)


def test_unreadable_or_malformed_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        TenantRegistry.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "k.toml"
    bad.write_text("[keys\n")
    with pytest.raises(ValueError, match="not valid toml"):
        TenantRegistry.load(str(bad))


def test_salts_are_per_server_secret():
    a = TenantRegistry.from_dict({"k": "a"})
    b = TenantRegistry.from_dict({"k": "a"})
    assert a.salt(Tenant("a")) != b.salt(Tenant("a"))        # unguessable across servers


def test_rate_limiter_token_bucket():
    now = [0.0]
    lim = RateLimiter(clock=lambda: now[0])
    t = Tenant("a", rate_limit=60, burst=2)                  # 1 per second, 2 at once
    assert lim.acquire(t) == 0 and lim.acquire(t) == 0
    assert lim.acquire(t) == pytest.approx(1.0)
    now[0] = 0.5
    assert lim.acquire(t) == pytest.approx(0.5)
    now[0] = 1.0
    assert lim.acquire(t) == 0 and lim.acquire(t) > 0
    assert lim.acquire(Tenant("free")) == 0                  # no limit


def test_bench_tenant_flags():
    from kvserve.bench.tenants import parse_tenants

    assert parse_tenants(["key-a:40:80", "key-b:4"], 10) == [("key-a", 40.0, 80), ("key-b", 4.0, 10)]
    assert parse_tenants(["k:inf:3"], 1)[0][1] == float("inf")
    for bad in ("k", ":4", "k:0:3", "k:4:0", "k:1:2:3"):
        with pytest.raises(ValueError):
            parse_tenants([bad], 1)
