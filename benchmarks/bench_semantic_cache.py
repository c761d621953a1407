"""The semantic answer cache (issue 15): a threshold sweep on the labelled pairs of
tests/answer_cache/pairs.py (hit rate against wrong-answer rate, plotted), the embedding cost per
query, and the latency of a miss, an exact hit and a semantic hit on a live server of
stories260K with `--answer-cache semantic`.

    python benchmarks/bench_semantic_cache.py [--plot benchmarks/results/semantic_sweep.png] \\
        [--out benchmarks/results/semantic_cache.md] [--repeats 5]

For each pair (q1, q2) the cache holds q1's answer and is asked q2: a hit on a paraphrase is a
right answer, a hit on a near-duplicate ("delete a file" / "delete a folder") a wrong one.
hit rate = hits / pairs; wrong-answer rate = wrong hits / hits. Not a timed test: the latencies
depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.answer_cache.semantic import Embedder, SemanticCache  # noqa: E402
from tests.answer_cache.pairs import PAIRS  # noqa: E402
from tests.server.live import LiveServer  # noqa: E402

THRESHOLDS = [round(x, 3) for x in np.arange(0.60, 1.0001, 0.025)]


def sweep(embed) -> tuple[list[dict], list[float]]:
    a, b = embed([p[0] for p in PAIRS]), embed([p[1] for p in PAIRS])
    sims = []
    for i in range(len(PAIRS)):
        cache = SemanticCache(threshold=-1.0)
        cache.insert("s", a[i], i)
        sims.append(cache.nearest("s", b[i]).similarity)
    rows = []
    for t in THRESHOLDS:
        hits = [same for s, (_, _, same) in zip(sims, PAIRS) if s >= t]
        wrong = sum(not h for h in hits)
        rows.append({"threshold": t, "hit_rate": len(hits) / len(PAIRS),
                     "wrong_rate": wrong / len(hits) if hits else 0.0,
                     "recall": sum(hits) / sum(p[2] for p in PAIRS), "wrong_hits": wrong})
    return rows, sims


def embed_cost(embed, repeats: int) -> float:
    times = []
    for i in range(repeats * 4):
        q = PAIRS[i % len(PAIRS)][0]
        t0 = time.perf_counter()
        embed([q])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flat_search_cost(sizes=(1_000, 10_000, 100_000)) -> dict[int, float]:
    """Median seconds of one IndexFlatIP search (k=4) over n random unit vectors: where exact
    search stops being negligible beside a ~10 ms embedding, HNSW would pay."""
    import faiss

    faiss.omp_set_num_threads(1)            # as SemanticCache sets it
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        x = rng.standard_normal((n, 384)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        index = faiss.IndexFlatIP(384)
        index.add(x)
        times = []
        for q in x[:50]:
            t0 = time.perf_counter()
            index.search(q.reshape(1, -1), 4)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out


def latencies(repeats: int) -> dict:
    srv = LiveServer("--answer-cache", "semantic")
    out = {"miss": [], "hit-exact": [], "hit-semantic": []}
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120, trust_env=False) as c:
            c.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2, "temperature": 0})
            paraphrases = [p for p in PAIRS if p[2]]
            for r in range(repeats):
                for q1, q2, _ in paraphrases:
                    body = {"max_tokens": 32, "temperature": 0, "seed": r}
                    for prompt in (q1, q1, q2):
                        t0 = time.perf_counter()
                        resp = c.post("/v1/completions", json={**body, "prompt": prompt})
                        dt = time.perf_counter() - t0
                        kind = resp.headers.get("x-kvserve-cache", "?")
                        out.setdefault(kind, []).append(dt)
        m = srv.metrics()
        out["embed_server_s"] = (m.get("kvserve:semantic_cache_embedding_seconds_sum", 0.0) /
                                 max(1.0, m.get("kvserve:semantic_cache_embedding_seconds_count", 0.0)))
    finally:
        srv.stop()
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot([r["wrong_rate"] for r in rows], [r["hit_rate"] for r in rows], "o-")
    for r in rows[::2]:
        ax.annotate(f"{r['threshold']:.3g}", (r["wrong_rate"], r["hit_rate"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 2))
    ax.set_xlabel("wrong-answer rate (wrong hits / hits)")
    ax.set_ylabel("hit rate (hits / queries)")
    ax.set_title(f"Semantic cache: threshold sweep\n(all-MiniLM-L6-v2, {len(PAIRS)} labelled pairs)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plot", default="benchmarks/results/semantic_sweep.png")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    embed = Embedder()
    load_s = time.perf_counter() - t0
    rows, _ = sweep(embed)
    cost = embed_cost(embed, args.repeats)
    plot(rows, args.plot)
    lat = latencies(args.repeats)
    flat = flat_search_cost()
    lines = [f"Threshold sweep on {len(PAIRS)} labelled pairs ({sum(p[2] for p in PAIRS)} paraphrases, "
             f"{sum(not p[2] for p in PAIRS)} near-duplicates with other answers); plot: {args.plot}", "",
             "| threshold | hit rate | wrong-answer rate | recall of paraphrases | wrong hits |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threshold']:.3f} | {r['hit_rate']:.2f} | {r['wrong_rate']:.2f} | {r['recall']:.2f} | {r['wrong_hits']} |")
    lines += ["", f"Embedder load: {load_s:.1f} s; one query embedded in-process: median {1000 * cost:.1f} ms; "
              f"in the server (histogram mean): {1000 * lat['embed_server_s']:.1f} ms.", "",
              "| answer (32 tokens, stories260K) | requests | median ms | p90 ms |", "|---|---|---|---|"]
    for kind in ("miss", "hit-exact", "hit-semantic"):
        xs = sorted(lat.get(kind, []))
        if xs:
            lines.append(f"| {kind} | {len(xs)} | {1000 * statistics.median(xs):.1f} | "
                         f"{1000 * xs[int(0.9 * (len(xs) - 1))]:.1f} |")
    lines += ["", "IndexFlatIP search (k=4, 384-d) by entries in one scope: " +
              ", ".join(f"{n}: {1000 * t:.2f} ms" for n, t in flat.items())]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
