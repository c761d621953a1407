"""The serving benchmark's arithmetic: percentiles, TPOT, goodput, arrivals, datasets, the knee."""
from __future__ import annotations

import argparse
import json
import math
import random

import numpy as np
import pytest

from kvserve.bench.datasets import build_dataset
from kvserve.bench.report import find_knee, format_summary, format_sweep_table, latency_stats, plot_sweep, summarize
from kvserve.bench.serve import RequestResult, add_cli_args, arrival_gaps, parse_rates

from tests.server.live import STORIES_HF


def _args(*argv):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


def test_latency_stats_are_numpy_percentiles_in_ms():
    rng = np.random.default_rng(0)
    xs = rng.exponential(0.05, size=1000)
    s = latency_stats(xs, [50, 90, 99])
    assert s["mean"] == pytest.approx(xs.mean() * 1000)
    assert s["median"] == pytest.approx(np.median(xs) * 1000)
    assert s["p99"] == pytest.approx(np.percentile(xs, 99) * 1000)
    assert math.isnan(latency_stats([], [99])["p99"])


def test_latency_stats_literal_values():
    # Five latencies, 10/20/40/80/1000 ms. By hand (linear interpolation at rank (n-1) p / 100):
    # p50 = x[2] = 40; p90: rank 3.6 -> 80 + 0.6 x 920 = 632; p99: rank 3.96 -> 80 + 0.96 x 920 = 963.2;
    # p99.9: rank 3.996 -> 996.32. mean 1150 / 5 = 230; population std sqrt(744,000 / 5) = 385.746.
    s = latency_stats([0.010, 0.020, 0.040, 0.080, 1.0], [50, 90, 99, 99.9])
    assert set(s) == {"mean", "median", "std", "p50", "p90", "p99", "p99.9"}
    assert s["p50"] == pytest.approx(40) and s["median"] == pytest.approx(40)
    assert s["p90"] == pytest.approx(632) and s["p99"] == pytest.approx(963.2)
    assert s["p99.9"] == pytest.approx(996.32)
    assert s["mean"] == pytest.approx(230) and s["std"] == pytest.approx(385.746, abs=1e-3)
    # 1..100 ms: p50 = 50.5, p90 = 90.1 (rank 89.1), p99 = 99.01 (rank 98.01); order of input irrelevant
    s = latency_stats([i / 1000 for i in range(100, 0, -1)], [50, 90, 99])
    assert (s["p50"], s["p90"], s["p99"]) == (pytest.approx(50.5), pytest.approx(90.1), pytest.approx(99.01))


def _result(ttft, n_out, itl, start=0.0, ok=True):
    e2e = ttft + sum(itl)
    return RequestResult(success=ok, prompt_len=10, output_len=n_out, ttft=ttft, itl=list(itl), e2e=e2e,
                         start=start, error=None if ok else "HTTP 500: boom")


def test_tpot_goodput_and_counts():
    # r1: fast. r2: slow first token. r3: slow decode. r4: failed.
    r1 = _result(0.10, 5, [0.01] * 4, start=0.0)
    r2 = _result(0.90, 5, [0.01] * 4, start=0.5)
    r3 = _result(0.10, 5, [0.20] * 4, start=1.0)
    r4 = RequestResult(success=False, error="HTTP 503: overloaded", start=1.5, e2e=0.01)
    assert r1.tpot == pytest.approx(0.01)
    assert r3.tpot == pytest.approx(0.20)
    assert _result(0.1, 1, []).tpot is None                 # one token: no TPOT
    s = summarize([r1, r2, r3, r4], duration_s=2.0, slo_ttft_ms=500, slo_tpot_ms=50)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["errors"] == {"HTTP 503: overloaded": 1}
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_output_tokens"] == 15 and s["output_throughput"] == pytest.approx(7.5)
    assert s["total_input_tokens"] == 30
    assert s["mean_itl_ms"] == pytest.approx(np.mean([10] * 8 + [200] * 4))
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["max_concurrent_requests"] == 2      # r1 [0, 0.14] and r2 [0.5, 0.94] don't overlap; r2 and r3 do
    text = format_summary(s)
    assert "Request goodput (req/s):" in text and "P99 ITL (ms):" in text


