"""The semantic cache's near-miss guard (issue 26): precision and recall of "serve from cache"
on the labelled pairs of tests/answer_cache/pairs_hard.py, with the guard and without it, at several
thresholds, through `SemanticCache` itself with the real all-MiniLM-L6-v2.

    python benchmarks/bench_semantic_guard.py [--out benchmarks/results/semantic_guard.md]

For each pair (q1, q2, same answer?) a fresh cache holds q1's answer and is asked q2. Served on a
paraphrase: right; served on a negative: a wrong answer. precision = right / served, recall =
right / paraphrases. Also: what the wrong answers were, per kind of negative, the paraphrases the
guard refuses, the held-out pairs alone (written after the guard was frozen), and the guard's
cost per pair.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.answer_cache.near_miss import near_miss  # noqa: E402
from kvserve.answer_cache.semantic import DEFAULT_THRESHOLD, Embedder, SemanticCache  # noqa: E402
from tests.answer_cache.pairs_hard import HELD_OUT, LABELLED  # noqa: E402

THRESHOLDS = (0.75, 0.8, 0.825, 0.85, 0.875, 0.9, 0.925, 0.95)


def decisions(vectors, pairs, threshold: float, guard: bool) -> list[bool]:
    """Whether each pair's second query is served the first one's answer."""
    out = []
    for a, b, _, _ in pairs:
        cache = SemanticCache(threshold=threshold, guard=guard)
        cache.insert("s", vectors[a], a, a)
        out.append(cache.lookup("s", vectors[b], b) is not None)
    return out


def score(pairs, served) -> tuple[float, float, int]:
    right = sum(s and same for s, (_, _, same, _) in zip(served, pairs))
    n = sum(served)
    return (right / n if n else 1.0), right / sum(p[2] for p in pairs), n - right


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the tables as Markdown here")
    args = ap.parse_args()

    texts = sorted({q for a, b, _, _ in LABELLED for q in (a, b)})
    embed = Embedder()
    vectors = dict(zip(texts, embed(texts)))
    n_pos = sum(p[2] for p in LABELLED)
    lines = [f"{len(LABELLED)} pairs: {n_pos} paraphrases, {len(LABELLED) - n_pos} negatives "
             f"({', '.join(f'{k} {v}' for k, v in Counter(p[3] for p in LABELLED if not p[2]).items())})", "",
             "| threshold | no guard: precision | recall | wrong | guard: precision | recall | wrong |",
             "|---|---|---|---|---|---|---|"]
    for t in THRESHOLDS:
        p0, r0, w0 = score(LABELLED, decisions(vectors, LABELLED, t, False))
        p1, r1, w1 = score(LABELLED, decisions(vectors, LABELLED, t, True))
        mark = " (default)" if t == DEFAULT_THRESHOLD else ""
        lines.append(f"| {t}{mark} | {p0:.3f} | {r0:.3f} | {w0} | {p1:.3f} | {r1:.3f} | {w1} |")

    t = DEFAULT_THRESHOLD
    base, guarded = decisions(vectors, LABELLED, t, False), decisions(vectors, LABELLED, t, True)
    wrong0 = Counter(k for s, (_, _, same, k) in zip(base, LABELLED) if s and not same)
    wrong1 = Counter(k for s, (_, _, same, k) in zip(guarded, LABELLED) if s and not same)
    lines += ["", f"Wrong answers at {t} by kind of negative, without / with the guard: "
              + ", ".join(f"{k} {wrong0[k]} / {wrong1[k]}" for k in wrong0), ""]
    for s, (a, b, same, k) in zip(guarded, LABELLED):
        if s and not same:
            lines.append(f"- served wrongly ({k}): {a!r} -> {b!r}")
    for s0, s1, (a, b, same, _) in zip(base, guarded, LABELLED):
        if same and s0 and not s1:
            lines.append(f"- paraphrase refused ({near_miss(a, b)}): {a!r} / {b!r}")
    ph0, rh0, _ = score(HELD_OUT, decisions(vectors, HELD_OUT, t, False))
    ph1, rh1, wh1 = score(HELD_OUT, decisions(vectors, HELD_OUT, t, True))
    lines += ["", f"Held out ({len(HELD_OUT)} pairs written after the guard was frozen), at {t}: "
              f"precision {ph0:.3f} -> {ph1:.3f}, recall {rh0:.3f} -> {rh1:.3f} ({wh1} wrong)"]

    t0 = time.perf_counter()
    for _ in range(5):
        for a, b, _, _ in LABELLED:
            near_miss(a, b)
    per_pair = (time.perf_counter() - t0) / (5 * len(LABELLED))
    t0 = time.perf_counter()
    for q in texts[:50]:
        embed([q])
    lines.append(f"Guard cost: {per_pair * 1e3:.3f} ms a pair (one query's embedding: "
                 f"{(time.perf_counter() - t0) / 50 * 1e3:.1f} ms)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text("# Semantic cache near-miss guard\n\n`python benchmarks/bench_semantic_guard.py"
                                  f" --out {args.out}`\n\n{text}\n")


if __name__ == "__main__":
    main()
