"""Structured outputs on the default model (SmolLM2-135M-Instruct Q4_1 GGUF), issue 23's figures:

1. Grammar compile time against the model's 49k-token tokenizer: the llguidance tokenizer's
   one-time build, a JSON schema compiled cold (each schema new), and served from the cache.
2. 32 concurrent requests, all free, against the same 32 with the even ones (half A) under a
   JSON schema (an array of at least 50 person objects, so no output completes before
   max_tokens and both runs make the same tokens with the same batch): output tok/s of half A
   and of half B (the odd ones, free in both runs) against the same half in the all-free run
   (its output tokens / the time from the run's start to its last finish), interleaved repeats,
   medians; and the mean decode step time of each run while all 32 decode.
3. The per-step mask work: time in grammar_bitmasks (the core's bitmasks of the constrained
   rows, filled by llguidance's executor) and apply_grammar_bitmask (the sampler's -inf fill) and
   in the matchers' advance, per constrained row, against the decode step.
4. With --llama-server PATH: the same prompts (as token ids), max_tokens and schema through
   llama-server's /completion `json_schema` (its GBNF path), 32 slots, the same two runs.

    python benchmarks/bench_structured.py [--repeats 3] [--max-tokens 64] [--llama-server PATH]

Prints the CPU capability and the load average it ran under: on a shared 2-core machine the
figures move with the load; the runs interleave so that load falls on both.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import free_port  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"]}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 50}
N = 32


def prompts(tok) -> list[list[int]]:
    """32 chat prompts (SmolLM2's ChatML), each asking for people in a different town."""
    out = []
    for i in range(N):
        text = (f"<|im_start|>user\nList fifty people who live in town number {i} as a JSON array of "
                f"objects with name, age, city and hobbies.<|im_end|>\n<|im_start|>assistant\n")
        out.append(tok.encode(text))
    return out


def compile_times(engine, repeats: int = 20) -> dict:
    """ms: llguidance tokenizer build, cold compiles (a new schema each), cached lookups."""
    from kvserve.structured import StructuredOutputsParams as SO
    from kvserve.structured.compiler import GrammarCompiler, ll_tokenizer
    from kvserve.structured.matcher import SequenceGrammar

    t = time.perf_counter()
    ll_tokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.core.eos_token_id)
    build = time.perf_counter() - t
    comp = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.core.eos_token_id)
    cold, cached = [], []
    for i in range(repeats):
        so = SO(json=dict(SCHEMA, title=f"people {i}"))
        t = time.perf_counter()
        matcher, vocab = comp.submit(so).result()
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        SequenceGrammar(*comp.submit(so).result(), )      # a hit and the sequence's own copy
        cached.append(time.perf_counter() - t)
    comp.close()
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)
    return {"tokenizer_build_ms": round(1e3 * build, 1), "cold_compile_ms": ms(cold),
            "cached_ms": ms(cached), "runs": repeats}


class StepProbe:
    """Times every engine step, and inside it the mask work (the core's bitmasks of the
    constrained rows, then the sampler's -inf fill) and the matchers' advance."""

    def __init__(self):
        import kvserve.engine.worker_view as worker_view
        import kvserve.worker.sampling as sampling
        from kvserve.structured.matcher import SequenceGrammar

        self.mask = self.accept = 0.0
        self.rows = 0
        real_bitmasks, real_apply = worker_view.grammar_bitmasks, sampling.apply_grammar_bitmask
        real_accept = SequenceGrammar.accept

        def bitmasks(grammars):
            t = time.perf_counter()
            try:
                return real_bitmasks(grammars)
            finally:
                self.mask += time.perf_counter() - t
                self.rows += len(grammars)

        def apply(x, rows, bitmask):
            t = time.perf_counter()
            try:
                return real_apply(x, rows, bitmask)
            finally:
                self.mask += time.perf_counter() - t

        def accept(g, token_id):
            t = time.perf_counter()
            try:
                return real_accept(g, token_id)
            finally:
                self.accept += time.perf_counter() - t

        worker_view.grammar_bitmasks, sampling.apply_grammar_bitmask = bitmasks, apply
        SequenceGrammar.accept = accept


def run_kvserve(engine, ids: list[list[int]], constrained: set[int], max_tokens: int, probe: StepProbe) -> dict:
    from kvserve import SamplingParams
    from kvserve.structured import StructuredOutputsParams as SO

    so = SO(json=SCHEMA)
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                structured_outputs=so if i in constrained else None)
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    finish, tokens, decode_steps = {}, {}, []
    mask0, rows0 = probe.mask + probe.accept, probe.rows
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) == N and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in engine.scheduler.running)
        t = time.perf_counter()
        outs = engine.step()
        if full:
            decode_steps.append(time.perf_counter() - t)
        for o in outs:
            if o.finished:
                finish[o.request_id] = time.perf_counter() - t0
                tokens[o.request_id] = len(o.outputs[0].token_ids)
                assert o.outputs[0].finish_reason == "length", o.outputs[0]
    out = {"decode_step_ms": 1e3 * statistics.mean(decode_steps), "decode_steps": len(decode_steps),
           "mask_and_advance_s": probe.mask + probe.accept - mask0, "mask_rows": probe.rows - rows0}
    return out | half_rates({i: tokens[f"r{i}"] for i in range(N)}, {i: finish[f"r{i}"] for i in range(N)})


