"""Offline decode throughput at batch B (issue 33: every row count on kvserve's own kernels), one
kvserve tree against another on the same machine, interleaved.

For each batch size B: B requests of P random prompt tokens (seeded, prefix caching off), greedy,
`ignore_eos`. A request set runs twice, once with max_tokens = 1 (the prefill and one token) and
once with max_tokens = 1 + N; decode tokens/s = B * N / (second time - first time), so the
prefill cancels out. Each measurement is a fresh subprocess importing kvserve from its tree
(PYTHONPATH); the two trees alternate, the order flipping every repeat, and a figure is the
median of its repeats. Also each tree's resident weight bytes (`model.weight_bytes()`).

    git worktree add --detach /tmp/kvserve-base HEAD
    python benchmarks/bench_batched_decode.py --tree . --baseline-tree /tmp/kvserve-base \\
        --batches 1,4,8,16,32,64 --repeats 3 [--model FILE] [--kwargs JSON] [--out results/batched_decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from common import run_in_tree

CHILD = r"""
import json, random, time, torch
from kvserve import LLM, SamplingParams
from kvserve.config.default_model import default_model_path
torch.set_num_threads({threads})
model = {model!r} or default_model_path()
out = {{"capability": torch.backends.cpu.get_cpu_capability()}}
llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=max({batches}), num_kv_blocks=4096, **{kwargs})
out["weight_bytes"] = llm.engine.model.weight_bytes()
vocab = llm.engine.model.cfg.vocab_size
def run(B, n, seed):
    rng = random.Random(seed)
    prompts = [{{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range({prompt})]}} for _ in range(B)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t
run(2, 4, 999)
for B in {batches}:
    first = run(B, 1, B)
    full = run(B, 1 + {new}, B)
    out[str(B)] = B * {new} / (full - first)
print(json.dumps(out))
"""


def measure(tree: Path, args) -> dict:
    code = CHILD.format(threads=args.threads, model=args.model, batches=args.batches, prompt=args.prompt_len,
                        new=args.new_tokens, kwargs=json.loads(args.kwargs))
    return run_in_tree(tree, code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path("."))
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M Q4_1 GGUF)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kwargs", default="{}", help='LLM keyword arguments, as JSON: \'{"dtype": "bfloat16"}\'')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trees = {"tree": args.tree} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for r in range(args.repeats):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            loads.append(os.getloadavg()[0])
            runs[name].append(measure(trees[name], args))
            print(f"repeat {r} {name}: " + ", ".join(f"B{b} {runs[name][-1][str(b)]:.1f}" for b in args.batches),
                  flush=True)
    result = {"capability": runs["tree"][0]["capability"], "threads": args.threads, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "load_average": [min(loads), max(loads)], "runs": runs,
              "median_tok_s": {k: {str(b): statistics.median(x[str(b)] for x in v) for b in args.batches}
                               for k, v in runs.items()},
              "weight_bytes": {k: v[0]["weight_bytes"] for k, v in runs.items()}}
    print(f"\ncapability {result['capability']}, {args.threads} threads, load {min(loads):.1f}-{max(loads):.1f}; "
          f"decode tokens/s (median of {args.repeats})")
    print(f"{'batch':>6s} {'tree':>9s}" + (f" {'baseline':>9s} {'ratio':>6s}" if args.baseline_tree else ""))
    med = result["median_tok_s"]
    for b in args.batches:
        line = f"{b:6d} {med['tree'][str(b)]:9.1f}"
        if args.baseline_tree:
            line += f" {med['baseline'][str(b)]:9.1f} {med['tree'][str(b)] / med['baseline'][str(b)]:6.2f}"
        print(line)
    print("weight bytes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in result["weight_bytes"].items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
