"""The routes of `kvserve router` (and of `kvserve serve --data-parallel-size N`), over a Router
(fleet/router.py):

    POST /v1/completions, /v1/chat/completions   routed by prefix (fleet/replicas.py), the
                                                 replica's answer relayed byte for byte, SSE
                                                 chunk by chunk
    POST /v1/responses                           by load; a continuation (previous_response_id)
                                                 to the replica holding it (response_holders.py)
    POST /v1/embeddings, /tokenize, /detokenize  by load (no prefix to reuse)
    GET  /v1/models, /v1/models/{id}, /tokenizer_info, /version
                                                 from a healthy replica
    GET, DELETE /v1/responses/{id}               the replica holding it (else each in turn)
    GET  /health                                 200 while some replica is healthy, else 503
    GET  /metrics                                the router's Prometheus metrics (router_metrics.py)
    GET  /router/replicas                        each replica's state, as JSON
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.fleet.router import Router

BY_PREFIX = ("/v1/completions", "/v1/chat/completions")
BY_LOAD = ("/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize")
FROM_ANY = ("/v1/models", "/tokenizer_info", "/version")


def build_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router

    def post(path: str, by_prefix: bool):
        async def relay(request: Request):
            return await router.proxy_post(request, path, by_prefix)
        app.add_api_route(path, relay, methods=["POST"])

    def get(path: str):
        async def relay(request: Request):
            return await router.proxy_get(path, request)
        app.add_api_route(path, relay, methods=["GET"])

    for path in BY_PREFIX:
        post(path, by_prefix=True)
    for path in BY_LOAD:
        post(path, by_prefix=False)
    for path in FROM_ANY:
        get(path)

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request):
        return await router.proxy_get(request.url.path, request)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request):
        return await router.proxy_get(request.url.path, request, request.method,
                                      first=router.responses.holder(response_id), past_404=True)

    @app.get("/health")
    async def health():
        states = [r.state() for r in router.replicas.replicas]
        ok = any(s["healthy"] for s in states)
        return JSONResponse({"status": "ok" if ok else "error", "replicas": states}, 200 if ok else 503)

    @app.get("/router/replicas")
    async def replicas():
        return {"policy": router.replicas.policy, "replicas": [r.state() for r in router.replicas.replicas],
                "prefix_hit_rate": router.metrics.hit_rate()}

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
