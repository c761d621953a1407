"""Speculative decoding against its own baseline, in one run (issue 12; seed 004: several tokens
per expensive step).

For each model (SmolLM2-135M-Instruct Q4_1, the default; stories260K), single stream and batch 8:
speculation off vs the n-gram proposer at k = 1..8 (prompt_lookup 1..3), on copy-heavy prompts
(the prompt holds a passage of the seeds, or a code file, that the answer rewrites) and on free
generation (a story); and the draft-model proposer: SmolLM2 run in float32 (quantization="dequant")
with its own weights in int4 as the draft ("self-int4"), single stream. Greedy, fixed output length (ignore_eos), prefix caching off. One engine
with speculation off and one with it on (k set per run on the scheduler); configurations are
interleaved within each repeat, figures are medians over repeats. Reported: decode tokens/s
(output tokens after the first, over the time from the first output token to the last: the
prefill is the same on both sides), the speed-up over off in the same repeat,
the acceptance rate (accepted / drafted tokens) and the mean accepted length (tokens emitted per
verification: 1 + accepted / drafts).

    python benchmarks/bench_spec.py --repeats 3 --out benchmarks/results/spec.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

CODE = '''def kv_cache_gb(layers, kv_heads, head_dim, tokens, batch, bytes_per_value=2):
    """Bytes of K and V for a batch of sequences, in GB."""
    per_token = 2 * layers * kv_heads * head_dim * bytes_per_value
    return per_token * tokens * batch / 1e9


def max_batch(free_gb, layers, kv_heads, head_dim, tokens, bytes_per_value=2):
    """How many sequences of `tokens` tokens fit in `free_gb` of KV cache."""
    one = kv_cache_gb(layers, kv_heads, head_dim, tokens, 1, bytes_per_value)
    return int(free_gb // one)
'''


def passages(n: int) -> list[str]:
    """n paragraphs of the seeds, 300-700 characters each."""
    out = []
    for f in sorted(SEEDS.glob("*.txt")):
        for para in f.read_text().split("\n"):
            if 300 <= len(para) <= 700 and not para.startswith(("|", "def ", "print")):
                out.append(para)
    return out[:n] if len(out) >= n else (out * n)[:n]


def smollm_prompts(kind: str, batch: int) -> list[list[dict]]:
    if kind == "copy":
        convs = []
        for i, p in enumerate(passages(batch)):
            if i % 2:
                task = ("Rename the function kv_cache_gb to kv_bytes_gb everywhere in this code and "
                        f"return the whole file:\n\n{CODE}")
            else:
                task = f"Repeat the following passage exactly, word for word:\n\n{p}"
            convs.append([{"role": "user", "content": task}])
        return convs
    topics = ["a dragon", "a lighthouse", "a lost robot", "a baker", "a river", "a winter fair", "an owl", "a kite"]
    return [[{"role": "user", "content": f"Write a short story about {t}."}] for t in topics[:batch]]


def stories_prompts(llm, kind: str, batch: int) -> list[dict]:
    tok = llm.get_tokenizer()
    starts = ["Once upon a time", "Tom had a red ball.", "Lily went to the park.", "The cat sat on the mat.",
              "One day, a little bird", "Sam and Mia were friends.", "There was a big tree.", "Ben liked to run."]
    if kind == "free":
        return [{"prompt_token_ids": tok.encode(s)} for s in starts[:batch]]
    # copy: the story the model tells from a start, then the start again: it may tell it again
    from kvserve import SamplingParams
    outs = llm.generate(starts[:batch], SamplingParams(temperature=0.0, max_tokens=80))
    return [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids + tok.encode(s)[1:]}
            for s, o in zip(starts, outs)]


def run_once(llm, prompts, params, chat: bool) -> tuple[float, int, tuple[int, int, int]]:
    eng = llm.engine
    before = eng.stats()
    outs = llm.chat(prompts, params) if chat else llm.generate(prompts, params)
    after = eng.stats()
    # decode only: from the first output token to the last (the prefill is the same either way)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    n = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    dt = last - first
    d = (after.num_steps - before.num_steps,
         after.spec_decode_num_drafts - before.spec_decode_num_drafts,
         after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
         after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    return dt, n, d, [o.outputs[0].token_ids for o in outs]


NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def bench_model(name: str, model: str, ks: dict, max_tokens: int, repeats: int, chat: bool,
                max_model_len: int | None, spec: dict = NGRAM, **engine_kwargs) -> list[dict]:
    from kvserve import LLM, SamplingParams

    common = dict(enable_prefix_caching=False, max_model_len=max_model_len, kv_cache_memory=128 << 20, seed=0,
                  **engine_kwargs)
    off = LLM(model, **common)
    on = LLM(model, **common, speculative_config=spec)
    proposer = spec.get("method") or "draft " + spec["model"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for batch, klist in ks.items():
        for kind in ("copy", "free"):
            prompts = smollm_prompts(kind, batch) if chat else stories_prompts(off, kind, batch)
            run_once(off, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), chat)   # warm-up
            run_once(on, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), chat)
            times: dict = {k: [] for k in [0] + klist}
            counts: dict = {}
            outputs: dict = {k: [] for k in [0] + klist}
            for r in range(repeats):
                order = [0] + klist if r % 2 == 0 else klist[::-1] + [0]
                for k in order:
                    llm = off if k == 0 else on
                    if k:
                        llm.engine.scheduler.num_speculative_tokens = k
                    dt, n, d, toks = run_once(llm, prompts, params, chat)
                    times[k].append((dt, n))
                    counts.setdefault(k, [0, 0, 0, 0])
                    counts[k] = [a + b for a, b in zip(counts[k], d)]
                    outputs[k] += toks
            base = statistics.median(n / dt for dt, n in times[0])
            for k in [0] + klist:
                tps = statistics.median(n / dt for dt, n in times[k])
                speedups = [n / dt / (n0 / dt0) for (dt, n), (dt0, n0) in zip(times[k], times[0])]
                steps, drafts, drafted, accepted = counts[k]
                total = sum(n for _, n in times[k]) + len(prompts) * repeats    # + the first tokens
                row = dict(model=name, proposer=proposer if k else "off", batch=batch, workload=kind, k=k,
                           tokens_per_s=round(tps, 1),
                           best_tokens_per_s=round(max(n / dt for dt, n in times[k]), 1),
                           tokens_per_step=round(total / steps, 2),    # engine steps (target passes)
                           speedup=round(statistics.median(speedups), 2),
                           acceptance_rate=round(accepted / drafted, 3) if drafted else None,
                           mean_accepted_length=round(1 + accepted / drafts, 2) if drafts else None,
                           baseline_tokens_per_s=round(base, 1),
                           # greedy: the same tokens as off (kernels may round differently when
                           # a step holds k + 1 rows per sequence, so near-ties can flip)
                           same_tokens_as_off=round(sum(a == b for a, b in zip(outputs[k], outputs[0]))
                                                    / len(outputs[0]), 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def write(path: str | None, args, rows: list[dict]) -> None:
    """The rows as JSON at `path`, and as a markdown table beside it (same name, .md)."""
    if path:
        cmd = "python benchmarks/bench_spec.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v not in (None, "") and k != "from_json")
        Path(path).write_text(json.dumps(dict(command=cmd, torch_threads=args.threads, rows=rows), indent=1) + "\n")
        Path(path).with_suffix(".md").write_text(markdown(cmd, rows))


def markdown(cmd: str, rows: list[dict]) -> str:
    out = [f"Speculative decoding vs off, greedy (`{cmd}`; medians of interleaved repeats; decode "
           "tokens/s: output tokens after the first over first-to-last-token time; speed-up = tok/s over off's in the same repeat).", "",
           "| model | proposer | batch | workload | k | decode tok/s | off decode tok/s | speed-up | best tok/s | "
           "tokens per target pass | acceptance | mean accepted length | same tokens as off |", "|" + "---|" * 13]
    for r in rows:
        out.append(f"| {r['model']} | {r['proposer']} | {r['batch']} | {r['workload']} | {r['k']} | "
                   f"{r['tokens_per_s']} | {r['baseline_tokens_per_s']} | {r['speedup']} | "
                   f"{r.get('best_tokens_per_s', '')} | {r.get('tokens_per_step', '')} | "
                   f"{'' if r['acceptance_rate'] is None else r['acceptance_rate']} | "
                   f"{'' if r['mean_accepted_length'] is None else r['mean_accepted_length']} | "
                   f"{r['same_tokens_as_off']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,stories260K")
    ap.add_argument("--single-ks", default="1,2,3,4,5,6,7,8", help="k values at batch 1")
    ap.add_argument("--batch-ks", default="2,4,8", help="k values at batch 8")
    ap.add_argument("--draft-ks", default="2,4", help="k values of the self-int4 draft (batch 1; '' skips it)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (and a .md table beside it)")
    ap.add_argument("--from-json", default=None, help="only render the .md table of this JSON result")
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        Path(args.from_json).with_suffix(".md").write_text(markdown(data["command"], data["rows"]))
        return
    torch.set_num_threads(args.threads)
    ks = {1: [int(x) for x in args.single_ks.split(",")], 8: [int(x) for x in args.batch_ks.split(",")]}
    rows = []
    for name in args.models.split(","):
        if name == "smollm2":
            from kvserve.config.default_model import default_model_path
            rows += bench_model(name, default_model_path(), ks, args.max_tokens, args.repeats, chat=True,
                                max_model_len=1024)
            write(args.out, args, rows)
            if args.draft_ks:      # the draft-model proposer: float32 target, its own int4 copy as draft
                rows += bench_model(name + "-fp32", default_model_path(),
                                    {1: [int(x) for x in args.draft_ks.split(",")]}, args.max_tokens,
                                    args.repeats, chat=True, max_model_len=1024, quantization="dequant",
                                    spec={"model": "self-int4", "num_speculative_tokens": 8})
        elif name == "stories260K":
            rows += bench_model(name, str(STORIES), ks, args.max_tokens, args.repeats, chat=False,
                                max_model_len=None)
        else:
            raise ValueError(f"unknown model {name!r}: smollm2 or stories260K")
        write(args.out, args, rows)
    print(f"\n{'model':14} {'proposer':16} {'batch':>5} {'workload':8} {'k':>2} {'tok/s':>8} {'off tok/s':>9} {'speedup':>7} "
          f"{'accept':>6} {'mean len':>8} {'same':>5}")
    for r in rows:
        print(f"{r['model']:14} {r['proposer']:16} {r['batch']:>5} {r['workload']:8} {r['k']:>2} {r['tokens_per_s']:>8} "
              f"{r['baseline_tokens_per_s']:>9} {r['speedup']:>7} {str(r['acceptance_rate']):>6} "
              f"{str(r['mean_accepted_length']):>8} {r['same_tokens_as_off']:>5}")
    write(args.out, args, rows)


if __name__ == "__main__":
    main()
