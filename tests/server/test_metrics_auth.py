"""/metrics under API keys (issue 26, finding 9): it needs a valid key when keys are set
(`--metrics-public` opens it), and its `tenant` labels are pseudonyms unless
`--metrics-tenant-labels`. In process, on stories260K."""
from __future__ import annotations

import argparse
import hashlib
import json
import re

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.cli import add_cli_args
from kvserve.server.metrics import tenant_pseudonym

from .live import STORIES_HF

KEYS = {"keys": {"sk-alice": {"tenant": "alice"}, "sk-bob": {"tenant": "bob"}}}
BODY = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


def serve(**kw) -> TestClient:
    return TestClient(build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories", **kw))


def tenant_labels(text: str) -> set[str]:
    return set(re.findall(r'tenant="([^"]*)"', text))


def test_metrics_need_a_tenant_key_and_never_name_tenants(keys_file):
    with serve(api_keys=keys_file) as client:
        assert client.post("/v1/completions", json=BODY, headers=bearer("sk-alice")).status_code == 200
        for headers in ({}, bearer("sk-nobody"), {"Authorization": "sk-alice"}):
            r = client.get("/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = client.get("/metrics", headers=bearer("sk-bob"))        # any tenant's key reads it
        assert r.status_code == 200
    assert "alice" not in r.text and "bob" not in r.text
    assert tenant_labels(r.text) == {tenant_pseudonym("alice")}
    alice = tenant_pseudonym("alice")
    assert f'kvserve:tenant_requests_total{{model_name="stories",tenant="{alice}"}} 1.0' in r.text


def test_metrics_need_the_single_api_key():
    with serve(api_key="sekret") as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer("wrong")).status_code == 401
        assert client.get("/metrics", headers=bearer("sekret")).status_code == 200


def test_metrics_public_and_tenant_labels_are_opt_in(keys_file):
    with serve(api_keys=keys_file, metrics_public=True, metrics_tenant_labels=True) as client:
        assert client.post("/v1/completions", json=BODY, headers=bearer("sk-bob")).status_code == 200
        r = client.get("/metrics")
    assert r.status_code == 200 and tenant_labels(r.text) == {"bob"}


def test_metrics_without_keys_stay_open():
    with serve() as client:
        r = client.get("/metrics")
    assert r.status_code == 200 and "kvserve:num_requests_running" in r.text


def test_tenant_pseudonyms_are_stable_and_distinct():
    assert re.fullmatch(r"t-[0-9a-f]{12}", tenant_pseudonym("alice"))
    assert tenant_pseudonym("alice") == "t-" + hashlib.sha256(b"kvserve tenant\0alice").hexdigest()[:12]
    assert len({tenant_pseudonym(n) for n in ("alice", "bob", "Alice", "")}) == 4


def test_serve_flags():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args([])
    assert (args.metrics_public, args.metrics_tenant_labels) == (False, False)
    args = p.parse_args(["--metrics-public", "--metrics-tenant-labels"])
    assert (args.metrics_public, args.metrics_tenant_labels) == (True, True)
