"""vLLM's pooling, score and rerank routes for an embedding model (`kvserve serve --task embed`):
each input embedded by the embed server's batcher (server/openai/embeddings.py), and a pair's
score the cosine similarity of its two embeddings, as vLLM scores with an embedding model.

    POST /pooling                 {"input", "encoding_format"} -> data[i] = {"index", "object": "pooling", "data": vector}
    POST /score, /v1/score        {"text_1": str | [str], "text_2": str | [str]} -> data[i] = {"index", "object":
                                  "score", "score"}: text_1 against each text_2 (one text_1), or pair by pair
    POST /rerank, /v1/rerank, /v2/rerank (vLLM's), /reranking, /v1/reranking (llama-server's)
                                  {"query", "documents": [str], "top_n", "return_documents"} (vLLM's, Jina's,
                                  Cohere's and llama-server's shape) -> results = [{"index", "relevance_score",
                                  "document": {"text"}}], best first; top_n 0 or left out: all of them

A generation server refuses them as it refuses /v1/embeddings (400 `unsupported_task`, naming
--task embed). Inputs are bounded as /v1/embeddings' are: --max-prompts-per-request texts, each
within max_model_len (refused, never truncated).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, model_validator

from kvserve.server.body import parse_body
from kvserve.server.openai.embeddings import (
    UNSUPPORTED_TASK, EmbeddingClient, EmbeddingRequest, EmbeddingUsage, _encode, _token_ids, embed_prompts)
from kvserve.server.openai.protocol import APIError
from kvserve.server.openai.wire_types import Strict, Text

InputText = Annotated[Text, Field(min_length=1)]
Texts = Union[InputText, Annotated[list[InputText], Field(min_length=1)]]


class PoolingRequest(EmbeddingRequest):
    """`POST /pooling`: /v1/embeddings' input and encoding."""


class ScoreRequest(Strict):
    """`POST /score`: text_1 against text_2 (one text_1: against each text_2; else pair by pair)."""
    model: Optional[str] = None
    text_1: Texts
    text_2: Texts
    user: Optional[str] = None

    @model_validator(mode="after")
    def _pairs(self):
        a, b = self.lists()
        if len(a) != 1 and len(a) != len(b):
            raise ValueError(f"text_1 holds {len(a)} texts and text_2 {len(b)}: send one text_1, or as "
                             "many as text_2 (scored pair by pair)")
        return self

    def lists(self) -> tuple[list[str], list[str]]:
        return tuple([v] if isinstance(v, str) else list(v) for v in (self.text_1, self.text_2))


class RerankRequest(Strict):
    """`POST /rerank`: the documents ordered by their score against the query."""
    model: Optional[str] = None
    query: InputText
    documents: Annotated[list[InputText], Field(min_length=1)]
    top_n: Optional[int] = Field(None, ge=0)
    return_documents: bool = True
    user: Optional[str] = None


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], str]


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking")    # vLLM's, llama-server's
SCORE_PATHS = ("/score", "/v1/score")
ROUTES = {      # for server/openapi.py (served only by an embed server)
    ("post", "/pooling"): (PoolingRequest, PoolingResponse, False),
    **{("post", p): (ScoreRequest, ScoreResponse, False) for p in SCORE_PATHS},
    **{("post", p): (RerankRequest, RerankResponse, False) for p in RERANK_PATHS},
}
APIS = {"/pooling": "Pooling API", **{p: "Score API" for p in SCORE_PATHS}, **{p: "Rerank API" for p in RERANK_PATHS}}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [n, dim] arrays."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)


async def embed(state, client: EmbeddingClient, inputs: list, request: Request, tenant, fields: str):
    """The embeddings [n, dim] of `inputs` and their token count; None when the client left.
    `fields`: the request fields the inputs are, in order (named by a refusal)."""
    limit = state.limits.max_prompts_per_request
    if len(inputs) > limit:
        raise APIError(f"at most {limit} texts per request (--max-prompts-per-request), got {len(inputs)}",
                       code="too_many_prompts")
    try:
        prompts = await _token_ids(state, inputs, client.model.vocab_size)
    except APIError as e:       # (its message counts inputs: name the fields they came from)
        raise APIError(f"{fields}: {e.message.removeprefix('input: ')} (inputs counted over {fields}, "
                       "from 0)", e.status_code, param=fields, code=e.code) from None
    vectors, n = await embed_prompts(state, client, prompts, tenant, request)
    if vectors is None:
        return None, 0
    return np.asarray(vectors), n


def install(app, state) -> None:
    client = state.core_client
    if not isinstance(client, EmbeddingClient):
        for path, api in APIS.items():
            app.add_api_route(path, _refusal(state, api), methods=["POST"], include_in_schema=False)
        return

    def head(kind: str) -> dict:
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": state.model_name}

    @app.post("/pooling")
    async def pooling(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, PoolingRequest)
        if req.dimensions is not None and req.dimensions != client.model.dim:
            raise APIError(f"dimensions: this model's embeddings have {client.model.dim} dimensions and "
                           f"it supports no other (got {req.dimensions})", param="dimensions")
        vectors, n = await embed(state, client, req.inputs(), request, tenant, "input")
        if vectors is None:
            return Response(status_code=499)
        return JSONResponse({**head("pool"), "data": [
            {"index": i, "object": "pooling", "data": _encode(v, req.encoding_format)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def score(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, ScoreRequest)
        a, b = req.lists()
        vectors, n = await embed(state, client, a + b, request, tenant, "text_1, text_2")
        if vectors is None:
            return Response(status_code=499)
        left, right = vectors[:len(a)], vectors[len(a):]
        scores = cosine(np.broadcast_to(left, right.shape), right)
        return JSONResponse({**head("score"), "data": [
            {"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def rerank(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, RerankRequest)
        vectors, n = await embed(state, client, [req.query] + req.documents, request, tenant,
                               "query, documents")
        if vectors is None:
            return Response(status_code=499)
        scores = cosine(np.broadcast_to(vectors[:1], vectors[1:].shape), vectors[1:])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": state.model_name, "results": results,
                             "usage": {"total_tokens": n}})

    for path in SCORE_PATHS:
        app.add_api_route(path, score, methods=["POST"], operation_id=f"score_{path.strip('/').replace('/', '_')}")
    for path in RERANK_PATHS:
        app.add_api_route(path, rerank, methods=["POST"], operation_id=f"rerank_{path.strip('/').replace('/', '_')}")


def _refusal(state, api: str):
    async def refuse(request: Request):
        state.tenancy.authenticate(request, limit=False)
        raise APIError(f"The model does not support {api}: this server generates text (kvserve serve "
                       "--task generate); start one with --task embed (vLLM's --runner pooling) to serve "
                       "pooling, scores and reranking", code=UNSUPPORTED_TASK)
    return refuse
