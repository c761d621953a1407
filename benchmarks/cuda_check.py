"""One script for a CUDA machine (torch, transformers; no internet): is kvserve exact there, and how
fast does it decode? Three sections, each reported even when another fails:

  exactness     greedy tokens and logprobs of kvserve (float32 on --device) against transformers
                (float32 on the CPU, tests/reference/hf_reference.py) on stories260K and two
                random-weight transformers models: a Llama with as many KV heads as heads and a
                grouped-query (GQA) Llama
  differential  tests/reference/test_differential.py's seeded workloads (constrained engine vs
                unconstrained one, integrity after every step, greedy vs transformers), run
                through its own harness with device=--device, seeds cut short by --budget-s
  decode        ms per engine step at batch 1/16/64/256 (context 32 + the steps), timed with CUDA
                events on CUDA (perf_counter on the CPU), bf16, the ~100M benchmark Llama

    python benchmarks/cuda_check.py [--device cuda] [--models-dir /work/shared/models] [--json PATH]
    python benchmarks/cuda_check.py --device cpu --quick        # the smoke run a CPU can do

Exit status 0 when every check passed. --quick: fewer tokens and seeds, the 2-layer benchmark
model, batches 1 and 16.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = [[1, 403, 261, 505, 280, 325, 261, 390, 310], [1, 306, 412, 281, 384], [1, 7, 8, 9, 10, 11, 12]]


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "device": device, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for name in ("transformers", "triton"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["cuda"] = torch.version.cuda
    return env


def random_llama(out: Path, num_kv_heads: int) -> Path:
    """conftest's random Llama (vocab 512, the stories260K tokenizer) with `num_kv_heads` of 4."""
    import shutil

    import transformers as tf

    from tests.conftest import STORIES_HF

    if not (out / "model.safetensors").exists():
        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=num_kv_heads,
                             max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.15,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        torch.manual_seed(num_kv_heads)
        tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(STORIES_HF / name, out / name)
    return out


def check_exactness(device: str, stories_hf: Path, work: Path, max_tokens: int) -> list[dict]:
    """Per model: greedy tokens equal transformers', and the largest logprob difference."""
    from kvserve import LLM, SamplingParams
    from tests.reference.hf_reference import hf_greedy

    models = {"stories260K": stories_hf, "llama-mha": random_llama(work / "llama-mha", 4),
              "llama-gqa": random_llama(work / "llama-gqa", 2)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    rows = []
    for name, path in models.items():
        row = {"model": name, "ok": False}
        try:
            llm = LLM(str(path), device=device, dtype="float32")
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            equal, worst = 0, 0.0
            for prompt, out in zip(PROMPTS, outs):
                ref, ref_lp = hf_greedy(str(path), prompt, max_tokens)
                got = out.outputs[0]
                equal += got.token_ids == ref
                worst = max([worst] + [abs(e[t].logprob - r) for e, t, r in zip(got.logprobs, ref, ref_lp)])
            row.update(prompts_equal=f"{equal}/{len(PROMPTS)}", max_logprob_diff=worst,
                       ok=equal == len(PROMPTS) and worst < 1e-4)
            del llm
        except Exception as e:  # noqa: BLE001 -- reported, and the next model runs
            row["error"] = _error(e)
        rows.append(row)
    return rows


def check_differential(device: str, stories_hf: Path, seeds_per_setting: int, deadline: float) -> dict:
    """test_differential.py's checks through its own functions, with device=`device`."""
    from tests.reference import test_differential as td

    td.STORIES_HF = stories_hf            # the harness reads the model path from its module
    out = {"seeds_run": 0, "seeds_planned": seeds_per_setting * len(td.CONSTRAINED), "failures": []}
    try:
        reference = td.unconstrained(device=device)
        for setting in range(len(td.CONSTRAINED)):
            stats = []
            for seed in list(td.SEEDS[setting::len(td.CONSTRAINED)])[:seeds_per_setting]:
                if time.monotonic() > deadline:
                    break
                rng = random.Random(seed)
                settings = dict(td.CONSTRAINED[setting], watermark=rng.choice([0.0, 0.05]))
                try:
                    stats.append(td.check_against(reference, settings, td.make_workload(rng, rng.randrange(6, 12)),
                                                  device=device))
                except Exception as e:  # noqa: BLE001
                    out["failures"].append(f"seed {seed}: {_error(e)}")
                out["seeds_run"] += 1
            if len(stats) == len(td.SEEDS[setting::len(td.CONSTRAINED)]):   # every seed: pressure too
                try:
                    td.check_pressure(td.CONSTRAINED[setting], stats)
                except AssertionError as e:
                    out["failures"].append(f"setting {setting}: {_error(e)}")
        rng = random.Random(99)            # test_greedy_under_pressure_equals_transformers
        workload = [w for w in td.make_workload(rng, 10) if w["kind"] == "greedy"]
        small = td.LLM(str(stories_hf), block_size=2, num_kv_blocks=24, max_num_batched_tokens=6,
                       max_num_seqs=6, preemption_mode="swap", prefix_cache="radix", watermark=0.0,
                       device=device)
        got, _ = td.run(small, workload, check=True)
        td.check_greedy_against_transformers(got, workload)
        out["greedy_under_pressure"] = "equal to transformers"
    except Exception as e:  # noqa: BLE001
        out["failures"].append(_error(e))
    out["ok"] = not out["failures"] and out["seeds_run"] > 0
    return out


def time_decode(device: str, model_dir: Path, batches: list[int], steps: int) -> list[dict]:
    """Median ms per decode step at each batch size (greedy, prompts of 32 fresh tokens)."""
    from kvserve import LLM, SamplingParams

    cuda = torch.device(device).type == "cuda"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(str(model_dir), device=device, dtype="bfloat16", max_model_len=512, max_num_seqs=max(batches),
              max_num_batched_tokens=max(2048, 32 * max(batches)), enable_prefix_caching=False)
    eng, rng, rows = llm.engine, random.Random(0), []
    for b in batches:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        for i in range(b):
            eng.add_request(f"b{b}-{i}", {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(32)]}, params)
        for _ in range(3):                  # the prefill, then two warm-up decode steps
            eng.step()
        times = []
        while eng.has_unfinished_requests():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                eng.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                eng.step()
                times.append(1e3 * (time.perf_counter() - t))
        ms = statistics.median(times)
        rows.append({"batch": b, "steps": len(times), "ms_per_step": ms, "tok_s": 1e3 * b / ms})
    return rows


