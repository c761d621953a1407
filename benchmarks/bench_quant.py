"""Quantized execution against its own baseline, in one run (seed 000: fewer bytes per token).

1. The ~100M benchmark Llama (`common.bench_model_dir`) in bf16, int8, int4 and int8 weights with
   `quantize_activations` (W8A8 above 8 rows): decode tokens/s at batch 1, 8 and 32 (prompt 128,
   128 new tokens, the prefill's time taken out), prefill tokens/s of 32 prompts of 128 tokens at
   once, and resident weight bytes.
2. SmolLM2-135M-Instruct Q4_1 (the default model): GGUF tensors in their own types (native int4)
   against `quantization="dequant"` (float32): single-stream decode tokens/s, load time, weights.

Every configuration runs in its own subprocess; configurations alternate, the order flipping each
repeat; figures are medians.

    python benchmarks/bench_quant.py --repeats 3 --out benchmarks/results/quant.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from kvserve import LLM, SamplingParams
torch.set_num_threads(2)
model, kwargs, batches = {model!r}, {kwargs!r}, {batches!r}
if model == "default":
    from kvserve.config.default_model import default_model_path
    model = default_model_path()
elif model == "bench":
    from common import bench_model_dir
    model = str(bench_model_dir())
t0 = time.perf_counter()
llm = LLM(model, enable_prefix_caching=False, max_model_len=512, kv_cache_memory=256 << 20, **kwargs)
load_s = time.perf_counter() - t0
seed = iter(range(1, 1 << 30))

def timed(batch, n):
    prompts = [{{"prompt_token_ids": [1] + [(7 * next(seed) + 13 * i) % 1000 + 3 for i in range(127)]}}
               for _ in range(batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return time.perf_counter() - t

timed(2, 4)
res = {{"load_s": load_s, "weight_bytes": llm.engine.model.weight_bytes()}}
for b in batches:
    prefill = min(timed(b, 1) for _ in range(2))
    res[f"decode_b{{b}}"] = b * 127 / (timed(b, 128) - prefill)
    res[f"prefill_b{{b}}"] = b * 128 / prefill
print(json.dumps(res))
"""


def measure(model: str, kwargs: dict, batches: list[int]) -> dict:
    code = CHILD.format(bench=str(HERE), model=model, kwargs=kwargs, batches=batches)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_group(title: str, configs: dict, model: str, batches: list[int], repeats: int) -> dict:
    runs: dict = {name: [] for name in configs}
    for rep in range(repeats):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            r = measure(model, configs[name], batches)
            runs[name].append(r)
            print(f"  {title} repeat {rep} {name:8s} " + "  ".join(
                f"{k} {v:.1f}" for k, v in r.items() if k.startswith("decode")), flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base = next(iter(configs))
    print(f"\n{title}: medians of {repeats}; decode tok/s (ratio to {base})")
    for name, m in med.items():
        cells = "  ".join(f"b{b} {m[f'decode_b{b}']:7.1f} ({m[f'decode_b{b}'] / med[base][f'decode_b{b}']:.2f}x)"
                          for b in batches)
        print(f"  {name:9s} {cells}  prefill b{batches[-1]} {m[f'prefill_b{batches[-1]}']:7.1f} tok/s  "
              f"weights {m['weight_bytes'] / 1e6:6.1f} MB  load {m['load_s']:.2f} s")
    print()
    return {"medians": med, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {
        "llama_100m_bf16": run_group("~100M Llama", {
            "bf16": {"dtype": "bfloat16"},
            "int8": {"dtype": "bfloat16", "quantization": "int8"},
            "int4": {"dtype": "bfloat16", "quantization": "int4"},
            "int8-w8a8": {"dtype": "bfloat16", "quantization": "int8", "quantize_activations": True}},
            "bench", [1, 8, 32], args.repeats),
        "smollm2_q4_1": run_group("SmolLM2-135M Q4_1", {
            "dequant": {"quantization": "dequant"},
            "native": {}}, "default", [1], args.repeats),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
