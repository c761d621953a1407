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


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_vllm_step_request_and_cache_config_series():
    """vLLM's iteration_tokens_total, request_params_n / _max_tokens,
    request_max_num_generation_tokens and cache_config_info, measured on real requests."""
    engine = LLMEngine(EngineConfig(model=str(STORIES_HF), block_size=16))
    with TestClient(build_app(engine, "stories", metrics_prefix="vllm")) as c:
        before = _samples(c.get("/metrics").text)
        assert before['vllm:iteration_tokens_total_count{model_name="stories"}'] == 0
        r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 7, "n": 3,
                                            "temperature": 1.0, "seed": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r2 = c.post("/v1/completions", json={"prompt": "Tim", "max_tokens": 2, "temperature": 0})
        assert r2.status_code == 200, r2.text
        prompt_lens = [r.json()["usage"]["prompt_tokens"], r2.json()["usage"]["prompt_tokens"]]
        m = _samples(c.get("/metrics").text)
    label = '{model_name="stories"}'
    # every token the engine counted falls in exactly one step's sample
    assert m[f"vllm:iteration_tokens_total_sum{label}"] == \
        m[f"vllm:prompt_tokens_total{label}"] + m[f"vllm:generation_tokens_total{label}"]
    assert m[f"vllm:iteration_tokens_total_sum{label}"] == sum(prompt_lens) + 3 * 7 + 2
    assert m[f"vllm:iteration_tokens_total_count{label}"] >= 7      # at least one step per token
    assert m[f"vllm:request_params_n_count{label}"] == 2
    assert m[f"vllm:request_params_n_sum{label}"] == 3 + 1
    assert m['vllm:request_params_n_bucket{le="1.0",model_name="stories"}'] == 1
    assert m[f"vllm:request_params_max_tokens_sum{label}"] == 7 + 2
    assert m[f"vllm:request_max_num_generation_tokens_count{label}"] == 2
    assert m[f"vllm:request_max_num_generation_tokens_sum{label}"] == 7 + 2
    info = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and m[info[0]] == 1
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[0]))
    assert labels["block_size"] == "16"
    assert int(labels["num_gpu_blocks"]) == engine.core.limits.num_kv_blocks > 0
    assert labels["enable_prefix_caching"] == str(engine.core.config.cache.enable_prefix_caching)
    assert not any(k.startswith("kvserve:iteration_tokens") for k in m)
