"""POST /v1/embeddings (`kvserve serve --task embed`): OpenAI's request and response, exact
against sentence-transformers and transformers, bad input, the routes each kind of server
refuses, and the official SDK against a live server."""
from __future__ import annotations

import argparse
import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.openai.embeddings import EmbeddingClient
from kvserve.pooling.models import MINILM_NAME, load_embedding_model, minilm_dir
from kvserve.server.app import build_app
from kvserve.server.cli import add_cli_args, embedding_client, generation_engine, serve_task, served_name
from kvserve.server.openai.embeddings import EmbeddingResponse
from tests.server.live import STORIES_HF, LiveServer, openai_client

KEY = "sk-embed"
TEXTS = ["hello world", "a", "Embeddings: café, naïve, 東京",
         "The quick brown fox jumps over the lazy dog. " * 20]


def embed_app(model_dir: str, name: str, **kw):
    config = EngineConfig(model=model_dir)
    return build_app(EmbeddingClient.serving(load_embedding_model(config), config), name, **kw)


@pytest.fixture(scope="module")
def client():
    with TestClient(embed_app(minilm_dir(), MINILM_NAME, api_key=KEY),
                    headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_dir(), device="cpu")


def vectors(resp) -> np.ndarray:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert EmbeddingResponse.model_validate(body).model_dump() == body     # the schema it serves
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    out = [d["embedding"] for d in body["data"]]
    if isinstance(out[0], str):
        return np.stack([np.frombuffer(base64.b64decode(e), dtype="<f4") for e in out])
    return np.array(out, dtype=np.float32)


def test_float_and_base64_equal_sentence_transformers(client, st_model):
    ref = st_model.encode(TEXTS, normalize_embeddings=True)
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS]
    r = client.post("/v1/embeddings", json={"input": TEXTS, "model": MINILM_NAME, "user": "u1"})
    got = vectors(r)
    assert got.shape == (4, 384) and np.abs(got - ref).max() < 1e-5
    assert r.json()["model"] == MINILM_NAME
    assert r.json()["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    b64 = vectors(client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}))
    assert np.array_equal(b64, got)                       # the same float32 values, bit for bit
    single = vectors(client.post("/v1/embeddings", json={"input": TEXTS[2], "dimensions": 384}))
    assert np.abs(single[0] - ref[2]).max() < 1e-5
    from_ids = vectors(client.post("/v1/embeddings", json={"input": ids}))
    one_ids = vectors(client.post("/v1/embeddings", json={"input": ids[0]}))
    assert np.abs(from_ids - ref).max() < 1e-5 and np.abs(one_ids[0] - ref[0]).max() < 1e-5


def test_concurrent_requests_each_get_their_own(client, st_model):
    bodies = [{"input": TEXTS[i % 4: i % 4 + 1 + i % 2]} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: vectors(client.post("/v1/embeddings", json=b)), bodies))
    for body, got in zip(bodies, results):
        assert np.abs(got - st_model.encode(body["input"])).max() < 1e-5


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"), ({"input": [[]]}, "input"),
    ({"input": 5}, "input"), ({"input": ["a", 1]}, "input"), ({"input": [True]}, "input"),
    ({"input": [1.5]}, "input"), ({"input": [-1]}, "input.0"), ({"input": [30522]}, "input"),
    ({"input": "x", "dimensions": 128}, "dimensions"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "user": 7}, "user"),
    ({"model": MINILM_NAME}, "input"), ({"input": "x", "model": "other"}, "model"),
    ({"input": "word " * 300}, "input"), ({"input": [[101] * 257]}, "input"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param


def test_context_limit_and_the_other_routes(client):
    r = client.post("/v1/embeddings", json={"input": [[101] * 256]})          # exactly max_model_len
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    long = client.post("/v1/embeddings", json={"input": ["ok", "word " * 300]}).json()["error"]
    assert long["code"] == "context_length_exceeded" and "256" in long["message"] and "input 1" in long["message"]
    assert client.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": ""}).status_code == 401
    for path, api in (("/v1/chat/completions", "Chat Completions API"), ("/v1/completions", "Completions API")):
        r = client.post(path, json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and f"does not support {api}" in r.json()["error"]["message"]
        assert "--task generate" in r.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "ok"}
    card = client.get("/v1/models").json()["data"][0]
    assert (card["id"], card["max_model_len"]) == (MINILM_NAME, 256)
    metrics = client.get("/metrics").text
    tokens = next(line for line in metrics.splitlines() if line.startswith("kvserve:prompt_tokens_total"))
    assert float(tokens.rsplit(" ", 1)[1]) > 256


def test_a_kvserve_decoder_model_embeds_its_last_token_exactly():
    from transformers import LlamaModel

    hf = LlamaModel.from_pretrained(str(STORIES_HF), dtype=torch.float32).eval()
    texts = ["Once upon a time", "The cat sat on the mat.", "Lily and Tom went to the park. " * 6]
    with TestClient(embed_app(str(STORIES_HF), "stories")) as c:
        r = c.post("/v1/embeddings", json={"input": texts})
        got = vectors(r)
    tok = load_embedding_model(EngineConfig(model=str(STORIES_HF))).tokenizer
    with torch.no_grad():
        ref = np.stack([torch.nn.functional.normalize(
            hf(torch.tensor([tok.encode(t)])).last_hidden_state[0, -1], dim=0).numpy() for t in texts])
    assert got.shape == (3, 64) and np.abs(got - ref).max() < 1e-4
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)


