"""`kvserve serve [MODEL]`: one server (kvserve/server/cli.py), or with `--data-parallel-size N`
N replicas behind the cache-aware router (kvserve/fleet/router_cli.py), with the same engine
and server flags. vLLM's `vllm serve MODEL` spelling: MODEL is --model."""
from __future__ import annotations

import argparse
import os

from kvserve.config.placement import STRATEGIES
from kvserve.fleet.router_cli import add_policy_args, serve_data_parallel, serve_disaggregated
from kvserve.server.cli import add_cli_args
from kvserve.server.cli import cmd_serve as serve_one


def register(subparsers) -> None:
    s = subparsers.add_parser("serve", help="serve a model over the OpenAI API",
                              description="load a model and serve it over the OpenAI API "
                                          "(N replicas behind a router with --data-parallel-size N)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`kvserve serve`: one server's flags (server/cli.py) and those of data parallelism. Replicas
    get the former only (a parser of server/cli.py's flags alone picks them out); the MODEL
    positional (vLLM's `vllm serve MODEL`) reaches them as --model (`model_from_positional`)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as --model takes it (give one of the two)")
    add_cli_args(p)
    g = p.add_argument_group("data parallel (kvserve/fleet/router_cli.py)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="serve N replicas of the engine behind a cache-aware router "
                        "(--distributed-executor-backend ray: as Ray actors)")
    g.add_argument("--ray-replica-num-cpus", type=float, default=1.0,
                   help="Ray: CPUs each replica actor reserves (with --ray-placement-strategy: "
                        "each of its ranks)")
    g.add_argument("--ray-placement-strategy", default=None, choices=STRATEGIES,
                   help="Ray: place each replica's tensor-parallel / pipeline ranks in a placement "
                        "group of this strategy, one bundle per rank (kvserve/config/placement.py); "
                        "a router is put in front even of one replica")
    add_policy_args(g, "router-")
    d = p.add_argument_group("disaggregated prefill/decode pools (kvserve/fleet/router_cli.py)")
    d.add_argument("--prefill-replicas", type=int, default=0,
                   help="serve a pool of N `--role prefill` replicas and one of --decode-replicas `--role "
                        "decode` replicas behind `kvserve proxy` (with --distributed-executor-backend ray: "
                        "placed on the Ray cluster's nodes)")
    d.add_argument("--decode-replicas", type=int, default=0, help="the decode pool's replicas (see --prefill-replicas)")


def model_from_positional(args) -> None:
    """`kvserve serve MODEL`: MODEL becomes args.model (so replicas get it as --model);
    ValueError when --model names another one."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and os.path.normpath(args.model) != os.path.normpath(tag):
        raise ValueError(f"the model is given twice, as MODEL ({tag!r}) and as --model ({args.model!r}): "
                         "give one of them")
    args.model = tag


def cmd_serve(args) -> int:
    """One server (server/cli.py), or N replicas behind the router with --data-parallel-size N."""
    model_from_positional(args)
    if args.prefill_replicas or args.decode_replicas:
        return serve_disaggregated(args)
    if args.data_parallel_size > 1 or args.ray_placement_strategy is not None:
        return serve_data_parallel(args)
    return serve_one(args)
