"""`kvserve plan ...` and `kvserve simulate ...`: the analysis toolkit on the command line.

Each subcommand prints a readable table and, with --plot PATH, writes a figure.
"""
from __future__ import annotations

import argparse
import math

from kvserve.config.cli_args import ArgumentParser

from . import kvmath, roofline
from .specs import HARDWARE, MODELS, HardwareSpec, dtype_bytes, get_hardware, get_model, measure_hardware

from .cli_common import GB, _add_hw, _add_model, _fmt, _hw, _step_model, kv_table, table  # noqa: F401


# -- plan ---------------------------------------------------------------------------------------------
def cmd_specs(args) -> int:
    print(table([{"preset": k, "name": h.name, "bf16_TFLOPs": h.flops.get("bf16", 0) / 1e12,
                  "fp32_TFLOPs": h.flops.get("fp32", 0) / 1e12, "bandwidth_TB/s": h.bandwidth / 1e12,
                  "memory_GB": h.memory / GB, "ridge_bf16": h.ridge_point("bf16")} for k, h in HARDWARE.items()]))
    print()
    print(table([{"preset": k, "name": m.name, "params_B": m.n_params / 1e9, "layers": m.n_layers,
                  "d_model": m.d_model, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.head_dim,
                  "KV_KiB/token": kvmath.kv_bytes_per_token(m) / 1024} for k, m in MODELS.items()]))
    if args.measure:
        _hw(argparse.Namespace(measure=True, dtype="fp32"))
    return 0


def cmd_roofline(args) -> int:
    ops = [roofline.vector_op(1_000_000, dtype="fp32")]
    if args.vector_time:
        ops[0] = ops[0].timed(args.vector_time)
    if args.engine:   # kvserve's measured steps on the measured roofline of this machine
        from .cli_engine import roofline_engine
        hw, args.dtype, m, engine_ops = roofline_engine(args)
        ops += engine_ops
    else:
        hw, m = _hw(args), get_model(args.model)
    P, Bw = hw.peak(args.dtype), hw.bandwidth
    for n in args.matmul:
        ops.append(roofline.matmul(n, n, n, args.dtype))
    for b in ([] if args.engine else args.batch):
        ops.append(roofline.decode_step(m, b, args.context, args.dtype, args.kv_dtype))
    for t in ([] if args.engine else args.prefill):
        ops.append(roofline.prefill_step(m, t, args.dtype, args.kv_dtype))
    print(f"{hw.name} {args.dtype}: peak {P / 1e12:.3g} TFLOP/s, bandwidth {Bw / 1e12:.3g} TB/s, "
          f"ridge point {P / Bw:.2f} FLOP/byte")
    rows = []
    for op in ops:
        att = roofline.attainable(op.intensity, P, Bw)
        rows.append({"op": op.name, "GFLOP": op.flops / 1e9, "GB moved": op.bytes / GB,
                     "FLOP/byte": op.intensity, "bound": roofline.bound(op, P, Bw),
                     "attainable_TFLOP/s": att / 1e12, "min_time_ms": roofline.min_time(op, P, Bw) * 1e3,
                     "achieved_GFLOP/s": op.achieved / 1e9 if op.achieved else None,
                     "of_roof": op.achieved / att if op.achieved else None})
    timed = any(op.achieved for op in ops)   # the measured columns only when something was timed
    print(table(rows, [c for c in rows[0] if timed or c not in ("achieved_GFLOP/s", "of_roof")]))
    if args.plot:
        roofline.plot_roofline(hw, ops, args.plot, args.dtype, f"Roofline: {hw.name} ({args.dtype}), {m.name}")
        print(f"wrote {args.plot}")
    return 0


