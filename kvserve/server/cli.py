"""`kvserve serve`: load a model and serve it over the OpenAI API (server/app.py).

    kvserve serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                  [--served-model-name NAME] [--max-waiting N] [--chat-template FILE]
                  [--shutdown-timeout S] [--engine-layout process|thread] [--engine-threads N]
                  [--api-keys FILE] [--salt-secret-file PATH]
                  [--answer-cache none|exact|semantic] [--semantic-threshold 0.875]
                  [--scheduling-policy fcfs|priority|vtc]
                  [engine flags: --max-num-seqs, --block-size, ...]

The engine runs in its own process by default (server/engine_core.py), so HTTP, tokenization,
SSE and JSON never take the GIL from the step loop; `--engine-layout thread` keeps it in a
thread of the server process.

SIGTERM (or Ctrl-C) shuts down gracefully: the listening socket closes at once, in-flight
requests run to completion for up to --shutdown-timeout seconds (then they fail with 503
`shutting_down`: a JSON error, or an SSE error event and `[DONE]`), the engine stops, and the
process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from kvserve.config import EngineConfig

    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY)")
    from kvserve.server.answers import add_cli_args as add_tenant_cache_args

    add_tenant_cache_args(g)        # --api-keys FILE, --salt-secret-file, --answer-cache, ...
    g.add_argument("--served-model-name", default=None,
                   help="model name in requests and /v1/models (default: the model directory's base "
                        "name; SmolLM2-135M-Instruct for the default model)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="refuse new requests with 503 while this many are already waiting "
                        "(0 disables the limit)")
    g.add_argument("--chat-template", default=None,
                   help="jinja2 chat template file (default: the model's, else a plain fallback)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--max-prompts-per-request", type=int, default=1024,
                   help="most prompts one /v1/completions request may carry (400 beyond)")
    g.add_argument("--stream-stall-timeout", type=float, default=120.0,
                   help="abort a request whose client has read none of its output for this many "
                        "seconds, freeing its seat and KV blocks (0 disables)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without an API key even when keys are set (default: it needs one)")
    g.add_argument("--metrics-tenant-labels", action="store_true",
                   help="name tenants in /metrics labels (default: a stable pseudonym, t-<sha256 prefix>)")
    g.add_argument("--escape-special-tokens-in-content", action=argparse.BooleanOptionalAction,
                   default=None, help="tokenize special-token text in chat message content as plain "
                   "text, never as control tokens (default: on with --api-keys, off otherwise)")
    g.add_argument("--engine-layout", default="process", choices=["process", "thread"],
                   help="run the engine in its own process (default; vLLM v1's EngineCore) or in a "
                        "thread of the server process")
    g.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the engine (default: torch's, which follows OMP_NUM_THREADS)")
    from kvserve.fleet.router_cli import add_data_parallel_args

    add_data_parallel_args(p)       # --data-parallel-size N: replicas behind a router (kvserve/fleet/)


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    from kvserve.model.default import DEFAULT_MODEL_NAME, is_default_model

    if is_default_model(args.model):
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.model))


def cmd_serve(args) -> int:
    import torch
    import uvicorn

    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.answers import answer_cache_options, tenant_registry
    from kvserve.server.app import build_app
    from kvserve.server.chat import escape_special_tokens
    from kvserve.server.engine_client import ProcessEngine
    from kvserve.server.shutdown import ANSWER_GRACE_S, DeadlineServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tenants = tenant_registry(args)     # before any replica starts: one salt secret file for all
    if getattr(args, "data_parallel_size", 1) > 1:
        from kvserve.fleet.router_cli import serve_data_parallel

        return serve_data_parallel(args)
    log = logging.getLogger("kvserve.server")
    config = EngineConfig.from_cli_args(args)
    if args.engine_layout == "process":
        try:
            engine = ProcessEngine(config, args.engine_threads, args.log_level)
        except RuntimeError as e:
            log.error("%s", e)
            return 1
    else:
        if args.engine_threads:
            torch.set_num_threads(args.engine_threads)
        engine = LLMEngine(config)
    name = served_name(args)
    app = build_app(engine, name, api_key=args.api_key or None,
                    max_waiting=args.max_waiting if args.max_waiting > 0 else None,
                    chat_template=args.chat_template,
                    max_prompts_per_request=args.max_prompts_per_request,
                    stream_stall_timeout=args.stream_stall_timeout or None,
                    metrics_public=args.metrics_public, metrics_tenant_labels=args.metrics_tenant_labels,
                    escape_special_tokens=escape_special_tokens(args),
                    api_keys=tenants, answer_cache=answer_cache_options(args))
    log.info("serving %s as %r on http://%s:%d (max_model_len %d)", engine.config.model, name, args.host,
             args.port, engine.config.max_model_len)
    # uvicorn's own deadline comes a little after ours: by then every handler has answered.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + ANSWER_GRACE_S,
                            access_log=False)
    server = DeadlineServer(config, app.state.kvserve.async_engine, args.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it has shut down; with a no-op handler
    # in place that re-raise is harmless and a graceful SIGTERM ends with exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if not server.started:
        return 1            # e.g. the port was taken
    log.info("server stopped")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI API",
                              description=__doc__.splitlines()[0])
    add_cli_args(p)
    p.set_defaults(func=cmd_serve)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvserve serve")
    add_cli_args(parser)
    sys.exit(cmd_serve(parser.parse_args()))