def test_poisson_arrivals():
    rng = random.Random(1)
    gaps = arrival_gaps(20000, 4.0, 1.0, rng)
    assert gaps[0] == 0.0
    assert np.mean(gaps[1:]) == pytest.approx(0.25, rel=0.03)
    assert np.std(gaps[1:]) == pytest.approx(0.25, rel=0.05)            # exponential: std == mean
    steady = arrival_gaps(20000, 4.0, 10.0, random.Random(1))
    assert np.mean(steady[1:]) == pytest.approx(0.25, rel=0.03)
    assert np.std(steady[1:]) < 0.5 * np.std(gaps[1:])                  # gamma shape 10: steadier
    assert arrival_gaps(5, math.inf, 1.0, rng) == [0.0] * 5
    assert parse_rates("0.5, 1,inf") == [0.5, 1.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("0,1")


def test_random_dataset_lengths_with_tokenizer():
    from tokenizers import Tokenizer

    args = _args("--dataset-name", "random", "--num-prompts", "20", "--random-input-len", "50",
                 "--random-output-len", "7", "--random-range-ratio", "0.2", "--tokenizer", str(STORIES_HF))
    convs = build_dataset(args)
    assert len(convs) == 20 and all(len(c.turns) == 1 for c in convs)
    tok = Tokenizer.from_file(str(STORIES_HF / "tokenizer.json"))
    for c in convs:
        t = c.turns[0]
        assert 40 <= t.prompt_len <= 60 and 5 <= t.output_len <= 8
        # token ids by default (exact); test_bench_prompt_lengths.py checks the text format
        assert t.exact_len and len(t.prompt_token_ids) == t.prompt_len
        assert t.text == tok.decode(t.prompt_token_ids)
    again = build_dataset(args)
    assert [c.turns[0].text for c in again] == [c.turns[0].text for c in convs]      # seeded


def test_prefix_chat_and_jsonl_datasets(tmp_path):
    args = _args("--dataset-name", "prefix", "--num-prompts", "8", "--prefix-num-prefixes", "2",
                 "--prefix-len", "30", "--prefix-question-len", "5")
    texts = [c.turns[0].text for c in build_dataset(args)]
    heads = [t.split("\n")[0] for t in texts]
    assert len(set(heads)) == 2 and heads[0] == heads[2] == heads[4]
    assert len(set(texts)) == 8

    args = _args("--dataset-name", "chat", "--num-prompts", "12", "--chat-turns", "3")
    convs = build_dataset(args)
    assert len(convs) == 4 and all(len(c.turns) == 3 for c in convs)

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a b c", "output_len": 3}) + "\n\n" +
                    json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    convs = build_dataset(_args("--dataset-name", "jsonl", "--dataset-path", str(path), "--random-output-len", "9"))
    assert [(c.turns[0].text, c.turns[0].output_len) for c in convs] == [("a b c", 3), ("hi", 9)]
    assert convs[1].turns[0].messages == [{"role": "user", "content": "hi"}]


def test_knee_of_a_hockey_stick():
    # throughput saturates near 42 tok/s while p99 TTFT explodes: the knee is the last cheap point
    assert find_knee([10, 20, 30, 40, 41, 42], [10, 10, 11, 12, 100, 1000]) == 3
    # Kneedle picks the point furthest below the chord, scaled to the whole curve: 150 ms is
    # still "flat" next to 3000 ms.
    assert find_knee([10, 20, 40, 80, 95, 98, 99], [50, 51, 53, 60, 150, 900, 3000]) == 4
    assert find_knee([1, 2, 3, 4], [1, 2, 3, 4]) is None          # a straight line has no knee
    assert find_knee([1, 2], [1, 5]) is None


def test_sweep_plot_and_table(tmp_path):
    rows = []
    for rate, x, ttft, itl in [(1, 10, 50, 5), (2, 20, 52, 5), (4, 40, 55, 6), (8, 70, 90, 9),
                               (math.inf, 80, 2000, 30)]:
        rows.append({"request_rate": rate, "output_throughput": x, "request_throughput": x / 10,
                     "p50_ttft_ms": ttft / 2, "p99_ttft_ms": ttft, "p50_itl_ms": itl / 2, "p99_itl_ms": itl,
                     "p99_tpot_ms": itl, "p99_e2el_ms": ttft * 3, "failed": 0})
    out = tmp_path / "curve.png"
    knees = plot_sweep({"a": rows, "b": rows[:4]}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10000
    assert knees["a"] == 3
    table = format_sweep_table(rows)
    assert table.splitlines()[0].startswith("| rate (req/s)") and "| inf |" in table
