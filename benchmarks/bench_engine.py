"""Issue 2's engine benchmark: kvserve against `transformers` on the same ~100M random Llama,
in one process and one run, each figure printed beside its baseline.

    python benchmarks/bench_engine.py [--dtypes bfloat16 float32] [--quick] [--out results/engine.json]

Measures: the mixed workload (64 requests, prompts U[32,256], outputs U[16,256], ignore_eos,
seed 0) against transformers `generate` in padded static batches of 32; single-stream decode
(prompt 128, 128 new tokens) and its ceiling (weight bytes per step / measured copy bandwidth);
decode at batch 8 and 32; the mixed workload with prefix caching off (it has a 0% hit rate);
kvserve's engine overhead (step wall time outside the model's
forward pass) and its share of the step.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import bench_model_dir  # noqa: E402
from kvserve import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kvserve.bench.throughput import mixed_workload, run_engine  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def copy_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """Read+write bandwidth of a large tensor copy, best of 5, in GB/s (bytes read per second)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


# -- transformers baselines -------------------------------------------------------------------
def hf_static_batches(model, work, batch_size: int) -> tuple[int, float]:
    """Padded static batching: each batch of `batch_size` runs until its longest output; only
    each request's own tokens count as useful. Returns (useful output tokens, seconds)."""
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        n_new = max(n for _, n in batch)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (p, _) in enumerate(batch):  # left padding, as decoder-only generate expects
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        useful += sum(n for _, n in batch)
    return useful, time.perf_counter() - t0


def hf_decode(model, batch: int, prompt_len: int = 128, new: int = 128) -> float:
    ids = torch.arange(3, 3 + prompt_len).repeat(batch, 1)
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm
        t = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
    return batch * new / (time.perf_counter() - t)


# -- kvserve ----------------------------------------------------------------------------------
def kv_decode(engine: LLMEngine, batch: int, prompt_len: int = 128, new: int = 128) -> tuple[float, float]:
    """(output tok/s including the prefill, engine overhead share of the decode steps)."""
    work = [(list(range(3 + b, 3 + b + prompt_len)), new) for b in range(batch)]
    # Warm up on other prompts, so that the timed run gets no prefix-cache hit.
    run_engine(engine, [([t + 5000 for t in ids], 4) for ids, _ in work])
    r = run_engine(engine, work)
    return r.output_tokens / r.elapsed_s, r.overhead_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64 (smoke run)")
    ap.add_argument("--skip-hf", action="store_true", help="kvserve figures only")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    model_dir = bench_model_dir()
    n_req = 16 if args.quick else 64
    bw = copy_bandwidth_gbs()
    rows: dict = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                  "torch": torch.__version__, "copy_bandwidth_GBps": bw, "results": {}}
    print(f"model {model_dir}  threads {torch.get_num_threads()}  copy bandwidth {bw:.1f} GB/s")
    for dtype in args.dtypes:
        res = rows["results"].setdefault(dtype, {})
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=64))
        vocab = engine.model_config.vocab_size
        work = mixed_workload(n_req, (32, 256), (16, 256), vocab, seed=0)
        warm = mixed_workload(4, (32, 256), (16, 64), vocab, seed=1)  # no prefix shared with `work`
        run_engine(engine, warm)
        r = run_engine(engine, work)
        res["mixed_tok_s"] = r.output_tok_per_s
        res["mixed_overhead_ms_per_step"] = 1e3 * (r.step_s - r.forward_s) / r.steps
        res["mixed_overhead_share"] = r.overhead_share
        # The same workload has no shared prefix: a 0% prefix-cache hit rate, cache on vs off.
        off = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=64,
                                     enable_prefix_caching=False))
        run_engine(off, warm)
        res["mixed_tok_s_no_prefix_cache"] = run_engine(off, work).output_tok_per_s
        del off
        weight_bytes = engine.model.weight_bytes()
        res["ceiling_tok_s"] = bw * 1e9 / weight_bytes
        res["single_tok_s"], _ = kv_decode(engine, 1)
        for b in (8, 32):
            res[f"decode_b{b}_tok_s"], res[f"decode_b{b}_overhead_share"] = kv_decode(engine, b)
        del engine
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
            hf_static_batches(hf, work[:2], 2)  # warm-up
            useful, secs = hf_static_batches(hf, work, 32)
            res["hf_mixed_tok_s"] = useful / secs
            res["hf_single_tok_s"] = hf_decode(hf, 1)
            for b in (8, 32):
                res[f"hf_decode_b{b}_tok_s"] = hf_decode(hf, b)
            del hf
        print(f"\n== {dtype}  (weights {weight_bytes / 1e6:.0f} MB, ceiling {res['ceiling_tok_s']:.0f} tok/s)")
        print(f"{'':28s}{'kvserve':>10s}{'transformers':>14s}{'ratio':>8s}")
        for key, label in [("mixed", f"mixed workload ({n_req} req)"), ("single", "single stream"),
                           ("decode_b8", "decode batch 8"), ("decode_b32", "decode batch 32")]:
            ours, theirs = res[f"{key}_tok_s"], res.get(f"hf_{key}_tok_s")
            ratio = f"{ours / theirs:7.2f}x" if theirs else ""
            theirs_s = f"{theirs:14.1f}" if theirs else f"{'-':>14s}"
            print(f"{label:28s}{ours:10.1f}{theirs_s}{ratio}")
        print(f"prefix caching at a 0% hit rate: on {res['mixed_tok_s']:.1f} tok/s, off "
              f"{res['mixed_tok_s_no_prefix_cache']:.1f} tok/s "
              f"(on/off {res['mixed_tok_s'] / res['mixed_tok_s_no_prefix_cache']:.3f})")
        print(f"engine overhead: mixed {100 * res['mixed_overhead_share']:.1f}% of step "
              f"({res['mixed_overhead_ms_per_step']:.2f} ms/step), decode b32 "
              f"{100 * res['decode_b32_overhead_share']:.1f}%")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
