"""The served workload of `vllm bench serve` (random 128-token prompts, 128 output tokens,
`--ignore-eos`, temperature 1, at most C requests at once) replayed offline through `LLM.generate`,
each step timed by kind (pure decode, or mixed with prefill chunks), with the run's minor page
faults and system time: where a served run's time goes
without HTTP, and the offline figure a served one is held to (issue 33). One kvserve tree against
another, interleaved (a fresh subprocess a run, the order flipping every repeat), medians.

    git worktree add --detach /tmp/kvserve-base HEAD
    python benchmarks/bench_served_replay.py --model DIR --concurrency 64 --prompts 128 \\
        [--baseline-tree /tmp/kvserve-base] [--repeats 2] [--kwargs '{"dtype": "bfloat16"}']
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from common import run_in_tree

CHILD = r"""
import collections, json, random, resource, time, torch
from kvserve import LLM, SamplingParams
from kvserve.config.default_model import default_model_path
from kvserve.worker import model_runner as mr
torch.set_num_threads({threads})
llm = LLM(model={model!r} or default_model_path(), max_num_seqs={conc}, **{kwargs})
steps = collections.defaultdict(lambda: [0, 0.0])                 # kind -> [steps, seconds]
execute = mr.ModelRunner.execute_model
def timed_execute(self, so, *a, **kw):
    t = time.perf_counter()
    r = execute(self, so, *a, **kw)
    kind = "decode" if sum(n for _, n, _ in so.scheduled) == len(so.scheduled) else "mixed"
    steps[kind][0] += 1
    steps[kind][1] += time.perf_counter() - t
    return r
mr.ModelRunner.execute_model = timed_execute
vocab = llm.engine.model.cfg.vocab_size
rng = random.Random(1)
prompts = [{{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range({prompt_len})]}}
           for _ in range({n})]
llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True))
steps.clear()
r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens={out_len}, ignore_eos=True, seed=1))
wall = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "tok_s": tokens / wall, "wall": wall,
                  "minor_faults": r1.ru_minflt - r0.ru_minflt, "system_s": r1.ru_stime - r0.ru_stime,
                  "steps": {{k: {{"steps": v[0], "ms_per_step": 1e3 * v[1] / v[0], "seconds": v[1]}}
                            for k, v in steps.items()}}}}))
"""


def measure(tree: Path, args) -> dict:
    code = CHILD.format(threads=args.threads, model=args.model, conc=args.concurrency, n=args.prompts,
                        prompt_len=args.prompt_len, out_len=args.output_len, kwargs=json.loads(args.kwargs))
    return run_in_tree(tree, code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path("."))
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M Q4_1 GGUF)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kwargs", default="{}", help="LLM keyword arguments, as JSON")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    trees = {"tree": args.tree} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    loads = []
    for r in range(args.repeats):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            loads.append(os.getloadavg()[0])
            run = runs[name]
            run.append(measure(trees[name], args))
            kinds = ", ".join(f"{k} {v['steps']} x {v['ms_per_step']:.1f} ms" for k, v in sorted(run[-1]["steps"].items()))
            print(f"repeat {r} {name}: {run[-1]['tok_s']:.1f} tok/s ({kinds}; {run[-1]['minor_faults']} minor "
                  f"page faults, {run[-1]['system_s']:.2f} s system time)", flush=True)
    print(f"\ncapability {runs['tree'][0]['capability']}, {args.threads} threads, load {min(loads):.1f}-{max(loads):.1f}; "
          f"concurrency {args.concurrency}, {args.prompts} prompts of {args.prompt_len}, {args.output_len} out; "
          f"medians of {args.repeats}")
    med = {}
    for name, rs in runs.items():
        med[name] = statistics.median(x["tok_s"] for x in rs)
        kinds = {k for x in rs for k in x["steps"]}
        per = ", ".join(f"{k} {statistics.median(x['steps'][k]['ms_per_step'] for x in rs if k in x['steps']):.1f} ms/step"
                        for k in sorted(kinds))
        print(f"{name:9s} {med[name]:8.1f} output tok/s ({per})")
    if args.baseline_tree:
        print(f"ratio tree / baseline: {med['tree'] / med['baseline']:.2f}")


if __name__ == "__main__":
    main()
