"""Prefill time of the model runner, this tree beside a baseline tree, in one run (issue 22 items 3-4).

What it times: `ModelRunner.execute` of one step (inputs, the forward pass, the logits) on a
random-weight Llama built with transformers' LlamaConfig (4 layers, width 512, 8 heads of 64,
2 KV heads, float32 by default), for four steps:

    prefill 512          one fresh 512-token prompt
    prefill 2048         one fresh 2048-token prompt
    8 x 256 fresh        eight fresh 256-token prompts in one step
    8 x 256 after 256    eight sequences with 256 tokens cached, 256 new tokens each

Each measurement is a subprocess importing kvserve from one tree (PYTHONPATH): it loads the
model, warms up, and reports the median of --inner runs of each step. Trees alternate, the order
flipping every repeat; each figure is the median over --repeats. The CPU capability and the load
average (the machine is shared) are printed with the figures.

    git worktree add --detach /tmp/kvserve-prefill-base <commit before the change>
    python benchmarks/bench_prefill_attention.py --baseline-tree /tmp/kvserve-prefill-base
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared"
MODEL = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
STEPS = {  # name: (number of sequences, cached tokens each, new tokens each)
    "prefill 512": (1, 0, 512),
    "prefill 2048": (1, 0, 2048),
    "8 x 256 fresh": (8, 0, 256),
    "8 x 256 after 256": (8, 256, 256),
}
BLOCK_SIZE = 16

CHILD = r"""
import json, statistics, time, torch
from kvserve.model.llama import LlamaModel
from kvserve.model.loaders.checkpoint import load_model_dir
try:
    from kvserve.attention.torch_paged import TorchPagedAttention
except ImportError:   # a tree from before kvserve/attention/
    from kvserve.model.attention import TorchPagedAttention
from kvserve.worker.model_runner import ModelRunner
torch.set_num_threads({threads})
dtype = getattr(torch, {dtype!r})
cfg, weights, _ = load_model_dir({model!r})
model = LlamaModel(cfg, weights, TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, {bs}, cfg.sliding_window), torch.device("cpu"), dtype)

class Seq:
    def __init__(self, rid, tokens, computed):
        self.request_id, self.token_ids, self.num_computed_tokens = rid, tokens, computed
    @property
    def num_tokens(self):
        return len(self.token_ids)

out = {{"capability": torch.backends.cpu.get_cpu_capability()}}
g = torch.Generator().manual_seed(0)
for name, (n, cached, new) in {steps!r}.items():
    per = -(-(cached + new) // {bs})
    runner = ModelRunner(model, n * per + 1, {bs})       # block ids 1..n*per: valid in every tree
    seqs = [Seq(f"s{{i}}", torch.randint(1, 512, (cached + new,), generator=g).tolist(), 0) for i in range(n)]
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]
    if cached:                                           # the cached part, once, untimed
        runner.execute([(s, cached, t) for s, t in zip(seqs, tables)])
    times = []
    for rep in range({warmup} + {inner}):
        for s in seqs:
            s.num_computed_tokens = cached
        t0 = time.perf_counter()
        runner.execute([(s, new, t) for s, t in zip(seqs, tables)])
        if rep >= {warmup}:
            times.append(time.perf_counter() - t0)
    out[name] = 1000 * statistics.median(times)
print(json.dumps(out))
"""


def model_dir(path: Path) -> Path:
    if (path / "model.safetensors").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHARED / "models" / "stories260K-hf" / name, path / name)
    return path


def measure(tree: Path, args) -> dict:
    code = CHILD.format(threads=args.threads, dtype=args.dtype, model=str(args.model_dir), bs=BLOCK_SIZE,
                        steps=STEPS, warmup=1, inner=args.inner)
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=HERE.parent, help="checkout to measure (default: this one)")
    ap.add_argument("--baseline-tree", type=Path, required=True, help="a git worktree of the baseline commit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inner", type=int, default=5, help="timed runs of each step per subprocess")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvserve-bench-prefill-attention"))
    args = ap.parse_args()
    model_dir(args.model_dir)
    trees = {"baseline": args.baseline_tree.resolve(), "this tree": args.tree.resolve()}
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for rep in range(args.repeats):
        for label in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
            runs[label].append(measure(trees[label], args))
            print(f"[{rep}] {label}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in runs[label][-1].items()
                                                   if k in STEPS), flush=True)
    caps = {r["capability"] for per in runs.values() for r in per}
    print(f"\ncapability {', '.join(sorted(caps))}, {args.threads} thread(s), {args.dtype}, "
          f"load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"median over {args.repeats} repeats of the median of {args.inner} runs")
    print(f"baseline {trees['baseline']}, this tree {trees['this tree']}\n")
    print("| step | baseline ms | this tree ms | this / baseline |\n|---|---|---|---|")
    for name in STEPS:
        base = statistics.median(r[name] for r in runs["baseline"])
        new = statistics.median(r[name] for r in runs["this tree"])
        print(f"| {name} | {base:.1f} | {new:.1f} | {new / base:.2f} |")


if __name__ == "__main__":
    main()