def test_a_generation_server_refuses_embeddings_as_vllm_does():
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories")) as c:
        r = c.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400
    assert "does not support Embeddings API" in r.json()["error"]["message"]
    assert "--task embed" in r.json()["error"]["message"]


def serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


def test_task_and_runner_flags():
    assert serve_task(serve_args()) == "generate"
    assert serve_task(serve_args("--task", "embed")) == serve_task(serve_args("--runner", "pooling")) == "embed"
    with pytest.raises(ValueError, match="disagree"):
        serve_task(serve_args("--task", "generate", "--runner", "pooling"))
    with pytest.raises(ValueError, match="--answer-cache does not apply"):
        embedding_client(serve_args("--model", MINILM_NAME, "--task", "embed", "--answer-cache", "exact"))
    with pytest.raises(ValueError, match="is an embedding model: serve it with --task embed"):
        generation_engine(serve_args("--model", minilm_dir()))
    args = serve_args("--model", minilm_dir(), "--task", "embed")
    assert served_name(args) == MINILM_NAME


@pytest.fixture(scope="module")
def live():
    server = LiveServer("--model", MINILM_NAME, "--runner", "pooling", "--max-num-seqs", "4")
    yield server
    assert server.stop() == 0


def test_the_openai_sdk_against_a_live_embed_server(live, st_model):
    sdk = openai_client(live)
    ref = st_model.encode(TEXTS)
    default = sdk.embeddings.create(model=MINILM_NAME, input=TEXTS)       # the SDK asks for base64
    floats = sdk.embeddings.create(model=MINILM_NAME, input=TEXTS[0], encoding_format="float")
    assert np.abs(np.array([d.embedding for d in default.data]) - ref).max() < 1e-5
    assert np.abs(np.array(floats.data[0].embedding) - ref[0]).max() < 1e-5
    assert default.usage.prompt_tokens == default.usage.total_tokens > 200
    with ThreadPoolExecutor(6) as pool:                                    # several clients at once
        many = list(pool.map(lambda t: sdk.embeddings.create(model=MINILM_NAME, input=[t, TEXTS[0]]), TEXTS * 2))
    for t, resp in zip(TEXTS * 2, many):
        assert np.abs(np.array([d.embedding for d in resp.data]) - st_model.encode([t, TEXTS[0]])).max() < 1e-5
    import openai
    with pytest.raises(openai.BadRequestError, match="Chat Completions API"):
        sdk.chat.completions.create(model=MINILM_NAME, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        sdk.embeddings.create(model=MINILM_NAME, input="x", dimensions=64)
