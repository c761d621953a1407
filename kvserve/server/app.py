"""The OpenAI-compatible HTTP API over one engine: FastAPI routes.

    POST /v1/completions          text completion, streaming (SSE) or not
    POST /v1/chat/completions     chat, rendered with the model's chat template (server/chat.py)
    GET  /v1/models               the served model, named --served-model-name
    GET  /health                  200 while the engine is alive, 500 once it failed
    GET  /metrics                 Prometheus text format (server/metrics.py); with API keys it
                                  needs one, unless --metrics-public

Every HTTP request is one engine request per prompt (`n` samples of a prompt: one request with
`n` sequences), all sent to one engine -- in its own process by default (server/engine_core.py)
-- so the requests of every client share its steps. Outputs come back cumulative and coalesced
(server/collector.py: the latest output per request, so a slow reader costs no backlog); a
stream sends one chunk per engine step the output stands for, as a fast reader would get.

Errors a client can cause are HTTP 4xx in OpenAI's shape and never reach other clients: the body
is read and validated (server/body.py) and the work it asks for bounded (server/limits.py,
server/prompts.py) before anything is queued; tokenizing runs off the event loop. What the
engine rejects (`ValueError` in `add_request`) is a 400 before the response starts; a full
queue (`--max-waiting`) a 503 with `Retry-After`. A client that disconnects has its requests
aborted and their blocks freed, and a large batch's remaining prompts are never added.
Failures inside the server are 500/503 bodies naming an error id, never the exception
(server/errors.py); /openapi.json carries the request and response schemas (server/openapi.py).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.server.answers import install as install_front
from kvserve.server.body import IgnoredFieldsHeader, api_key_bytes
from kvserve.server.errors import EngineFailureReport, install_error_handlers
from kvserve.server.limits import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST, MIN_BYTES_PER_TOKEN_BOUND, ServerLimits, Tokenization,
    max_bytes_per_token)
from kvserve.server.openapi import ROUTES, install_openapi
from kvserve.server.prompts import echo_texts, max_tokens_for, prompt_items
from kvserve.server.core_client import CoreClient
from kvserve.server.chat import ChatRenderer
from kvserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvserve.server.chat_completions import chat_completions as _chat
from kvserve.server.openai_logprobs import completion_logprobs, echo_logprobs, echo_only, prompt_logprobs_table
from kvserve.server.sampling import sampling_params
from kvserve.server.streaming import SSE_HEADERS, stream_completions, usage_of
from kvserve.server.submission import Submission, collect_or_disconnect
from kvserve.server.protocol import (
    ChatCompletionRequest, CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList)
from kvserve.server.embeddings import ROUTES as EMBEDDING_ROUTES
from kvserve.server.embeddings import install as install_embeddings
from kvserve.server.page import install as install_page
from kvserve.server.request_log import install as install_request_log
from kvserve.server.responses import ROUTES as RESPONSES_ROUTES
from kvserve.server.responses import install as install_responses
from kvserve.server.tokenizer_routes import ROUTES as TOKENIZER_ROUTES
from kvserve.server.tokenizer_routes import install as install_tokenizer_routes
from kvserve.tool_calls import DEFAULT_TOOL_CALL_PARSER, tool_parser

logger = logging.getLogger("kvserve.server")


class ServerState:
    """Everything a handler reads, built here and only here: the core client, metrics, the chat
    renderer, the per-request limits (server/limits.py: the served max_model_len, prompts per
    request, bytes per token), the tokenizer pool, error ids, tenants and the answer caches
    (server/answers.py)."""

    def __init__(self, engine, served_model_name: str, api_key: str | None = None,
                 max_waiting: int | None = None, chat_template: str | None = None,
                 stream_stall_timeout: float | None = None,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 escape_special_tokens: bool = False, api_keys=None, answer_cache: dict | None = None,
                 tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, log_requests: bool = True,
                 log_stats_interval: float = 10.0, metrics_prefix: str = "kvserve", ui: bool = True):
        tool_parser(tool_call_parser)           # an unknown name: ValueError before anything starts
        self.tool_call_parser = tool_call_parser
        self.model_name = served_model_name
        self.log_requests = log_requests            # server/request_log.py
        self.log_stats_interval = log_stats_interval
        self.ui = ui                                # server/page.py
        self.api_key = api_key
        self.api_key_bytes = api_key_bytes(api_key) if api_key is not None else None
        self.metrics = ServerMetrics(served_model_name, metrics_prefix)
        self.background: list = []      # coroutine functions run from startup to shutdown (request_log.py)
        # An LLMEngine's core runs in a thread of this process; a CoreClient is already running.
        self.core_client = (engine if isinstance(engine, CoreClient)
                            else CoreClient.in_thread(getattr(engine, "core", engine)))
        self.core_client.bind(self.metrics, max_waiting, stream_stall_timeout)
        self.engine = engine = self.core_client
        self.tokenizer = tok = engine.tokenizer
        self.chat = ChatRenderer(tok, chat_template) if tok is not None else None
        if self.chat is not None:
            self.chat.escape_special_tokens = escape_special_tokens    # server/chat.py
        self.max_model_len = engine.limits.max_model_len      # the core's served context (engine_core.py)
        bound = max_bytes_per_token(tok) if tok is not None else MIN_BYTES_PER_TOKEN_BOUND
        self.limits = ServerLimits(self.max_model_len, max_prompts_per_request, max_waiting, bound)
        self.tokenization = Tokenization()
        self.engine_failure = EngineFailureReport()
        install_front(self, api_keys, answer_cache)    # tenants, answer caches (server/answers.py)


def build_app(engine, served_model_name: str, api_key: str | None = None,
              max_waiting: int | None = None, chat_template: str | None = None,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              stream_stall_timeout: float | None = None, api_keys=None,
              answer_cache: dict | None = None, metrics_public: bool = False,
              metrics_tenant_labels: bool = False, escape_special_tokens: bool = False,
              tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, log_requests: bool = True,
              log_stats_interval: float = 10.0, metrics_prefix: str = "kvserve", ui: bool = True,
              responses_store=None) -> FastAPI:
    """The FastAPI app serving `engine`: an `LLMEngine` or `EngineCore` (its core loop runs in
    a thread of this process) or a `CoreClient` (server/core_client.py). The engine loop starts
    with the app. `api_keys`: a keys file's path or a loaded `TenantRegistry` (server/answers.install).
    `responses_store`: the Responses API's `ResponseStore` (default: its default bounds)."""
    state = ServerState(engine, served_model_name, api_key, max_waiting, chat_template,
                        stream_stall_timeout, max_prompts_per_request, escape_special_tokens,
                        api_keys, answer_cache, tool_call_parser, log_requests, log_stats_interval,
                        metrics_prefix, ui)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.core_client.start()
        tasks = [asyncio.create_task(run()) for run in state.background]
        # What startup made lives as long as the server: out of the collector's way, so that a
        # full collection (say, after one body of 300,000 small lists) walks only new objects.
        gc.freeze()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.core_client.shutdown()
            state.tokenization.shutdown()
            state.front.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvserve = state
    app.add_middleware(IgnoredFieldsHeader)     # names the unknown fields a request sent (body.py)
    install_error_handlers(app, state)
    install_openapi(app, {**ROUTES, **TOKENIZER_ROUTES, **RESPONSES_ROUTES, **EMBEDDING_ROUTES})

    @app.get("/health")
    async def health():
        dead = state.core_client.dead
        if dead is not None:        # the exception is in the log, under the id
            return JSONResponse({"status": "error", "error": state.engine_failure.message(dead)}, 500)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request):
        if not metrics_public:
            state.tenancy.authenticate(request, limit=False)     # 401 without a key, when keys exist
        return Response(state.metrics.render(metrics_tenant_labels), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        state.tenancy.authenticate(request, limit=False)
        return ModelList(data=[ModelCard(id=state.model_name, root=engine.config.model,
                                         max_model_len=state.max_model_len)]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.front.handle(request, CompletionRequest, "completion", _completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.front.handle(request, ChatCompletionRequest, "chat", _chat)

    # Each feature's routes (and background tasks) in its own module.
    install_tokenizer_routes(app, state)    # /tokenize, /detokenize, /tokenizer_info, /version, /v1/models/{id}
    install_embeddings(app, state)          # /v1/embeddings
    install_responses(app, state, responses_store)     # /v1/responses
    install_request_log(app, state)         # a line per request, a stats line every few seconds
    install_page(app, state)                # the chat page at /
    return app


# ------------------------------------------------------------------ request plumbing


# ------------------------------------------------------------------ /v1/completions


async def _completions(state: ServerState, req: CompletionRequest, request: Request):
    items = await prompt_items(state, req)
    max_tokens = [max_tokens_for(state, len(item["prompt_token_ids"]), req.max_tokens, req.min_tokens)
                  for item in items]
    # echo with max_tokens=0 (vLLM's rule): generate one token, return none of it.
    constraint = req.constraint()
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    params = [sampling_params(req, max(m, 1), req.logprobs, max(asked) if asked else None, constraint)
              for m in max_tokens]
    rid_prefix = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    sub = Submission(state, rid_prefix, stream=req.stream)
    try:
        if not await sub.add_all(list(zip(items, params)), request):
            sub.abort_unfinished()                  # the client left while its prompts were added
            return Response(status_code=499)
    except BaseException:
        sub.abort_unfinished()
        raise
    index_of = {rid: i for i, rid in enumerate(sub.request_ids)}
    try:        # echo's texts, once the engine has accepted the prompts' token ids
        prompt_texts = await echo_texts(state, req, items)
    except BaseException:
        sub.abort_unfinished()
        raise

    if req.stream:
        return StreamingResponse(stream_completions(state, req, sub, rid_prefix, created, index_of,
                                                    prompt_texts),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    final = await collect_or_disconnect(sub, request)
    if final is None:
        return Response(status_code=499)
    choices = []
    outs = [final[rid] for rid in sub.request_ids]
    outs = [echo_only(out) if req.max_tokens == 0 else out for out in outs]
    for pi, out in enumerate(outs):
        prefix_text = prompt_texts[pi] if req.echo else ""
        for c in out.outputs:
            lp = None
            as_ids = req.return_tokens_as_token_ids
            if req.logprobs is not None and req.echo:
                lp = echo_logprobs(state, out, c, req.logprobs, req.skip_special_tokens, as_ids)
            elif req.logprobs is not None and c.logprobs is not None:
                lp = completion_logprobs(state, out.prompt_token_ids, c.token_ids, c.logprobs,
                                         len(prefix_text), req.logprobs, req.skip_special_tokens, as_ids)
            plp = prompt_logprobs_table(state, out, as_ids) if req.prompt_logprobs is not None else None
            choices.append(CompletionChoice(index=pi * req.n + c.index, text=prefix_text + c.text,
                                            logprobs=lp, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, prompt_logprobs=plp))
    return CompletionResponse(id=rid_prefix, created=created, model=state.model_name,
                              choices=choices, usage=usage_of(outs)).model_dump()
