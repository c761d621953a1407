"""The HTTP server over one engine: `build_app` (the FastAPI app and `ServerState`, everything a
handler reads) and the server's own routes.

    GET  /health                  200 while the engine is alive, 500 once it failed
    GET  /metrics                 Prometheus text format (server/metrics.py); with API keys it
                                  needs one, unless --metrics-public
    GET  /v1/models               the served model, named --served-model-name
    POST /v1/completions          server/openai/completions.py
    POST /v1/chat/completions     server/openai/chat.py (both through the answer-cache front,
                                  server/answers.py)

The rest of the OpenAI-compatible API (server/openai/: responses/, embeddings, the tokenizer
routes), the request log and the chat page at / (server/page.py) install their own routes.

Every HTTP request is one engine request per prompt (`n` samples of a prompt: one request with
`n` sequences), all sent to one engine -- in its own process by default (server/core_client.py)
-- so the requests of every client share its steps. A stream's outputs are per-step deltas
(server/collector.py), one chunk per engine step.

Errors a client can cause are HTTP 4xx in OpenAI's shape and never reach other clients: the body
is read and validated (server/body.py) and the work it asks for bounded (server/limits.py,
server/openai/prompts.py) before anything is queued; tokenizing runs off the event loop. What the
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
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.answers import install as install_front
from kvserve.server.body import IgnoredFieldsHeader, api_key_bytes
from kvserve.server.core_client import CoreClient
from kvserve.server.docs_page import install as install_docs
from kvserve.server.errors import EngineFailureReport, install_error_handlers
from kvserve.server.llama_routes import ROUTES as LLAMA_ROUTES
from kvserve.server.llama_routes import install as install_llama_routes
from kvserve.frontend.tokenization import Tokenization
from kvserve.server.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, ServerLimits
from kvserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kvserve.server.openapi import ROUTES, install_openapi
from kvserve.server.page import install as install_page
from kvserve.server.request_log import install as install_request_log
from kvserve.server.openai.chat import chat_completions as _chat
from kvserve.server.openai.chat_renderer import ChatRenderer
from kvserve.server.openai.completions import completions as _completions
from kvserve.server.openai.embeddings import ROUTES as EMBEDDING_ROUTES
from kvserve.server.openai.embeddings import install as install_embeddings
from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kvserve.server.openai.reasoning import reasoning_parser as reasoning_parser_of
from kvserve.server.openai.responses.routes import ROUTES as RESPONSES_ROUTES
from kvserve.server.openai.scoring import ROUTES as SCORING_ROUTES
from kvserve.server.openai.scoring import install as install_scoring
from kvserve.server.openai.responses.routes import install as install_responses
from kvserve.server.openai.tokenizer_routes import ROUTES as TOKENIZER_ROUTES
from kvserve.server.openai.tokenizer_routes import install as install_tokenizer_routes
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
                 log_stats_interval: float = 10.0, metrics_prefix: str = "kvserve", ui: bool = True,
                 generation_defaults: dict | None = None, reasoning_parser: str | None = None):
        self.reasoning = reasoning_parser_of(reasoning_parser)     # an unknown name: ValueError
        if tool_call_parser is not None:        # None: tool_choice "auto" refused (no --enable-auto-tool-choice)
            tool_parser(tool_call_parser)       # an unknown name: ValueError before anything starts
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
            self.chat.escape_special_tokens = escape_special_tokens    # server/openai/chat_renderer.py
        self.max_model_len = engine.limits.max_model_len      # the core's served context (engine_core.py)
        self.kv_stream_address = engine.limits.kv_stream_address    # PD decode side (engine/remote_kv.py)
        self.limits = ServerLimits(engine.limits, max_prompts_per_request, max_waiting)
        self.tokenization = Tokenization(tok, self.max_model_len)    # the frontend's (frontend/tokenization.py)
        # --generation-config: request defaults from the model's generation_config.json
        self.generation_defaults = generation_defaults or {}
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
              responses_store=None, generation_defaults: dict | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine`: an `LLMEngine` or `EngineCore` (its core loop runs in
    a thread of this process) or a `CoreClient` (server/core_client.py). The engine loop starts
    with the app. `api_keys`: a keys file's path or a loaded `TenantRegistry` (server/answers.install).
    `responses_store`: the Responses API's `ResponseStore` (default: its default bounds).
    `generation_defaults`: sampling defaults for fields a request leaves out (server/openai/sampling.py).
    `reasoning_parser`: "deepseek_r1" or "qwen3" splits a reasoning model's thought from its answer
    (server/openai/reasoning.py). `tool_call_parser` None refuses tool_choice "auto"."""
    state = ServerState(engine, served_model_name, api_key, max_waiting, chat_template,
                        stream_stall_timeout, max_prompts_per_request, escape_special_tokens,
                        api_keys, answer_cache, tool_call_parser, log_requests, log_stats_interval,
                        metrics_prefix, ui, generation_defaults, reasoning_parser)

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
    install_openapi(app, {**ROUTES, **TOKENIZER_ROUTES, **RESPONSES_ROUTES, **EMBEDDING_ROUTES, **LLAMA_ROUTES,
                         **SCORING_ROUTES})

    @app.get("/health")
    async def health():
        dead = state.core_client.dead
        if dead is not None:        # the exception is in the log, under the id
            return JSONResponse({"status": "error", "error": state.engine_failure.message(dead)}, 500)
        stream = state.kv_stream_address                 # PD decode side: the proxy streams KV here
        return JSONResponse({"status": "ok", **({"kv_stream": stream} if stream else {})})

    @app.get("/metrics")
    async def metrics(request: Request):
        if not metrics_public:
            state.tenancy.authenticate(request, limit=False)     # 401 without a key, when keys exist
        return Response(state.metrics.render(metrics_tenant_labels), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        state.tenancy.authenticate(request, limit=False)
        return ModelList(data=[ModelCard(id=state.model_name, root=engine.config.model.model,
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
    install_scoring(app, state)             # /pooling, /score, /rerank (embed servers; openai/scoring.py)
    install_llama_routes(app, state)        # /completion, /infill, /props, /slots, /ping (llama_routes.py)
    install_responses(app, state, responses_store)     # /v1/responses
    install_request_log(app, state)         # a line per request, a stats line every few seconds
    install_page(app, state)                # the chat page at /
    install_docs(app, state)                # Swagger UI at /docs, its assets from this server
    return app
