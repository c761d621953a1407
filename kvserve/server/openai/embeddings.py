"""`POST /v1/embeddings`: OpenAI's embeddings API, served by `kvserve serve --task embed`
(vLLM's `--runner pooling`); the model and its pooling rule are kvserve/pooling/'s.

    {"input": "text" | ["text", ...] | [token ids] | [[token ids], ...], "model": ...,
     "encoding_format": "float" | "base64", "dimensions": N, "user": ...}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

`base64` is each vector's little-endian float32 bytes (what OpenAI's SDK decodes). `dimensions`
is refused unless it is the model's own (no Matryoshka truncation). Token ids are embedded as
given; text is tokenized as the model's tokenizer does (special tokens added), off the event loop.
Inputs over max_model_len are refused (400 naming `input`), never truncated.

The embed server is build_app's usual one (auth, errors, /health, /v1/models, /metrics, limits)
over an `EmbeddingClient`: the CoreClient of an idle core (pooling/core.py) that carries the model
and the batcher (pooling/batcher.py: one worker thread batching every client's inputs, never the
event loop). A generation server answers /v1/embeddings, and an embed server the generation
routes, with vLLM's 400 ("The model does not support Embeddings API"), saying which --task
serves it.
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from kvserve.frontend.processor import ContextLengthError
from kvserve.pooling.batcher import BatcherClosed, EmbeddingBatcher, QueueFull
from kvserve.pooling.core import NOT_GENERATING, EmbeddingCore
from kvserve.server.body import parse_body
from kvserve.server.core_client import CoreClient
from kvserve.server.openai.protocol import APIError, NonEmpty, TokenId
from kvserve.server.submission import wait_for_disconnect
from kvserve.server.openai.wire_types import Strict, Text

InputText = Annotated[Text, Field(min_length=1)]
INPUT_KINDS = "a string, a list of strings, a list of token ids or a list of token-id lists"
GENERATION_ROUTES = {"/v1/completions": "Completions API", "/v1/chat/completions": "Chat Completions API",
                     "/v1/responses": "Responses API"}


class EmbeddingRequest(Strict):
    """`POST /v1/embeddings`."""
    model: Optional[str] = None
    input: Union[InputText, NonEmpty[list[TokenId]], NonEmpty[list[InputText]],
                 NonEmpty[list[NonEmpty[list[TokenId]]]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, v):
        """One message for a wrong shape or an empty input (the union's would be vaguer)."""
        if isinstance(v, str) or not isinstance(v, list):
            if not isinstance(v, str):
                raise ValueError(f"expected {INPUT_KINDS}")
            if not v:
                raise ValueError("must not be empty")
            return v
        if not v:
            raise ValueError("must not be empty")
        kinds = {str if isinstance(x, str) else list if isinstance(x, list) else
                 int if isinstance(x, int) and not isinstance(x, bool) else None for x in v}
        if None in kinds:
            raise ValueError(f"expected {INPUT_KINDS}")
        if len(kinds) != 1:
            raise ValueError(f"expected {INPUT_KINDS}, not a mix")
        if next(iter(kinds)) is not int and any(len(x) == 0 for x in v):
            raise ValueError(f"item {next(i for i, x in enumerate(v) if len(x) == 0)} must not be empty")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of single inputs (text or token ids)."""
        v = self.input
        if isinstance(v, str):
            return [v]
        return [list(v)] if isinstance(v[0], int) else list(v)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]      # floats, or base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The 200 of `POST /v1/embeddings` (its schema; the handler writes the JSON directly)."""
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage



class EmbeddingClient(CoreClient):
    """The CoreClient of an EmbeddingCore: `model` and `batcher` serve /v1/embeddings; generating
    through it is a 400, and the batcher starts, fails at the shutdown deadline and stops with it."""

    model = None
    batcher: EmbeddingBatcher | None = None

    @classmethod
    def serving(cls, model, config) -> "EmbeddingClient":
        """`config` (an EngineConfig): max_num_batched_tokens and max_num_seqs bound a batch."""
        core = EmbeddingCore(model, config)
        client = cls.in_thread(core)
        client.model = model
        client.batcher = EmbeddingBatcher(model, config.max_num_batched_tokens, config.max_num_seqs,
                                          stats=core.stats())
        return client

    def bind(self, metrics, max_waiting, stall_timeout=None) -> None:
        super().bind(metrics, max_waiting, stall_timeout)
        self.batcher.max_waiting = max_waiting          # --max-waiting bounds the queue

    def start(self) -> None:
        super().start()
        self.batcher.start()

    async def add_request(self, request_id, prompt, params, collector, prompt_text=None, stream=False):
        raise APIError(NOT_GENERATING)

    def fail_in_flight(self, err: APIError) -> None:
        super().fail_in_flight(err)
        self.batcher.fail_all(err)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.batcher.close(timeout)
        super().shutdown(timeout)


UNSUPPORTED_TASK = "unsupported_task"     # an embedding route on a generation server, or the reverse
ROUTES = {      # for server/openapi.py
    ("post", "/v1/embeddings"): (EmbeddingRequest, EmbeddingResponse, False),
}


def install(app, state) -> None:
    client = state.core_client
    if not isinstance(client, EmbeddingClient):
        @app.post("/v1/embeddings", include_in_schema=False)       # (not served here)
        async def embeddings_refused(request: Request):
            state.tenancy.authenticate(request, limit=False)
            raise APIError("The model does not support Embeddings API: this server generates text "
                           "(kvserve serve --task generate); start one with --task embed (vLLM's "
                           "--runner pooling) to serve embeddings", code=UNSUPPORTED_TASK)
        return

    for path, api in GENERATION_ROUTES.items():     # ahead of the generation routes
        app.add_api_route(path, _refusal(state, api), methods=["POST"], include_in_schema=False)
        app.router.routes.insert(0, app.router.routes.pop())

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, EmbeddingRequest)
        return await _embed(state, client, req, request, tenant)


