"""vLLM's /pooling, /score and /rerank (server/openai/scoring.py) on an embed server (MiniLM):
each score against the cosine of the two texts' /v1/embeddings vectors, computed here; rerank's
order, top_n and documents; the refusals; a generation server refusing all of them. In process."""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.pooling.models import MINILM_NAME, load_embedding_model, minilm_dir
from kvserve.server.app import build_app
from kvserve.server.openai.embeddings import EmbeddingClient
from kvserve.server.openai.scoring import RerankResponse, ScoreResponse

from .live import STORIES_HF

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "The cat sat on the mat.",
        "France's capital city is Paris, on the Seine.", "Bananas are rich in potassium.",
        "Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(model=minilm_dir())
    app = build_app(EmbeddingClient.serving(load_embedding_model(config), config), MINILM_NAME)
    with TestClient(app) as c:
        yield c


def embeddings(c, texts: list[str]) -> np.ndarray:
    r = c.post("/v1/embeddings", json={"input": texts})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def cosines(q: np.ndarray, docs: np.ndarray) -> np.ndarray:
    return docs @ q / (np.linalg.norm(docs, axis=1) * np.linalg.norm(q))


def test_rerank_orders_documents_by_cosine_of_their_embeddings(client):
    vecs = embeddings(client, [QUERY] + DOCS)
    expected = cosines(vecs[0], vecs[1:])
    order = list(np.argsort(-expected))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking"):
        r = client.post(path, json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert RerankResponse.model_validate(body).model_dump(exclude_none=True) == body
        assert [x["index"] for x in body["results"]] == order
        for x in body["results"]:
            assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
            assert x["document"]["text"] == DOCS[x["index"]]
        assert body["usage"]["total_tokens"] > len(DOCS)
    assert {order[0], order[1]} == {0, 2}          # the two answers about Paris


def test_rerank_top_n_and_return_documents(client):
    full = client.post("/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    top = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                          "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]]
    assert all("document" not in x for x in top)


def test_score_one_against_many_and_pair_by_pair(client):
    vecs = embeddings(client, [QUERY] + DOCS)
    r = client.post("/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert ScoreResponse.model_validate(body).model_dump() == body
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    np.testing.assert_allclose([d["score"] for d in body["data"]], cosines(vecs[0], vecs[1:]), atol=1e-5)
    pairs = client.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:4]}).json()["data"]
    for d, (a, b) in zip(pairs, [(0, 2), (1, 3)]):
        assert d["score"] == pytest.approx(cosines(vecs[1 + a], vecs[1 + b][None])[0], abs=1e-5)


def test_pooling_returns_the_embeddings(client):
    r = client.post("/pooling", json={"input": DOCS[:2]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["object"] for d in data] == ["pooling", "pooling"]
    np.testing.assert_allclose(np.array([d["data"] for d in data]), embeddings(client, DOCS[:2]), atol=1e-6)


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": "", "documents": DOCS}, "query"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}, None),
    ("/score", {"text_1": QUERY}, "text_2"),
    ("/rerank", {"query": QUERY * 200, "documents": DOCS}, "query, documents"),
])
def test_bad_requests_are_refused(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_a_generation_server_refuses_them():
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(STORIES_HF))), "stories")) as c:
        for path in ("/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/reranking"):
            r = c.post(path, json={"query": QUERY, "documents": DOCS})
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task", (path, r.text)
            assert "--task embed" in r.json()["error"]["message"]
        assert "/rerank" not in c.get("/openapi.json").json()["paths"]


def test_an_embed_server_serves_their_schemas(client):
    doc = client.get("/openapi.json").json()
    for path, model in (("/pooling", "PoolingRequest"), ("/score", "ScoreRequest"), ("/v1/rerank", "RerankRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
