"""What the answer caches key on (kvserve/answer_cache/exact.py, server/answers.py): only deterministic
requests (temperature 0 or a seed >= 0; `seed: -1` is unseeded sampling and is never cached, in
the exact or the semantic layer), and a request's `cache_salt` scopes both layers as the tenant
does (a request salted "bob" never gets the answer stored for "alice": no oracle for "someone
asked exactly this"). The live server here has no keys file: the salt is the only scope."""
from __future__ import annotations

import httpx
import pytest

from kvserve.answer_cache.exact import cacheable
from tests.server.live import LiveServer

PARAPHRASES = ("How do I delete a file?", "How can I remove a file?")    # ~0.9 cosine: a semantic hit


def test_negative_seeds_are_not_deterministic():
    assert not cacheable({"temperature": 0.9, "seed": -1})      # vLLM's "no seed"
    assert not cacheable({"temperature": 0.9, "seed": -7})
    assert not cacheable({"temperature": 0.9, "seed": None})
    assert cacheable({"temperature": 0.9, "seed": 0})
    assert cacheable({"temperature": 0, "seed": -1})            # greedy whatever the seed


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--answer-cache", "semantic", "--engine-layout", "thread", "--max-num-seqs", "4")
    yield srv
    srv.stop()


def post(server, body):
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def test_unseeded_sampling_is_never_answered_from_a_cache(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.9, "seed": -1,
            "ignore_eos": True}
    first, second = post(server, body), post(server, body)
    assert [r.headers["x-kvserve-cache"] for r in (first, second)] == ["bypass", "bypass"]
    assert second.json()["usage"]["completion_tokens"] == 6
    # the semantic layer: a paraphrase of an unseeded request is sampled anew too
    sem = {**body, "prompt": PARAPHRASES[0]}
    assert post(server, sem).headers["x-kvserve-cache"] == "bypass"
    r = post(server, {**sem, "prompt": PARAPHRASES[1]})
    assert r.headers["x-kvserve-cache"] == "bypass" and r.json()["usage"]["completion_tokens"] == 6


def test_cache_salt_scopes_both_layers(server):
    body = {"prompt": PARAPHRASES[0], "max_tokens": 6, "temperature": 0}
    alice = {**body, "cache_salt": "alice"}
    assert post(server, alice).headers["x-kvserve-cache"] == "miss"
    # other salts get neither alice's exact answer nor a semantic match on it
    assert post(server, {**body, "cache_salt": "bob"}).headers["x-kvserve-cache"] == "miss"
    carol = {**body, "cache_salt": "carol", "prompt": PARAPHRASES[1]}
    assert post(server, carol).headers["x-kvserve-cache"] == "miss"
    assert post(server, body).headers["x-kvserve-cache"] == "miss"          # no salt: a scope of its own
    # alice still gets hers from both layers
    assert post(server, alice).headers["x-kvserve-cache"] == "hit-exact"
    assert post(server, {**alice, "prompt": PARAPHRASES[1]}).headers["x-kvserve-cache"] == "hit-semantic"
