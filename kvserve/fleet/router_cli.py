"""`kvserve router`, `kvserve proxy`, and `kvserve serve --data-parallel-size N`'s N replicas behind
a prefix-aware router (seed 003, "Radix trees"; Mooncake's cache-centric scheduling); the
`serve` command itself is kvserve/entrypoints/serve.py.

    kvserve router --backends URL1,URL2,... [--model PATH] [--chat-template FILE] [--block-size 16]
                   [--policy cache-aware|round-robin|least-loaded] [--balance-threshold 4]
                   [--health-interval 2] [--cb-failure-threshold 3] [--cb-timeout-duration-secs 5]
                   [--host 127.0.0.1] [--port 8000]

`--model` gives the tokenizer (and chat template) the routing key is computed with; without it
the router routes token-id prompts by prefix and everything else by load. `--block-size` must be
the replicas' (default 16, the engine's), or no key will ever match their blocks' boundaries.
`--cb-failure-threshold` consecutive failures (connection errors, timeouts, 5xx; never 429 or a
503 with Retry-After) take a replica out; `--cb-timeout-duration-secs` later one probe request
may bring it back (vllm-router's names; fleet/breaker.py).

    kvserve serve [MODEL] --data-parallel-size N [--distributed-executor-backend mp|ray] [engine flags...]

starts N replicas (`kvserve serve` with the same engine and server flags on free loopback
ports, or Ray actors) and the router on --host/--port; SIGTERM or Ctrl-C stops the router
(in-flight requests finish, up to --shutdown-timeout), then every replica.

    kvserve serve [MODEL] --prefill-replicas P --decode-replicas D [--kv-transfer stream | --kv-tiers redis://..]
                  [--distributed-executor-backend ray [--ray-placement-strategy SPREAD]] [engine flags...]

starts the two pools of a disaggregated deployment (P `--role prefill` and D `--role decode`
replicas with the same engine flags, local or Ray actors on the cluster's nodes, each in a
placement group with a strategy) and `kvserve proxy` in front of them on --host/--port.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from kvserve.config.cli_args import ArgumentParser
from kvserve.fleet.breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD
from kvserve.fleet.replicas import DEFAULT_BALANCE_THRESHOLD, DEFAULT_LRU_BLOCKS, POLICIES, ReplicaSet
from kvserve.server.cli import add_cli_args

log = logging.getLogger("kvserve.router")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", required=True,
                   help="comma-separated base URLs of the kvserve serve replicas")
    p.add_argument("--model", default=None, help="model path whose tokenizer computes routing keys")
    p.add_argument("--chat-template", default=None, help="the replicas' --chat-template, if they use one")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_policy_args(p, "")


def add_policy_args(p, prefix: str) -> None:
    p.add_argument(f"--{prefix}policy", default="cache-aware", choices=POLICIES,
                   help="cache-aware: longest matching prefix among replicas not overloaded; "
                        "round-robin; least-loaded (fewest requests in flight)")
    p.add_argument(f"--{prefix}balance-threshold", type=int, default=DEFAULT_BALANCE_THRESHOLD,
                   help="cache-aware: skip a replica with this many more requests in flight than "
                        "the least-loaded one")
    p.add_argument(f"--{prefix}health-interval", type=float, default=2.0,
                   help="seconds between /health checks of every replica")
    _add_breaker_args(p, prefix)
    if not prefix:
        p.add_argument("--lru-blocks", type=int, default=DEFAULT_LRU_BLOCKS,
                       help="block hashes remembered per replica")


def _add_breaker_args(p, prefix: str) -> None:
    p.add_argument(f"--{prefix}cb-failure-threshold", type=int, default=DEFAULT_FAILURE_THRESHOLD,
                   help="consecutive failures (connection errors, timeouts, 5xx; not 429 or "
                        "503 with Retry-After) that take a replica out")
    p.add_argument(f"--{prefix}cb-timeout-duration-secs", type=float, default=DEFAULT_COOLDOWN_S,
                   help="seconds a replica stays out before one probe request may bring it back")


def build_hasher(model: str | None, block_size: int, chat_template: str | None):
    from kvserve.fleet.prefix_key import RequestHasher, load_tokenizer

    tok = load_tokenizer(model) if model else None
    return RequestHasher(tok, block_size, namespace=model or "", chat_template=chat_template)


def run_router(urls: list[str], hasher, policy: str, balance_threshold: int, health_interval: float,
               host: str, port: int, log_level: str, lru_blocks: int = DEFAULT_LRU_BLOCKS,
               shutdown_timeout: float = 30.0, cb_failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
               cb_timeout_s: float = DEFAULT_COOLDOWN_S) -> bool:
    """Serve the router until SIGTERM/SIGINT; False if it could not start (e.g. port taken)."""
    import uvicorn

    from kvserve.fleet.router import Router
    from kvserve.fleet.router_app import build_router_app

    replicas = ReplicaSet(urls, policy, balance_threshold, lru_blocks, cb_failure_threshold, cb_timeout_s)
    app = build_router_app(Router(replicas, hasher, health_interval))
    log.info("routing %s over %d replicas (%s) on http://%s:%d", policy, len(urls), ", ".join(urls),
             host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           access_log=False,
                                           timeout_graceful_shutdown=shutdown_timeout))
    # uvicorn re-raises the signal that stopped it; a no-op handler makes that harmless.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return bool(server.started)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)      # no line per health check


def cmd_router(args) -> int:
    _logging(args.log_level)
    urls = [u.strip() for u in args.backends.split(",") if u.strip()]
    hasher = build_hasher(args.model, args.block_size, args.chat_template)
    ok = run_router(urls, hasher, args.policy, args.balance_threshold, args.health_interval,
                    args.host, args.port, args.log_level, args.lru_blocks,
                    cb_failure_threshold=args.cb_failure_threshold,
                    cb_timeout_s=args.cb_timeout_duration_secs)
    return 0 if ok else 1


def _sigterm_exit(*_):
    raise SystemExit(143)


def serve_data_parallel(args) -> int:
    """`kvserve serve --data-parallel-size N`: N replicas and the router in front of them."""
    from kvserve.fleet.launcher import LocalReplicas, RayReplicas, replica_argv
    from kvserve.server.answers import tenant_registry

    _logging(args.log_level)
    tenant_registry(args)       # before any replica starts: one salt secret file for all
    n = args.data_parallel_size
    replica_flags = ArgumentParser()
    add_cli_args(replica_flags)
    backend = args.distributed_executor_backend
    if args.ray_placement_strategy is not None and backend != "ray":
        raise ValueError("--ray-placement-strategy places replicas on a Ray cluster: give it with "
                         "--distributed-executor-backend ray")
    argv = replica_argv(args, replica_flags)
    env = {}
    if not args.engine_threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))   # no oversubscription
    signal.signal(signal.SIGTERM, _sigterm_exit)       # stop the replicas if told to during startup
    replicas = None
    try:
        if backend == "ray":
            replicas = RayReplicas(n, argv, env, num_cpus=args.ray_replica_num_cpus,
                                   strategy=args.ray_placement_strategy,
                                   ranks=args.tensor_parallel_size * args.pipeline_parallel_size)
        else:
            replicas = LocalReplicas(n, argv, env=env)
        log.info("starting %d replicas: %s", n, ", ".join(replicas.urls))
        replicas.wait_healthy()
        from kvserve.config.default_model import default_model_path

        hasher = build_hasher(args.model or default_model_path(), args.block_size, args.chat_template)
        ok = run_router(replicas.urls, hasher, args.router_policy, args.router_balance_threshold,
                        args.router_health_interval, args.host, args.port, args.log_level,
                        shutdown_timeout=args.shutdown_timeout,
                        cb_failure_threshold=args.router_cb_failure_threshold,
                        cb_timeout_s=args.router_cb_timeout_duration_secs)
        return 0 if ok else 1
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)    # stopping: finish stopping
        if replicas is not None:
            replicas.stop(timeout=args.shutdown_timeout)
        log.info("stopped the router and %d replicas", n)


def _side_argv(argv: list[str], role: str) -> list[str]:
    """`argv` without the --kv-stream-* flags the other side reads (each side refuses those)."""
    from kvserve.config import EngineConfig

    keep = EngineConfig._STREAM_FLAGS[role]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("--kv-stream-") and a[2:].replace("-", "_") not in keep:
            skip = True                                       # the flag and its value
        else:
            out.append(a)
    return out


def serve_disaggregated(args) -> int:
    """`kvserve serve --prefill-replicas P --decode-replicas D`: both pools and the proxy in front."""
    from kvserve.fleet.launcher import LocalReplicas, RayReplicas, replica_argv
    from kvserve.config.default_model import default_model_path

    _logging(args.log_level)
    if args.prefill_replicas < 1 or args.decode_replicas < 1:
        raise ValueError("--prefill-replicas and --decode-replicas: give both, each at least 1")
    if args.data_parallel_size > 1 or args.kv_role != "both":
        raise ValueError("--prefill-replicas / --decode-replicas give each pool its role and size: leave "
                         "--data-parallel-size and --kv-role out")
    from kvserve.kv.tiers import split_tier_specs
    tiers = [t for t in split_tier_specs(args.kv_tiers) or () if t.startswith(("disk:", "redis://"))]
    if args.kv_transfer == "store" and not tiers:
        raise ValueError("the pools need a way to move the prompt's KV: --kv-transfer stream, or a shared "
                         "--kv-tiers redis://HOST:PORT (disk:/path:SIZE on one machine)")
    backend = args.distributed_executor_backend
    if args.ray_placement_strategy is not None and backend != "ray":
        raise ValueError("--ray-placement-strategy places replicas on a Ray cluster: give it with "
                         "--distributed-executor-backend ray")
    replica_flags = ArgumentParser()
    add_cli_args(replica_flags)
    argv = replica_argv(args, replica_flags)
    n = args.prefill_replicas + args.decode_replicas
    env = {}
    if not args.engine_threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))   # no oversubscription
    signal.signal(signal.SIGTERM, _sigterm_exit)
    pools = []
    try:
        for role, size in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
            pool_argv = _side_argv(argv, role) + ["--kv-role", role]
            if backend == "ray":
                pools.append(RayReplicas(size, pool_argv, env, num_cpus=args.ray_replica_num_cpus,
                                         strategy=args.ray_placement_strategy,
                                         ranks=args.tensor_parallel_size * args.pipeline_parallel_size))
            else:
                pools.append(LocalReplicas(size, pool_argv, env=env))
        for pool in pools:
            pool.wait_healthy()
        args.prefill, args.decode = ",".join(pools[0].urls), ",".join(pools[1].urls)
        args.model = args.model or str(default_model_path())
        args.policy, args.health_interval = args.router_policy, args.router_health_interval
        args.cb_failure_threshold = args.router_cb_failure_threshold
        args.cb_timeout_duration_secs = args.router_cb_timeout_duration_secs
        return cmd_proxy(args)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for pool in pools:
            pool.stop(timeout=args.shutdown_timeout)
        log.info("stopped the proxy, %d prefill and %d decode replicas", args.prefill_replicas,
                 args.decode_replicas)


def cmd_proxy(args) -> int:
    """`kvserve proxy --prefill URLS --decode URLS`: disaggregated prefill/decode (dist/pd_proxy.py)."""
    import uvicorn

    from kvserve.fleet.pd_proxy import build_proxy_app, make_proxy

    _logging(args.log_level)
    prefill = [u.strip() for u in args.prefill.split(",") if u.strip()]
    decode = [u.strip() for u in args.decode.split(",") if u.strip()]
    hasher = build_hasher(args.model, args.block_size, args.chat_template)
    app = build_proxy_app(make_proxy(prefill, decode, hasher, args.policy, args.health_interval,
                                     args.cb_failure_threshold, args.cb_timeout_duration_secs))
    log.info("disaggregated serving on http://%s:%d: prefill %s, decode %s", args.host, args.port,
             ", ".join(prefill), ", ".join(decode))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False))
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0 if server.started else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("router", help="route OpenAI requests over kvserve replicas, cache-aware",
                              description=__doc__.splitlines()[0])
    add_router_args(p)
    p.set_defaults(func=cmd_router)
    q = subparsers.add_parser("proxy", help="disaggregated prefill/decode in front of --role prefill and "
                              "--role decode servers", description=cmd_proxy.__doc__)
    q.add_argument("--prefill", required=True, help="comma-separated URLs of `kvserve serve --role prefill`")
    q.add_argument("--decode", required=True, help="comma-separated URLs of `kvserve serve --role decode`")
    q.add_argument("--model", default=None, help="model path whose tokenizer computes routing keys")
    q.add_argument("--chat-template", default=None)
    q.add_argument("--block-size", type=int, default=16)
    q.add_argument("--policy", default="cache-aware", choices=POLICIES)
    q.add_argument("--health-interval", type=float, default=2.0)
    _add_breaker_args(q, "")
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=8000)
    q.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    q.set_defaults(func=cmd_proxy)


if __name__ == "__main__":
    parser = ArgumentParser(prog="kvserve router")
    add_router_args(parser)
    sys.exit(cmd_router(parser.parse_args()))