def _error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {str(e)[:300]} ({Path(where.filename).name}:{where.lineno})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models-dir", default=str(ROOT.parent / "shared" / "models"),
                    help="holds stories260K-hf/ (tests/reference/'s copy of stories260K)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and seeds, the tiny model, batches 1, 16")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new differential seed after this")
    ap.add_argument("--work-dir", default="/tmp/kvserve-cuda-check", help="random models are built here")
    ap.add_argument("--json", default=None, help="write the report here too")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    import tests.conftest  # noqa: F401 -- sets one thread for the tiny test models; undone below
    torch.set_num_threads(threads)
    from benchmarks.common import bench_model_dir

    t0 = time.monotonic()
    stories = Path(args.models_dir) / "stories260K-hf"
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    report = {"env": environment(args.device)}
    print("env: " + ", ".join(f"{k} {v}" for k, v in report["env"].items()))

    report["exactness"] = check_exactness(args.device, stories, work, 8 if args.quick else 32)
    report["seconds_exactness"] = round(time.monotonic() - t0, 1)
    for r in report["exactness"]:
        detail = r.get("error") or f"{r['prompts_equal']} prompts equal, max |dlogprob| {r['max_logprob_diff']:.1e}"
        print(f"exactness {r['model']:<12} {'ok ' if r['ok'] else 'FAIL'} {detail}")

    seeds = 1 if args.quick else 8
    t1 = time.monotonic()
    logging.getLogger("kvserve").setLevel(logging.ERROR)     # the workloads preempt on purpose
    report["differential"] = d = check_differential(args.device, stories, seeds, t0 + args.budget_s)
    logging.getLogger("kvserve").setLevel(logging.NOTSET)
    report["seconds_differential"] = round(time.monotonic() - t1, 1)
    print(f"differential {'ok ' if d['ok'] else 'FAIL'} {d['seeds_run']}/{d['seeds_planned']} seeds, "
          f"greedy under pressure: {d.get('greedy_under_pressure', '-')}")
    for f in d["failures"]:
        print(f"  {f}")

    batches, steps = ([1, 16], 8) if args.quick else ([1, 16, 64, 256], 32)
    try:
        report["decode"] = time_decode(args.device, bench_model_dir(tiny=args.quick), batches, steps)
        print("decode (bf16, %s): " % ("2-layer tiny model" if args.quick else "~100M Llama")
              + "; ".join(f"batch {r['batch']} {r['ms_per_step']:.2f} ms/step {r['tok_s']:.0f} tok/s"
                          for r in report["decode"]))
    except Exception as e:  # noqa: BLE001
        report["decode"] = {"error": _error(e)}
        print(f"decode FAIL {report['decode']['error']}")
    ok = all(r["ok"] for r in report["exactness"]) and d["ok"] and "error" not in report["decode"]
    report["ok"], report["seconds"] = ok, round(time.monotonic() - t0, 1)
    print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'} in {report['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
