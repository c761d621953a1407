"""What "exact" means per path on a quantized GGUF file: the dequantized reference
(`quantization="dequant"`, every tensor dequantized to float32) against the native quantized paths,
under each CPU capability, and the native paths across capabilities.

Each (capability, path) is a fresh subprocess with bench_cpu_paths.ENV's environment
(ATEN_CPU_CAPABILITY, the BLAS libraries capped to the same ISA). Paths:
  dequant        quantization="dequant", float32, all prompts at once (the reference)
  native         the file's own types, one sequence per step: decode on kvserve's fused step
                 (its int4 GEMV, `linear_int4`), prompts on torch's int4 kernel
  native_torch   the same with KVSERVE_KERNELS=torch: decode on torch's int4 kernel
  native_batch   the file's own types, all prompts at once (the serving shape): decode steps of
                 every sequence on torch's int4 kernel, prefill as the CPU's plan says
  dequant_bf16   quantization="dequant", dtype bfloat16 (host capability only)
  transformers   transformers loading the same GGUF (float32; host capability only): teacher-forced

Every path generates greedily (ignore_eos, logprobs=2) from the same chat prompts, then scores the
reference's tokens teacher-forced (prompt_logprobs over prompt + the reference's output). Reported
against the same capability's dequant run (and across capabilities, path by path): greedy
sequences identical, the first divergence, |logprob difference| of the chosen tokens over the
positions before the first divergence (the decode path, same context on both sides), the
reference's top-1 / top-2 margin at each divergence, and the teacher-forced |logprob difference|
and top-1 agreement over every reference position (the prompt path).

    python benchmarks/quant_exactness.py --out benchmarks/results/quant_exactness.json
    python benchmarks/quant_exactness.py --isas avx512_bf16 --paths dequant,native --prompts 3   # smoke
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "What is 17 times 23?",
    "Give three tips for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "What causes the seasons on Earth?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "What is the difference between weather and climate?",
]
PATHS = {
    "dequant": ({"quantization": "dequant"}, {}),
    "native": ({"max_num_seqs": 1, "max_num_batched_tokens": 256}, {}),
    "native_torch": ({"max_num_seqs": 1, "max_num_batched_tokens": 256}, {"KVSERVE_KERNELS": "torch"}),
    "native_batch": ({}, {}),
    "dequant_bf16": ({"quantization": "dequant", "dtype": "bfloat16"}, {}),
}
HOST_ONLY = ("dequant_bf16", "transformers")
THREADS = 2


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# child: one (capability, path) run


def chosen(entries, tokens):
    """(logprob of each chosen token, top-1 minus top-2 logprob) from logprobs=2 entries."""
    lps, margins = [], []
    for e, t in zip(entries, tokens):
        lps.append(e[t].logprob)
        top = sorted((lp.logprob for lp in e.values()), reverse=True)
        margins.append(top[0] - top[1] if len(top) > 1 else None)
    return lps, margins


def child_kvserve(args, ref) -> dict:
    import torch
    from kvserve import LLM, SamplingParams, kernels
    from kvserve.model.quant.cpu_paths import kernel_plan

    kwargs, _ = PATHS[args.path]
    llm = LLM(args.model, max_model_len=512, kv_cache_memory=64 << 20, **kwargs)
    gen = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    t0 = time.perf_counter()
    if ref is None:
        convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:args.prompts]]
        outs = llm.chat(convs, gen)
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in ref["prompt_ids"]], gen)
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    decode = [chosen(o.outputs[0].logprobs, t) for o, t in zip(outs, tokens)]
    gen_s = time.perf_counter() - t0
    # teacher-forced: the reference's tokens (our own for the reference) scored as a prompt
    forced = tokens if ref is None else ref["tokens"]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    scored = llm.generate([{"prompt_token_ids": p + f} for p, f in zip(prompt_ids, forced)], score)
    tf_lps, tf_ranks = [], []
    for p, f, o in zip(prompt_ids, forced, scored):
        entries = o.prompt_logprobs[len(p):]
        tf_lps.append([e[t].logprob for e, t in zip(entries, f)])
        tf_ranks.append([e[t].rank for e, t in zip(entries, f)])
    model = llm.engine.model
    layer = model.layers[0]
    return {"prompt_ids": prompt_ids, "tokens": tokens, "logprobs": [d[0] for d in decode],
            "margins": [d[1] for d in decode], "tf_logprobs": tf_lps, "tf_ranks": tf_ranks,
            "generate_s": round(gen_s, 2),
            "capability": torch.backends.cpu.get_cpu_capability(), "plan": kernel_plan().name,
            "kvserve_kernels": kernels.available(),
            "weights": {name: type(getattr(layer, name)).__name__ for name in ("qkv", "o", "gate_up", "down")},
            "embed": type(model.embed).__name__}


def child_transformers(args, ref) -> dict:
    """transformers loading the same GGUF (dequantized to float32): the reference's tokens
    teacher-forced, one full forward pass a prompt. (Its own greedy run equals the reference's
    tokens exactly when every forced token is its top 1; each new sequence length costs it
    seconds on this CPU, so it does not generate.)"""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tf_lps, tf_ranks = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p, f in zip(ref["prompt_ids"], ref["tokens"]):
            lp = model(torch.tensor([p + f])).logits[0, len(p) - 1:-1].float().log_softmax(-1)
            picked = lp.gather(1, torch.tensor(f)[:, None])[:, 0]
            tf_lps.append(picked.tolist())
            tf_ranks.append((1 + (lp > picked[:, None]).sum(1)).tolist())
    return {"prompt_ids": ref["prompt_ids"], "tokens": None, "tf_logprobs": tf_lps, "tf_ranks": tf_ranks,
            "generate_s": round(time.perf_counter() - t0, 2),
            "capability": torch.backends.cpu.get_cpu_capability(), "transformers": transformers.__version__}


def child(args) -> None:
    import torch

    torch.set_num_threads(THREADS)
    ref = json.loads(Path(args.ref).read_text()) if args.ref else None
    res = child_transformers(args, ref) if args.path == "transformers" else child_kvserve(args, ref)
    Path(args.child_out).write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# parent: the runs and their comparison


def run_child(isa: str, path: str, args, ref_file: str | None, out_file: str) -> dict:
    env_isa = _module("bench_cpu_paths").ENV[isa]
    env = {**os.environ, **env_isa, **(PATHS.get(path, ({}, {}))[1]),
           "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, __file__, "--child", "--isa", isa, "--path", path, "--model", args.model,
           "--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts), "--child-out", out_file]
    if ref_file:
        cmd += ["--ref", ref_file]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
    if out.returncode:
        raise RuntimeError(f"{isa} {path} failed:\n{out.stderr[-4000:]}")
    res = json.loads(Path(out_file).read_text())
    print(f"  {isa:12s} {path:13s} {time.perf_counter() - t0:6.1f} s  capability {res['capability']}"
          f"  plan {res.get('plan', '-')}  weights {res.get('weights', '-')}", flush=True)
    return res


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _stats(diffs: list[float]) -> dict:
    if not diffs:
        return {"n": 0, "max": None, "median": None}
    return {"n": len(diffs), "max": max(diffs), "median": statistics.median(diffs)}


def compare(ref: dict, got: dict) -> dict:
    """`got` against `ref` (both generated from ref's prompts): greedy identity, first divergences,
    decode-path |dlogprob| before them, teacher-forced |dlogprob| and top-1 agreement (when
    `got` scored ref's tokens)."""
    n = len(ref["tokens"])
    divs = [first_divergence(a, b) for a, b in zip(ref["tokens"], got["tokens"])]
    before = []
    for a, b, d in zip(ref["logprobs"], got["logprobs"], divs):
        end = len(a) if d is None else d
        before += [abs(x - y) for x, y in zip(a[:end], b[:end])]
    margins = [ref["margins"][i][d] for i, d in enumerate(divs)
               if d is not None and ref.get("margins") and d < len(ref["margins"][i])]
    out = {"identical": sum(d is None for d in divs), "of": n, "first_divergence": divs,
           "ref_margin_at_divergence": margins, "decode_abs_dlogprob_before_divergence": _stats(before)}
    return out


def teacher_forced(ref: dict, got: dict) -> dict:
    diffs = [abs(x - y) for a, b in zip(ref["tf_logprobs"], got["tf_logprobs"]) for x, y in zip(a, b)]
    ranks = [r for rs in got["tf_ranks"] for r in rs]
    return {"abs_dlogprob": _stats(diffs), "top1_agreement": sum(r == 1 for r in ranks) / len(ranks)}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}" if x < 1e-2 else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isas", default="avx512_bf16,avx512,avx2,default",
                    help="bench_cpu_paths.ENV entries; the first is the host's own")
    ap.add_argument("--paths", default="dequant,native,native_torch,native_batch,dequant_bf16,transformers")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--isa", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--ref", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from kvserve.config.default_model import default_model_path
        args.model = default_model_path()
    if args.child:
        return child(args)

    isas, paths = args.isas.split(","), args.paths.split(",")
    if "dequant" not in paths:
        paths = ["dequant"] + paths
    runs: dict[str, dict[str, dict]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, isa in enumerate(isas):
            ref_file = f"{tmp}/{isa}-dequant.json"
            runs[isa] = {"dequant": run_child(isa, "dequant", args, None, ref_file)}
            for path in paths:
                if path == "dequant" or (path in HOST_ONLY and i > 0):
                    continue
                runs[isa][path] = run_child(isa, path, args, ref_file, f"{tmp}/{isa}-{path}.json")
    host = isas[0]
    result = {"model": os.path.basename(args.model), "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/quant_exactness.py " + " ".join(sys.argv[1:]),
              "max_tokens": args.max_tokens, "prompts": QUESTIONS[:args.prompts], "threads": THREADS,
              "wall_s": round(time.perf_counter() - t0, 1),
              "runs": {isa: {p: {k: r[k] for k in ("capability", "plan", "kvserve_kernels", "weights",
                                                    "embed", "transformers", "generate_s") if k in r}
                             for p, r in rr.items()} for isa, rr in runs.items()},
              "against_dequant": {}, "across_isas": {}, "dequant_across_isas": {}}
    print(f"\n{result['model']}: {args.prompts} chat prompts, greedy, {args.max_tokens} tokens; "
          f"each path against the same capability's dequant run")
    print(f"{'capability':12s} {'path':13s} {'identical':>9s} {'first div':>16s} {'decode max':>10s} "
          f"{'median':>8s} {'forced max':>10s} {'median':>8s} {'top-1':>6s}")
    for isa, rr in runs.items():
        result["against_dequant"][isa] = {}
        for path, r in rr.items():
            if path == "dequant":
                continue
            c = compare(rr["dequant"], r) if r["tokens"] is not None else {
                "identical": None, "of": None, "first_divergence": [],
                "decode_abs_dlogprob_before_divergence": {"max": None, "median": None}}
            c["teacher_forced"] = teacher_forced(rr["dequant"], r)
            result["against_dequant"][isa][path] = c
            d, tf = c["decode_abs_dlogprob_before_divergence"], c["teacher_forced"]
            divs = sorted(x for x in c["first_divergence"] if x is not None)
            same = "-" if c["identical"] is None else f"{c['identical']} / {c['of']}"
            print(f"{isa:12s} {path:13s} {same:>9s} {str(divs):>16s} "
                  f"{fmt(d['max']):>10s} {fmt(d['median']):>8s} {fmt(tf['abs_dlogprob']['max']):>10s} "
                  f"{fmt(tf['abs_dlogprob']['median']):>8s} {tf['top1_agreement']:6.3f}")
    print(f"\nacross capabilities, each path's greedy tokens against {host}'s")
    for isa in isas[1:]:
        result["dequant_across_isas"][f"{isa}_vs_{host}"] = c = compare(runs[host]["dequant"], runs[isa]["dequant"])
        d = c["decode_abs_dlogprob_before_divergence"]
        print(f"{isa:12s} {'dequant':13s} {c['identical']:>4d} / {c['of']:<2d} "
              f"{str(sorted(x for x in c['first_divergence'] if x is not None)):>16s} "
              f"{fmt(d['max']):>10s} {fmt(d['median']):>8s}")
        for path in runs[isa]:
            if path == "dequant" or path not in runs[host] or runs[isa][path]["tokens"] is None:
                continue
            c = compare(runs[host][path], runs[isa][path])
            result["across_isas"].setdefault(path, {})[f"{isa}_vs_{host}"] = c
            d = c["decode_abs_dlogprob_before_divergence"]
            print(f"{isa:12s} {path:13s} {c['identical']:>4d} / {c['of']:<2d} "
                  f"{str(sorted(x for x in c['first_divergence'] if x is not None)):>16s} "
                  f"{fmt(d['max']):>10s} {fmt(d['median']):>8s}")
    # every pair of non-host capabilities for the native paths (avx512 vs avx2 and so on)
    for i, a in enumerate(isas[1:], 1):
        for b in isas[i + 1:]:
            for path in runs[b]:
                if path.startswith("native") and path in runs[a]:
                    c = compare(runs[a][path], runs[b][path])
                    result["across_isas"].setdefault(path, {})[f"{b}_vs_{a}"] = c
                    d = c["decode_abs_dlogprob_before_divergence"]
                    print(f"{b + ' vs ' + a:24s} {path:13s} {c['identical']:>4d} / {c['of']:<2d} "
                          f"{fmt(d['max']):>10s} {fmt(d['median']):>8s}")
    # the tokens of every run (the per-position logprobs stay out: they are what is summarised)
    result["tokens"] = {"prompt_ids": runs[host]["dequant"]["prompt_ids"],
                        **{f"{isa}/{p}": r["tokens"] for isa, rr in runs.items() for p, r in rr.items()
                           if r["tokens"] is not None}}
    print(f"\n{result['wall_s']} s")
    if args.out:
        text = json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1)
        tokens = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in result["tokens"].items())
        Path(args.out).write_text(text[:-2] + ',\n "tokens": {\n' + tokens + "\n }\n}\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