def _refusal(state, api: str):
    async def refuse(request: Request):
        state.tenancy.authenticate(request, limit=False)
        raise APIError(f"The model does not support {api}: {NOT_GENERATING}", code=UNSUPPORTED_TASK)
    return refuse


async def _embed(state, client: EmbeddingClient, req: EmbeddingRequest, request: Request, tenant):
    model = client.model
    if req.dimensions is not None and req.dimensions != model.dim:
        raise APIError(f"dimensions: this model's embeddings have {model.dim} dimensions and it "
                       f"supports no other (got {req.dimensions})", param="dimensions")
    inputs = req.inputs()
    limit = state.limits.max_prompts_per_request
    if len(inputs) > limit:
        raise APIError(f"input: at most {limit} inputs per request (--max-prompts-per-request), got "
                       f"{len(inputs)}", param="input", code="too_many_prompts")
    prompts = await _token_ids(state, inputs, model.vocab_size)
    vectors, n = await embed_prompts(state, client, prompts, tenant, request)
    if vectors is None:
        return Response(status_code=499)
    return JSONResponse({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": state.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})


async def embed_prompts(state, client, prompts: list[list[int]], tenant, request: Request):
    """(the embeddings of `prompts` from the batcher, their token count), counted in the tenant's
    metrics; (None, 0) when the client left. A full queue or a closing server is a 503."""
    metrics = state.tenancy.metrics
    metrics.requests.labels(metrics.model_name, tenant.name).inc()
    try:
        job = client.batcher.submit(prompts)
    except QueueFull as e:
        state.metrics.reject("overloaded")
        raise APIError(f"the server is overloaded: {e} (--max-waiting); retry later", 503,
                       type="server_error", code="server_overloaded", headers={"Retry-After": "1"}) from None
    except BatcherClosed:
        raise APIError("the server is shutting down", 503, type="server_error", code="shutting_down") from None
    vectors = await _result_or_disconnect(job, request)
    if vectors is None:
        return None, 0
    n = sum(map(len, prompts))
    metrics.prompt_tokens.labels(metrics.model_name, tenant.name).inc(n)
    return vectors, n


async def _token_ids(state, inputs: list, vocab_size: int) -> list[list[int]]:
    """Each input's token ids (text tokenized off the event loop), checked against the context
    and the vocabulary."""
    tok, texts = state.tokenizer, [x for x in inputs if isinstance(x, str)]
    if texts and tok is None:
        raise APIError("input: this model has no tokenizer: send token ids", param="input")
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            try:
                state.tokenization.check_text_fits(x, "input")
            except ContextLengthError:
                n = len(x.encode("utf-8", "surrogatepass")) // state.tokenization.bytes_per_token
                raise _too_long(state, i, f"at least {n}") from None
    encoded = iter(await state.tokenization.run_many(tok.encode, texts) if texts else ())
    prompts = [next(encoded) if isinstance(x, str) else x for x in inputs]
    for i, ids in enumerate(prompts):
        if len(ids) > state.max_model_len:
            raise _too_long(state, i, len(ids))
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise APIError(f"input: token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                           param="input")
    return prompts


def _too_long(state, index: int, n) -> APIError:
    return APIError(f"input: this model's maximum context length is {state.max_model_len} tokens, "
                    f"but input {index} has {n} tokens; shorten it", param="input",
                    code="context_length_exceeded")


async def _result_or_disconnect(job, request: Request) -> np.ndarray | None:
    """The job's embeddings [n, dim], or None (the job cancelled) when the client left first."""
    result = asyncio.wrap_future(job.future)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if result not in done:
            return None
        try:
            return result.result()
        except BatcherClosed:
            raise APIError("the server is shutting down", 503, type="server_error",
                           code="shutting_down") from None
    finally:
        watcher.cancel()
        if not job.future.done():
            job.cancel()


def _encode(vec: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()