def cmd_kv(args) -> int:
    m = get_model(args.model)
    per = kvmath.kv_bytes_per_token(m, args.kv_dtype)
    pairs = [("model", m.name), ("KV bytes / token", int(per)), ("KV KiB / token", per / 1024),
             (f"KV GiB / sequence of {args.seq_len}", kvmath.kv_cache_bytes(m, args.seq_len, 1, args.kv_dtype) / 2**30),
             (f"KV GB / sequence of {args.seq_len}", kvmath.kv_cache_bytes(m, args.seq_len, 1, args.kv_dtype) / GB),
             (f"KV GB / batch of {args.batch}", kvmath.kv_cache_bytes(m, args.seq_len, args.batch, args.kv_dtype) / GB),
             (f"weights GB ({args.dtype})", m.weight_bytes(args.dtype) / GB),
             ("attention overtakes linear at T >", kvmath.attention_crossover_tokens(m.d_model)),
             ("decode attention FLOP/byte", kvmath.decode_attention_intensity(m, args.kv_dtype))]
    if args.budget_gib is not None:
        budget = args.budget_gib * 2**30
    else:
        hw = get_hardware(args.hw)
        budget = kvmath.kv_budget(hw.memory, m, args.n_gpu, args.dtype, args.gpu_memory_utilization)
        pairs.append((f"KV budget GiB ({args.n_gpu} x {hw.name}, {args.gpu_memory_utilization:.0%})", budget / 2**30))
    pairs += [(f"contexts of {args.seq_len} that fit", kvmath.contexts_that_fit(budget, args.seq_len, m, args.kv_dtype))]
    if m.kv_lora_rank:        # multi-head latent attention: what full per-head K and V would take
        full = kvmath.kv_bytes_per_token(m, args.kv_dtype, full_kv=True)
        pairs += [("MLA: latent + RoPE part / token", f"{m.kv_lora_rank} + {m.qk_rope_head_dim} per layer"),
                  ("KV bytes / token with full K/V", int(full)),
                  ("MLA saving (full K/V / latent)", full / per),
                  (f"contexts of {args.seq_len} that fit with full K/V", int(budget // (full * args.seq_len)))]
    pairs.append((f"paging waste / seq (blocks of {args.block_size})", kvmath.paging_waste_slots(args.block_size)))
    print(kv_table(pairs))
    return 0


def cmd_ceiling(args) -> int:
    hw = get_hardware(args.hw)
    bw = args.bw_tbs * 1e12 if args.bw_tbs else hw.bandwidth
    m = get_model(args.model)
    n_params = args.params or m.n_params
    # a mixture of experts' active parameters, experts and top-k: the flags, else its config.json's
    active, experts, top_k = args.active_params or m.n_active, args.experts or m.n_experts, args.top_k or m.top_k
    wb = n_params * dtype_bytes(args.dtype)
    rows = []
    for b in args.batch:
        row = {"batch": b, "seq_len": args.seq_len,
               "weights_only_tok/s": kvmath.decode_ceiling_weights_only(n_params, bw, args.dtype, b),
               "weights+KV_tok/s": kvmath.decode_ceiling_tps(wb, bw, b, args.seq_len, m, args.kv_dtype),
               "KV/weights bytes": kvmath.kv_cache_bytes(m, args.seq_len, b, args.kv_dtype) / wb}
        if active:   # a mixture of experts reads only the weights its tokens route to
            read = kvmath.moe_params_read(n_params, active, b, experts, top_k)
            row["MoE_params_read_B"] = read / 1e9
            row["MoE_weights_only_tok/s"] = kvmath.moe_decode_ceiling(n_params, active, bw, args.dtype,
                                                                      b, experts, top_k)
            row["MoE_weights+KV_tok/s"] = kvmath.decode_ceiling_tps(read * dtype_bytes(args.dtype), bw, b,
                                                                    args.seq_len, m, args.kv_dtype)
        rows.append(row)
    print(f"{n_params / 1e9:.3g}B parameters in {args.dtype} ({wb / GB:.1f} GB), {bw / 1e12:.3g} TB/s")
    if active and not (experts and top_k):
        print(f"MoE: {active / 1e9:.3g}B active parameters read per step at every batch "
              "(give --experts and --top-k for the experts a batch's tokens touch)")
    print(table(rows))
    return 0


def cmd_little(args) -> int:
    r = kvmath.fleet_throughput(args.concurrency, args.output_tokens, args.tpot_ms / 1e3)
    print(kv_table([("concurrency L", args.concurrency), ("time in system W (s)", r["latency_s"]),
                    ("requests / s (lambda = L / W)", r["requests_per_s"]),
                    ("output tokens / s", r["tokens_per_s"])]))
    return 0


def cmd_step(args) -> int:
    hw = _hw(args)
    sm = _step_model(args, hw)
    ctx = args.T_in + args.T_out / 2
    print(kv_table([
        ("model / hardware", f"{sm.model.name} on {args.n_gpu} x {hw.name} ({args.dtype})"),
        ("t_W weight read (ms)", sm.t_W * 1e3), (f"t_K cache read at T={ctx:.0f} (ms)", sm.t_K(ctx) * 1e3),
        (f"t_F arithmetic at T={ctx:.0f} (ms)", sm.t_F(ctx) * 1e3), ("t_N weight arithmetic (ms)", sm.t_N * 1e3),
        ("t_0 overhead (ms)", sm.t0 * 1e3), ("knee B* (t_K = 0)", sm.knee_batch(0)),
        (f"knee B* at T={ctx:.0f}", sm.knee_batch(ctx)),
        (f"prefill of {args.T_in} tokens at MFU {args.mfu} (ms)", sm.prefill_time(args.T_in) * 1e3)]))
    print()
    rows = []
    for b in args.batch:
        w = sm.workload(b, args.T_in, args.T_out)
        rows.append({"batch": b, "ttft_ms": w["ttft_s"] * 1e3, "tpot_ms": w["tpot_s"] * 1e3,
                     "ttlt_s": w["ttlt_s"], "tokens/s": w["tokens_per_s"], "bound": w["bound"],
                     "chunk budget C*": sm.chunk_budget(b, ctx)})
    print(table(rows))
    if args.plot:
        from .plots import plot_step_times
        bs = sorted({int(round(2 ** (k / 4))) for k in range(0, 45)})
        plot_step_times(sm, bs, [0, args.T_in, 4 * args.T_in], args.plot, f"{sm.model.name} on {hw.name}")
        print(f"wrote {args.plot}")
    if args.calibrate:
        from .cli_engine import calibrate
        return calibrate(args)
    return 0


def cmd_preempt(args) -> int:
    from .disagg import recompute_time, swap_break_even_bw, swap_time, tier_reload_wins
    hw, m = get_hardware(args.hw), get_model(args.model)
    be = swap_break_even_bw(m, hw, args.mfu, args.dtype, args.kv_dtype)
    tier = tier_reload_wins(m, hw, args.link_gbs * GB, args.n_gpu, args.mfu, args.dtype, args.kv_dtype)
    print(kv_table([
        ("swap/recompute break-even (GB/s per GPU)", be / GB),
        (f"swap {args.tokens} tokens at {args.link_gbs} GB/s (ms)",
         swap_time(m, args.tokens, args.link_gbs * GB, args.n_gpu, args.kv_dtype) * 1e3),
        (f"recompute {args.tokens} tokens (ms)", recompute_time(m, hw, args.tokens, args.n_gpu, args.mfu, args.dtype) * 1e3),
        ("cheaper", "swap" if args.link_gbs * GB > be else "recompute"),
        ("tier reload break-even (GB/s per replica)", tier["break_even_bw"] / GB),
        (f"reload from a {args.link_gbs} GB/s tier wins", tier["reload_wins"])]))
    return 0


def cmd_disagg(args) -> int:
    from .disagg import disagg_plan, prefill_time, streamed_transfer_left, transfer_fraction, transfer_time
    hw, m = get_hardware(args.hw), get_model(args.model)
    link = args.link_gbs * GB
    t_x = transfer_time(m, args.T_in, link, args.kv_dtype)
    t_p = args.prefill_ms / 1e3 if args.prefill_ms else prefill_time(m, hw, args.T_in, args.n_gpu, args.mfu, args.dtype)
    chunk = min(args.chunk or args.T_in, args.T_in)
    left = streamed_transfer_left(t_x, t_p, m.n_layers, (args.T_in - (math.ceil(args.T_in / chunk) - 1) * chunk) / args.T_in)
    print(kv_table([
        ("KV transfer / prefill (attention ignored)", transfer_fraction(m, hw, link, args.n_gpu, args.mfu, args.dtype)),
        (f"KV of a {args.T_in}-token prompt (GB)", kvmath.kv_cache_bytes(m, args.T_in, 1, args.kv_dtype) / GB),
        ("transfer time (ms)", t_x * 1e3),
        ("prefill time (ms)" + (", measured" if args.prefill_ms else ""), t_p * 1e3),
        ("layer-wise streaming: transfer left on TTFT (ms)", left * 1e3),
        ("layer-wise streaming: TTFT it hides (ms)", (t_x - left) * 1e3)]))
    if args.rate:
        p = disagg_plan(args.rate, args.T_in, args.T_out, m, hw, link, args.ttft_ms / 1e3, args.tpot_ms / 1e3,
                        mfu=args.mfu, max_util=args.max_util, c_half=args.c_half, n_gpu=args.n_gpu,
                        t0=args.t0_ms / 1e3)
        print()
        print(table([p["disaggregated"].row(), p["collocated"].row()]))
        d = p["disaggregated"].detail
        print(f"\ndisaggregated: {d['prefill_replicas']} prefill + {d['decode_replicas']} decode replicas "
              f"(decode batch {d['decode_batch']}); collocated: {p['collocated'].detail}")
        print(f"winner: {p['winner']} -- {p['why']}")
    return 0


def cmd_pipeline(args) -> int:
    from .pipeline import bubble_fraction, measured_bubble, pipeline_speedup
    rows = [("bubble (share of each stage's time idle)", bubble_fraction(args.stages, args.microbatches)),
            ("throughput vs one process on one stage's device",
             pipeline_speedup(args.stages, args.microbatches, args.handoff_frac))]
    if args.measured_tok_s and args.one_device_tok_s:
        rows.append(("measured bubble (hand-offs included)",
                     measured_bubble(args.measured_tok_s, args.one_device_tok_s, args.stages)))
    print(kv_table(rows))
    return 0


# -- wiring -------------------------------------------------------------------------------------------
def register(subparsers) -> None:
    """Add `plan` and `simulate` to the kvserve CLI."""
    plan = subparsers.add_parser("plan", help="size a deployment with the seeds' closed forms")
    ps = plan.add_subparsers(dest="plan_command", required=True)

    p = ps.add_parser("specs", help="list hardware and model presets")
    p.add_argument("--measure", action="store_true")
    p.set_defaults(func=cmd_specs)

    p = ps.add_parser("roofline", help="roofline of a device with ops as points (seed 000)")
    _add_hw(p); _add_model(p)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64, 256], help="decode batch sizes")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per decoding sequence")
    p.add_argument("--prefill", type=int, nargs="*", default=[512, 4096], help="prefill lengths")
    p.add_argument("--matmul", type=int, nargs="*", default=[], help="square matmul sizes N")
    p.add_argument("--vector-time", type=float, default=None, help="measured seconds of the 1M vector add")
    p.add_argument("--engine", default=None, metavar="MODEL",
                   help="run kvserve on MODEL and place its measured prefill (--prefill) and decode (--batch, "
                        "--context) steps on this machine's measured roofline")
    p.add_argument("--engine-dtype", default=None, help="engine dtype for --engine (float32, bfloat16)")
    p.add_argument("--engine-threads", type=int, default=None, help="torch CPU threads for --engine")
    p.add_argument("--plot", default=None, help="write the roofline PNG here")
    p.set_defaults(func=cmd_roofline)

    p = ps.add_parser("kv", help="KV bytes per token / sequence / batch and contexts that fit (seed 001)")
    _add_model(p)
    p.add_argument("--hw", default="h100"); p.add_argument("--n-gpu", type=int, default=1)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seq-len", type=int, default=8192); p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budget-gib", type=float, default=None, help="KV budget (default: from --hw memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.set_defaults(func=cmd_kv)

    p = ps.add_parser("ceiling", help="decode tokens/s ceilings, weights only and weights + KV (seed 001)")
    _add_model(p)
    p.add_argument("--hw", default="a100"); p.add_argument("--bw-tbs", type=float, default=None)
    p.add_argument("--params", type=float, default=None, help="parameter count (default: the model's)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 32]); p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--active-params", type=float, default=None,
                   help="mixture of experts: parameters active per token (trunk + top-k experts; default: from the model's config.json)")
    p.add_argument("--experts", type=int, default=None, help="MoE: experts per layer")
    p.add_argument("--top-k", type=int, default=None, help="MoE: experts routed per token")
    p.set_defaults(func=cmd_ceiling)

    p = ps.add_parser("little", help="Little's law throughput (seed 001 exercise 4)")
    p.add_argument("--concurrency", type=float, default=40); p.add_argument("--output-tokens", type=float, default=1000)
    p.add_argument("--tpot-ms", type=float, default=25)
    p.set_defaults(func=cmd_little)

    p = ps.add_parser("step", help="seed 003's step-time model: t_W, t_K, t_F, knee, C*, TTFT/TPOT")
    _add_hw(p); _add_model(p)
    p.add_argument("--mfu", type=float, default=0.5); p.add_argument("--t0-ms", type=float, default=0.3)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32, 128, 256, 512])
    p.add_argument("--T-in", type=int, default=1000); p.add_argument("--T-out", type=int, default=250)
    p.add_argument("--plot", default=None)
    from .cli_engine import add_calibrate_args, register_budget
    add_calibrate_args(p)
    p.set_defaults(func=cmd_step)
    register_budget(ps)

    p = ps.add_parser("preempt", help="swap vs recompute break-even, KV tier reload (seed 003)")
    _add_model(p); p.add_argument("--hw", default="h100"); p.add_argument("--dtype", default="bf16")
    p.add_argument("--n-gpu", type=int, default=1); p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=32000); p.add_argument("--link-gbs", type=float, default=25)
    p.set_defaults(func=cmd_preempt)

    p = ps.add_parser("disagg", help="KV transfer cost and prefill/decode pool sizing (seed 003)")
    _add_model(p); p.add_argument("--hw", default="h100"); p.add_argument("--dtype", default="bf16")
    p.add_argument("--n-gpu", type=int, default=1); p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--link-gbs", type=float, default=50, help="KV link bytes/s of a replica, GB/s")
    p.add_argument("--T-in", type=int, default=2000); p.add_argument("--T-out", type=int, default=200)
    p.add_argument("--rate", type=float, default=None, help="requests/s to size pools for")
    p.add_argument("--ttft-ms", type=float, default=1000); p.add_argument("--tpot-ms", type=float, default=50)
    p.add_argument("--max-util", type=float, default=0.8); p.add_argument("--c-half", type=float, default=256)
    p.add_argument("--t0-ms", type=float, default=0.0)
    p.add_argument("--prefill-ms", type=float, default=None, help="a measured prefill time (default: the roofline's)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per prefill step (max_num_batched_tokens; "
                   "default: the whole prompt in one step)")
    p.set_defaults(func=cmd_disagg)

    p = ps.add_parser("pipeline", help="pipeline parallelism's bubble for P stages and M micro-batches (seed 004)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches in flight per step (kvserve: 1)")
    p.add_argument("--handoff-frac", type=float, default=0.0,
                   help="a hand-off's time as a fraction of a stage's work per micro-batch")
    p.add_argument("--measured-tok-s", type=float, default=None, help="the pipeline's measured tokens/s")
    p.add_argument("--one-device-tok-s", type=float, default=None,
                   help="one process's tokens/s on one stage's device (here: one thread)")
    p.set_defaults(func=cmd_pipeline)

    from .cli_simulate import register as register_simulate
    register_simulate(subparsers)


def main(argv=None) -> int:
    """Run `plan` / `simulate` without the rest of the kvserve CLI (python -m kvserve.analysis.cli)."""
    parser = ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
