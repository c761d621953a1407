"""The planner's commands that run the real engine (split out of cli.py, which registers them):
`plan step --calibrate` (fit the step model on the engine, `--save-fit` to keep it), `plan roofline
--engine` (measured steps on the chart of this machine) and `plan budget --itl-ms` (seed 003's
largest budget that meets an ITL target, from a saved fit or the analytic step model)."""
from __future__ import annotations

from .cli_common import _add_hw, _add_model, _hw, _step_model, kv_table, table

ENGINE_HINT = "needs the kvserve engine (from kvserve import LLM)"


def _engine_kwargs(args) -> dict:
    if getattr(args, "engine_threads", None):   # 1 is robust on a shared CPU (no barrier stalls)
        import torch
        torch.set_num_threads(args.engine_threads)
    kw = {"enable_prefix_caching": False}
    if getattr(args, "engine_dtype", None):
        kw["dtype"] = args.engine_dtype
    return kw


def calibrate(args) -> int:
    """`plan step --calibrate MODEL`: time the engine's steps, fit, print, optionally plot and save."""
    from .stepmodel import calibrate_engine
    try:
        fit, samples = calibrate_engine(args.calibrate, batch_sizes=tuple(args.calibrate_batches),
                                        prompt_lens=tuple(args.calibrate_prompts), n_decode=args.calibrate_decode,
                                        repeats=args.calibrate_repeats, engine_kwargs=_engine_kwargs(args),
                                        trim=args.calibrate_trim, per_seq=args.calibrate_per_seq)
    except ImportError as e:
        print(f"--calibrate {ENGINE_HINT}: {e}")
        return 2
    n_trim = sum(1 for s in samples if s.get("trimmed"))
    print(f"\ncalibration on {args.calibrate}: {len(samples)} engine steps "
          f"({fit.n_memory} memory-branch, {fit.n_compute} compute-branch"
          f"{f'; {n_trim} slower than {1 + args.calibrate_trim:g}x the fit left out' if n_trim else ''})")
    print(kv_table([("t_0 (ms)", fit.t0 * 1e3), ("t_W (ms)", fit.t_W * 1e3),
                    ("t_K per cached token (us)", fit.t_kv * 1e6), ("per-token cost (us)", fit.t_tok * 1e6)]
                   + ([("per-sequence cost (us)", fit.t_seq * 1e6)] if args.calibrate_per_seq else [])
                   + [("fit error, relative RMSE", fit.rel_rmse), ("fit error, max relative", fit.max_rel_err)]))
    if args.calibrate_plot:
        from .plots import plot_fit
        plot_fit(fit, samples, args.calibrate_plot)
        print(f"wrote {args.calibrate_plot}")
    if args.save_fit:
        from .calibrated import save_fit
        save_fit(fit, args.save_fit, model=args.calibrate, engine=_engine_kwargs(args), samples=len(samples))
        print(f"wrote {args.save_fit}")
    return 0


def add_calibrate_args(p) -> None:
    p.add_argument("--calibrate", default=None, metavar="MODEL",
                   help="time the real kvserve engine on MODEL and fit t_0, t_W, t_K, per-token cost")
    p.add_argument("--calibrate-plot", default=None)
    p.add_argument("--save-fit", default=None, metavar="FIT_JSON", help="write the fit (for --fit elsewhere)")
    p.add_argument("--calibrate-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--calibrate-prompts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--calibrate-decode", type=int, default=12, help="decode steps per configuration")
    p.add_argument("--calibrate-repeats", type=int, default=3)
    p.add_argument("--calibrate-per-seq", action="store_true",
                   help="fit a cost per scheduled sequence too, outside the max (t_seq)")
    p.add_argument("--calibrate-trim", type=float, default=None, metavar="F",
                   help="refit without steps slower than (1 + F) x the fit (other load only adds time)")
    p.add_argument("--engine-dtype", default=None, help="engine dtype for --calibrate (float32, bfloat16)")
    p.add_argument("--engine-threads", type=int, default=None, help="torch CPU threads for the engine")


def roofline_engine(args):
    """`plan roofline --engine MODEL`: measured ops of the engine and the measured hardware they ran on.
    Returns (hw, dtype, model spec, ops: each measured op followed by its analytic twin on the roof)."""
    import argparse

    from kvserve import LLM

    from .engine_measure import roofline_points
    budget = max([2048] + list(args.prefill))
    llm = LLM(model=args.engine, max_num_batched_tokens=budget, **_engine_kwargs(args))
    import os
    ops, spec, dtype = roofline_points(llm, args.prefill, args.batch, args.context,
                                       name=os.path.basename(os.path.normpath(args.engine)))
    hw = _hw(argparse.Namespace(measure=True, dtype=dtype))
    from .roofline import Op
    out = []
    for op in ops:
        out += [op, Op(op.name.replace("kvserve ", "model "), op.flops, op.bytes)]
    return hw, dtype, spec, out


def cmd_budget(args) -> int:
    """`plan budget --itl-ms X`: the largest token budget whose full step meets the ITL target."""
    from .calibrated import CalibratedStepModel, budget_for_itl, largest_budget, load_fit
    itl = args.itl_ms / 1e3
    ctx = args.context
    if args.fit:
        fit = load_fit(args.fit)
        sm, source = CalibratedStepModel(fit), f"calibrated fit {args.fit}"
        closed = budget_for_itl(fit, itl, args.decodes, ctx)
    else:
        sm, closed = _step_model(args), None
        source = f"step model: {sm.model.name} on {sm.hw.name}, MFU {args.mfu}, t_0 {args.t0_ms} ms"
    rows = []
    for target in ([itl] + [itl * f for f in (0.5, 2.0)]):
        c = largest_budget(sm, target, args.decodes, ctx)
        rows.append({"itl_target_ms": target * 1e3, "decodes": args.decodes, "context": ctx,
                     "largest_budget": c, "step_at_budget_ms": sm.step_time([ctx] * args.decodes,
                                                                           [(c - args.decodes, 0)]) * 1e3
                     if c > args.decodes else None})
    print(source)
    print(table(rows))
    if closed is not None:
        print(f"closed form from the fit, floor((ITL - t_0) / t_tok): {closed}")
    print(f"seed 003: take the largest budget that meets the ITL target -> --max-num-batched-tokens "
          f"{rows[0]['largest_budget']}")
    return 0


def register_budget(ps) -> None:
    p = ps.add_parser("budget", help="largest chunked-prefill token budget that meets an ITL target (seed 003)")
    _add_hw(p); _add_model(p)
    p.add_argument("--itl-ms", type=float, required=True, help="inter-token latency target, ms")
    p.add_argument("--fit", default=None, help="a fit saved by `plan step --calibrate ... --save-fit`")
    p.add_argument("--decodes", type=int, default=8, help="decoding sequences in the step")
    p.add_argument("--context", type=float, default=0.0, help="cached tokens per decoding sequence")
    p.add_argument("--mfu", type=float, default=0.5); p.add_argument("--t0-ms", type=float, default=0.3)
    p.set_defaults(func=cmd_budget)
