"""Tenant cache salts (kvserve/server/salts.py, tenants.py): salt = HMAC(secret, tenant ||
cache_salt) with the deployment's shared secret, so an explicit `cache_salt` never crosses
tenants, and instances that share the secret -- a prefill and a decode instance, a server and
its restarted self on a disk tier -- hash a tenant's blocks alike and hit each other's KV."""
from __future__ import annotations

import json
import os
import stat
import threading
from argparse import Namespace

import httpx
import pytest

from kvserve.server.answers import tenant_registry
from kvserve.server.salts import SECRET_ENV, derive_salt, load_secret
from kvserve.server.tenants import Tenant, TenantRegistry
from tests.server.live import LiveServer

KEYS = {"keys": {"key-a": {"tenant": "alice"}, "key-b": {"tenant": "bob"}}}
LONG = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park "
        "with her friends and her dog. One day she saw a big red ball")
FAST = ("--engine-layout", "thread", "--max-num-seqs", "4")


def test_salt_is_an_unambiguous_hmac_of_tenant_and_cache_salt():
    s = b"k" * 32
    assert derive_salt(s, "alice", "user-42") == derive_salt(s, "alice", "user-42")
    salts = {derive_salt(s, "alice", None), derive_salt(s, "alice", "user-42"),
             derive_salt(s, "bob", "user-42"), derive_salt(s, "bob", None),
             derive_salt(s, "a", "b|c"), derive_salt(s, "a|b", "c"), derive_salt(s, "ab", "c"),
             derive_salt(s, "a", "bc"), derive_salt(b"j" * 32, "alice", None)}
    assert len(salts) == 9
    same = [TenantRegistry.from_dict(KEYS, secret=s) for _ in range(2)]     # two instances, one secret
    assert same[0].salt(Tenant("alice")) == same[1].salt(Tenant("alice"))
    assert same[0].salt(Tenant("alice"), "x") != same[0].salt(Tenant("bob"), "x")


def test_secret_file_is_created_once_0600_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "keys.json.salt-secret"
    first = load_secret(None, str(path))
    assert len(first) == 64 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_secret(None, str(path)) == first == load_secret(str(path), "/nonexistent/x")
    monkeypatch.setenv(SECRET_ENV, "e" * 40)
    assert load_secret(None, str(path)) == b"e" * 40          # the environment before the default
    assert load_secret(str(path), "unused") == first          # the flag before the environment
    assert [p.name for p in tmp_path.iterdir()] == [path.name]   # no temporary file left


def test_replicas_starting_at_once_agree_on_one_secret(tmp_path):
    path, got, barrier = str(tmp_path / "secret"), [], threading.Barrier(8)

    def one():
        barrier.wait()
        got.append(load_secret(path, "unused"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and len(set(got)) == 1


def test_bad_secrets_say_what_to_change(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 32"):
        load_secret(str(short), "unused")
    with pytest.raises(ValueError, match="--salt-secret-file PATH or set"):
        load_secret(str(tmp_path / "no" / "dir" / "secret"), "unused")
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=SECRET_ENV):
        load_secret(None, "unused")
    args = Namespace(api_keys=None, api_key=None, salt_secret_file=str(short))
    with pytest.raises(ValueError, match="needs --api-keys"):
        tenant_registry(args)


def post(server, key, body):
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60, trust_env=False,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_explicit_salt_stays_in_its_tenant_and_tenant_blocks_survive_a_restart(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    tier = tmp_path / "tier"
    flags = ("--api-keys", str(keys), "--kv-tiers", f"disk:{tier}:64MiB", "--kv-tier-reload", "always", *FAST)
    body = {"prompt": LONG, "max_tokens": 2, "temperature": 1.0}
    salted = {**body, "cache_salt": "user-42"}
    srv = LiveServer(*flags)
    try:
        assert post(srv, "key-a", salted) == 0
        assert post(srv, "key-b", salted) == 0           # bob's "user-42" is not alice's
        assert post(srv, "key-a", salted) > 0
        assert post(srv, "key-a", body) == 0             # alice's own (tenant-only) salt
        srv.wait_idle()
    finally:
        assert srv.stop() == 0
    # The secret was kept beside the keys file, so the restarted server derives the same salts
    # and finds alice's blocks in its disk tier.
    assert (tmp_path / "keys.json.salt-secret").is_file()
    srv = LiveServer(*flags)
    try:
        assert post(srv, "key-a", body) > 0
        assert post(srv, "key-b", body) == 0
    finally:
        srv.stop()


def test_prefill_and_decode_instances_share_tenant_blocks(tmp_path):
    """`kvserve proxy` in front of a prefill and a decode instance with one keys file and one
    salt secret file: the decode instance loads the tenant's prompt blocks from the store."""
    from tests.fleet.live import start_replicas
    from tests.fleet.test_pd import LiveProxy
    from tests.redis_live import redis_server

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    tenants = ("--api-keys", str(keys), "--salt-secret-file", str(tmp_path / "pd-secret"), *FAST)
    with redis_server() as (url, _):
        prefill = start_replicas(1, "--role", "prefill", "--kv-tiers", url, *tenants)
        decode = start_replicas(1, "--role", "decode", "--kv-tiers", url, *tenants)
        proxy = LiveProxy(prefill.urls, decode.urls)
        try:
            for extra in ({}, {"cache_salt": "user-42"}):
                body = {"prompt": LONG, "max_tokens": 4, "temperature": 0, **extra}
                assert post(Namespace(base_url=proxy.url), "key-a", body) >= 16, extra
        finally:
            proxy.stop()
            prefill.stop()
            decode.stop()