def half_rates(tokens: dict, finish: dict) -> dict:
    """Output tok/s of half A (the even requests: under the schema in the mixed runs) and of half
    B (the odd ones: always free): the half's tokens / the time from the run's start to its last finish."""
    out = {}
    for name, members in (("A", range(0, N, 2)), ("B", range(1, N, 2))):
        out[f"{name}_tok_s"] = sum(tokens[i] for i in members) / max(finish[i] for i in members)
    return out


def run_llama_server(url: str, ids: list[list[int]], constrained: set[int], max_tokens: int) -> dict:
    import httpx

    t0, finish, tokens = time.perf_counter(), {}, {}

    def one(i):
        body = {"prompt": ids[i], "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False}
        if i in constrained:
            body["json_schema"] = SCHEMA
        r = httpx.post(f"{url}/completion", json=body, timeout=600)
        r.raise_for_status()
        finish[i], tokens[i] = time.perf_counter() - t0, r.json()["tokens_predicted"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return half_rates(tokens, finish)


def start_llama_server(path: str, gguf: str, threads: int, ctx: int):
    port = free_port()
    proc = subprocess.Popen([path, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(N),
                             "-cb", "-t", str(threads), "-c", str(N * ctx)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary to compare with")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()

    from kvserve.frontend.llm_engine import LLMEngine
    from kvserve.config import EngineConfig
    from kvserve.config.default_model import default_model_path

    gguf = default_model_path()
    engine = LLMEngine(EngineConfig(model=gguf, max_num_seqs=N, max_num_batched_tokens=2048))
    ids = prompts(engine.tokenizer)
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              "load_average_start": os.getloadavg(), "max_tokens": args.max_tokens, "requests": N,
              "compile": compile_times(engine)}
    probe = StepProbe()
    half = set(range(0, N, 2))
    run_kvserve(engine, ids, half, 8, probe)                        # warm-up (and the one cold compile)
    runs = {"all_free": [], "mixed": []}
    for _ in range(args.repeats):
        runs["all_free"].append(run_kvserve(engine, ids, set(), args.max_tokens, probe))
        runs["mixed"].append(run_kvserve(engine, ids, half, args.max_tokens, probe))
    med = lambda runs_, name, key: statistics.median(r[key] for r in runs_[name])
    mixed = runs["mixed"]
    kv = {"all_free_A_tok_s": med(runs, "all_free", "A_tok_s"), "all_free_B_tok_s": med(runs, "all_free", "B_tok_s"),
          "mixed_A_constrained_tok_s": med(runs, "mixed", "A_tok_s"), "mixed_B_free_tok_s": med(runs, "mixed", "B_tok_s"),
          "all_free_decode_step_ms": med(runs, "all_free", "decode_step_ms"),
          "mixed_decode_step_ms": med(runs, "mixed", "decode_step_ms")}
    rows = sum(r["mask_rows"] for r in mixed)
    kv["mask_and_advance_us_per_row"] = 1e6 * sum(r["mask_and_advance_s"] for r in mixed) / rows
    kv["mask_and_advance_per_row_of_step_pct"] = 100 * kv["mask_and_advance_us_per_row"] / 1e3 / kv["mixed_decode_step_ms"]
    kv["free_loss_pct"] = 100 * (1 - kv["mixed_B_free_tok_s"] / kv["all_free_B_tok_s"])
    kv["constrained_loss_pct"] = 100 * (1 - kv["mixed_A_constrained_tok_s"] / kv["all_free_A_tok_s"])
    result["kvserve"] = {k: round(v, 3) for k, v in kv.items()}
    result["kvserve_runs"] = runs
    print(json.dumps(result["kvserve"], indent=2), flush=True)
    if args.llama_server:
        proc, url = start_llama_server(args.llama_server, gguf, torch.get_num_threads(),
                                       max(len(p) for p in ids) + args.max_tokens + 16)
        try:
            run_llama_server(url, ids, half, 8)
            lr = {"all_free": [], "mixed": []}
            for _ in range(args.repeats):
                lr["all_free"].append(run_llama_server(url, ids, set(), args.max_tokens))
                lr["mixed"].append(run_llama_server(url, ids, half, args.max_tokens))
            ls = {"all_free_A_tok_s": med(lr, "all_free", "A_tok_s"), "all_free_B_tok_s": med(lr, "all_free", "B_tok_s"),
                  "mixed_A_constrained_tok_s": med(lr, "mixed", "A_tok_s"), "mixed_B_free_tok_s": med(lr, "mixed", "B_tok_s")}
            ls["free_loss_pct"] = 100 * (1 - ls["mixed_B_free_tok_s"] / ls["all_free_B_tok_s"])
            ls["constrained_loss_pct"] = 100 * (1 - ls["mixed_A_constrained_tok_s"] / ls["all_free_A_tok_s"])
            result["llama_server"] = {k: round(v, 3) for k, v in ls.items()}
            result["llama_server_runs"] = lr
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result["load_average_end"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_runs")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
