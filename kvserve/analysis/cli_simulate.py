"""`kvserve simulate ...`: the seeded scheduling, paging and prefix-cache simulators on the command line
(split out of cli.py, which registers it)."""
from __future__ import annotations

import math

from .cli_common import _add_hw, _add_model, _hw, table
from .specs import get_model


# -- simulate -----------------------------------------------------------------------------------------
def cmd_sim_batching(args) -> int:
    from .simulate import batching_experiment, static_utilization_theory
    res = {r: batching_experiment(r, args.requests, args.slots, args.mean_output, args.seed) for r in args.rate}
    rows = []
    for rate, runs in res.items():
        for pol, run in runs.items():
            rows.append({"rate/step": rate, "policy": pol, "utilisation": run["utilization"],
                         "mean_wait": run["mean_wait"], "p99_wait": run["p99_wait"],
                         "admitted_at_once": run["frac_admitted_at_once"], "total_steps": run["total_steps"]})
    print(f"{args.requests} requests, {args.slots} slots, exponential outputs of mean {args.mean_output} steps; "
          f"static saturates at 1/H_{args.slots} = {static_utilization_theory(args.slots):.1%}")
    print(table(rows))
    if args.plot:
        from .plots import plot_batching
        plot_batching(res, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_sim_serving(args) -> int:
    from .simulate import make_requests, simulate_serving
    from .stepmodel import StepModel
    if args.fit:   # the step model calibrated on the engine (plan step --calibrate ... --save-fit)
        from .calibrated import CalibratedStepModel, load_fit
        sm = CalibratedStepModel(load_fit(args.fit))
        what = f"calibrated fit {args.fit}"
    else:
        sm = StepModel(get_model(args.model), _hw(args), args.n_gpu, args.dtype, args.kv_dtype, mfu=args.mfu,
                       t0=args.t0_ms / 1e3)
        what = f"{sm.model.name} on {sm.hw.name}, MFU {args.mfu}, t_0 {args.t0_ms} ms"
    reqs = make_requests(args.requests, args.rate, args.mean_prompt, args.mean_output, args.seed,
                         args.max_prompt, args.max_output)
    runs = [("static", "static", None), ("continuous", "continuous", None)] + [
        (f"chunked {b}", "chunked", b) for b in args.budget]
    rows = []
    for name, pol, b in runs:
        s = simulate_serving(reqs, sm, args.slots, pol, b)
        rows.append({"policy": name, "finished": s["finished"], "ttft_p50_s": s["ttft_p50_s"],
                     "ttft_p99_s": s["ttft_p99_s"], "itl_p50_ms": s["itl_p50_s"] * 1e3,
                     "itl_p99_ms": s["itl_p99_s"] * 1e3, "longest_gap_s": s["longest_gap_s"],
                     "slot_util": s["utilization"], "tok/s": s["output_tokens_per_s"], "makespan_s": s["makespan_s"]})
    print(f"{args.requests} requests at {args.rate}/s on {args.slots} slots, prompts ~{args.mean_prompt}, "
          f"outputs ~{args.mean_output} tokens; {what}")
    print(table(rows))
    if args.plot:
        from .plots import plot_serving
        plot_serving(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_sim_paging(args) -> int:
    from .paging import simulate_paging, widget_trace
    tr = widget_trace(args.seed, n_steps=max(args.steps))
    rows, plot_runs = [], {}
    for n in args.samples:
        for steps in args.steps:
            for pol in ("reserve", "paged", "shared"):
                r = simulate_paging(tr, pol, n, memory_slots=args.memory, block_size=args.block_size, n_steps=steps)
                rows.append({"samples": n, "step": steps, "policy": pol, "running_seqs": r["running_sequences"],
                             "running_reqs": r["running_requests"], "finished": r["finished"],
                             "rejected": r["rejected"], "preemptions": r["preemptions"],
                             "token_share": r["token_share"]})
                if steps == max(args.steps):
                    plot_runs[f"{pol}, n={n}"] = r
    print(f"toy memory of {args.memory} token slots, blocks of {args.block_size}, seed {args.seed}")
    print(table(rows))
    if args.plot:
        from .plots import plot_paging
        plot_paging(plot_runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_sim_prefix(args) -> int:
    from .prefix import chat_trace, hit_rate_curve
    tr = chat_trace(args.conversations, seed=args.seed)
    pools = [float(p) for p in args.pools] + [math.inf]
    rows = hit_rate_curve(tr, pools, args.block_size)
    print(f"{args.conversations} conversations, {len(tr)} prompts, "
          f"{sum(len(p) for p, _ in tr):,} prompt tokens")
    print(table(rows))
    if args.plot:
        from .plots import plot_prefix
        plot_prefix(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def register(subparsers) -> None:
    """Add `simulate` to the kvserve CLI."""
    sim = subparsers.add_parser("simulate", help="seeded scheduling, paging and prefix-cache simulators")
    ss = sim.add_subparsers(dest="sim_command", required=True)

    p = ss.add_parser("batching", help="static vs continuous batching on slots (seed 003)")
    p.add_argument("--rate", type=float, nargs="*", default=[0.03, 0.12], help="arrivals per step")
    p.add_argument("--requests", type=int, default=1000); p.add_argument("--slots", type=int, default=32)
    p.add_argument("--mean-output", type=float, default=200); p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=cmd_sim_batching)

    p = ss.add_parser("serving", help="static / continuous / chunked prefill timed by the step model (seed 003)")
    _add_hw(p); _add_model(p)
    p.add_argument("--mfu", type=float, default=0.5); p.add_argument("--t0-ms", type=float, default=0.3)
    p.add_argument("--slots", type=int, default=8); p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=6.0, help="requests per second")
    p.add_argument("--mean-prompt", type=float, default=1500); p.add_argument("--mean-output", type=float, default=150)
    p.add_argument("--budget", type=int, nargs="*", default=[64, 512, 4096], help="chunked-prefill token budgets")
    p.add_argument("--seed", type=int, default=0); p.add_argument("--plot", default=None)
    p.add_argument("--fit", default=None, help="time steps with a fit saved by `plan step --calibrate --save-fit`")
    p.add_argument("--max-prompt", type=int, default=None); p.add_argument("--max-output", type=int, default=None)
    p.set_defaults(func=cmd_sim_serving)

    p = ss.add_parser("paging", help="reserve vs paged vs shared KV memory with preemption (seed 003)")
    p.add_argument("--samples", type=int, nargs="*", default=[1, 4]); p.add_argument("--steps", type=int, nargs="*",
                                                                                     default=[160, 320])
    p.add_argument("--memory", type=int, default=1024); p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0); p.add_argument("--plot", default=None)
    p.set_defaults(func=cmd_sim_paging)

    p = ss.add_parser("prefix", help="prefix-cache hit rate vs pool size, hash chain vs radix (seed 003)")
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--pools", type=float, nargs="*", default=[4000, 8000, 16000, 32000, 64000, 128000])
    p.add_argument("--block-size", type=int, default=16); p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=cmd_sim_prefix)

