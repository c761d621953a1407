"""What `dtype="auto"` picks on the CPU (kvserve/model/loaders/checkpoint.py: resolve_dtype), measured: the
issue-2 ~100M random Llama saved as a bf16 and as an fp16 checkpoint, each run by the engine in
its own dtype and in float32. One engine step each: a 256-token prefill and a decode step at
batch 1 and 16 (context 64), medians over interleaved repeats (the two engines step in turn, so
load on the shared machine falls on both). Prints the CPU capability and kernel plan it ran under.

    python benchmarks/bench_auto_dtype.py [--repeats 5] [--threads 1] [--json PATH] [--tiny]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import BENCH_MODEL_CONFIG, SHARED, TINY_MODEL_CONFIG  # noqa: E402

_ids = itertools.count()


def checkpoint(dtype: torch.dtype, tiny: bool) -> Path:
    """The benchmark Llama (seed 0) saved in `dtype`, built once under /tmp."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    name = str(dtype).removeprefix("torch.")
    out = Path(f"/tmp/kvserve-bench-llama-{'tiny' if tiny else '100m'}-{name}")
    if not (out / "model.safetensors").exists():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**(TINY_MODEL_CONFIG if tiny else BENCH_MODEL_CONFIG)))
        model.to(dtype).save_pretrained(out, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SHARED / "models" / "stories260K-hf" / f, out / f)
    return out


def one_round(llms: dict, vocab: int, rng: random.Random) -> dict:
    """{dtype: {step: [ms]}}: a 256-token prefill step on each engine in turn, then decode steps
    at batch 1 and 16 (context 64), the engines stepping alternately."""
    from kvserve import SamplingParams

    out = {d: {"prefill_256": [], "decode_b1": [], "decode_b16": []} for d in llms}

    def add(eng, batch: int, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(batch):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            eng.add_request(f"r{next(_ids)}", {"prompt_token_ids": prompt}, params)

    def timed(eng) -> float:
        t = time.perf_counter()
        eng.step()
        return 1e3 * (time.perf_counter() - t)

    for d, llm in llms.items():
        add(llm.engine, 1, 256, 1)
        out[d]["prefill_256"].append(timed(llm.engine))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    for batch in (1, 16):
        for llm in llms.values():
            add(llm.engine, batch, 64, 9)
            llm.engine.step()                               # the prefill
        while any(llm.engine.has_unfinished_requests() for llm in llms.values()):
            for d, llm in llms.items():
                if llm.engine.has_unfinished_requests():
                    out[d][f"decode_b{batch}"].append(timed(llm.engine))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="the 2-layer smoke model")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 keeps OpenMP's spinning out of a shared machine's figures)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvserve import LLM
    from kvserve.model.quant.cpu_paths import kernel_plan
    from kvserve.model.loaders.checkpoint import checkpoint_dtype, resolve_dtype

    plan = kernel_plan()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"kernel plan {plan.name} (dense dtype {str(plan.dense_dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads")
    vocab = (TINY_MODEL_CONFIG if args.tiny else BENCH_MODEL_CONFIG)["vocab_size"]
    rng = random.Random(0)
    report = {"capability": torch.backends.cpu.get_cpu_capability(), "plan": plan.name, "rows": {}}
    for stored in (torch.bfloat16, torch.float16):
        path = checkpoint(stored, args.tiny)
        runs = [str(stored).removeprefix("torch."), "float32"]
        llms = {d: LLM(str(path), dtype=d, device="cpu", enable_prefix_caching=False,
                       max_model_len=512, kv_cache_memory=256 << 20) for d in runs}
        times = {d: {} for d in runs}
        for _ in range(args.repeats):
            for d, steps in one_round(llms, vocab, rng).items():
                for key, ms in steps.items():
                    times[d].setdefault(key, []).extend(ms)
        auto = str(resolve_dtype("auto", checkpoint_dtype(str(path)), "cpu")).removeprefix("torch.")
        print(f"\n{runs[0]} checkpoint (dtype='auto' picks {auto}); ms per step, medians over "
              f"{args.repeats} rounds (decode: 8 steps a round):")
        print(f"  {'step':<12}" + "".join(f"{d:>12}" for d in runs) + f"{'f32/own':>9}")
        rows = {}
        for key in times[runs[0]]:
            med = {d: statistics.median(times[d][key]) for d in runs}
            rows[key] = {d: {"median_ms": med[d], "runs_ms": times[d][key]} for d in runs}
            print(f"  {key:<12}" + "".join(f"{med[d]:>12.2f}" for d in runs)
                  + f"{med['float32'] / med[runs[0]]:>7.2f}x")
        report["rows"][runs[0]] = {"auto": auto, "steps": rows}
        del llms
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
