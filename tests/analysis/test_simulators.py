"""Seeded simulations against the seeds' numbers (tolerance: a few points, or the seed's own order of
magnitude where the seed reports one run of a random widget), plus properties of the simulators."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.analysis.simulate import (batching_experiment, chunked_prefill_schedule, harmonic,
                                       simulate_batching, simulate_serving, simulate_static_utilization,
                                       static_batch_utilization, static_utilization_theory, widget_requests)
from kvserve.analysis.specs import HARDWARE, MODELS
from kvserve.analysis.stepmodel import StepModel


# -- static batching utilisation (seed 003 theorem) ------------------------------------------------
def test_static_utilisation_theorem_and_simulation():
    # seed 003: 1/H_B, "about 24.6%" at B = 32, checked by simulation with 4,000 batches
    assert round(static_utilization_theory(32), 3) == 0.246
    for B in (1, 8, 32, 128):
        assert simulate_static_utilization(B, n_batches=4000, seed=B) == pytest.approx(1 / harmonic(B), abs=0.01)


def test_doubling_the_batch_adds_ln2_to_H():
    # seed 003: "Doubling the batch adds about ln 2 ~ 0.69 to H_B"
    assert harmonic(64) - harmonic(32) == pytest.approx(np.log(2), abs=0.01)


def test_opening_example_5_5_percent():
    # seed 003: 31 answers of 50 tokens and one of 2,000: 3,550 of 64,000 row-steps, 5.5%
    assert round(static_batch_utilization([50] * 31 + [2000]), 3) == 0.055


# -- the continuous-vs-static experiment (seed 003 cell) -------------------------------------------
SEEDS = range(10)


@pytest.fixture(scope="module")
def experiment():
    return {rate: [batching_experiment(rate, seed=s) for s in SEEDS] for rate in (0.03, 0.12)}


def test_low_rate_both_about_19_percent_busy(experiment):
    # seed 003: "at a light load of 0.03 arrivals per step ... slots busy 19% of the time either way"
    for pol in ("static", "continuous"):
        u = np.mean([r[pol]["utilization"] for r in experiment[0.03]])
        assert u == pytest.approx(0.19, abs=0.02)


def test_low_rate_static_waits(experiment):
    # seed 003: static "makes the average request wait about 500 steps ..., and one in a hundred waits
    # about 2,000". Mean over 10 seeds: 476 (tolerance 350-650). The p99 we get is 1,524 pooled over
    # the 10 runs (single runs 1,184-2,001): the seed's policy details are not given, so the test asks for
    # the seed's order of magnitude (1,000-2,500) and docs/planning.md records the gap.
    runs = experiment[0.03]
    assert 350 <= np.mean([r["static"]["mean_wait"] for r in runs]) <= 650
    pooled = np.concatenate([r["static"]["waits"] for r in runs])
    assert 1000 <= np.percentile(pooled, 99) <= 2500
    # continuous batching admits everyone at once at this load
    assert np.mean([r["continuous"]["frac_admitted_at_once"] for r in runs]) > 0.99


def test_high_rate_static_saturates_near_24_percent(experiment):
    # seed 003: at 0.12/step static "saturates at about 24% of its slots, the 1/H_32 of the theorem ...
    # the mean wait reaches about 9,000 steps"; continuous "still admits nearly everyone at once"
    runs = experiment[0.12]
    assert np.mean([r["static"]["utilization"] for r in runs]) == pytest.approx(0.24, abs=0.02)
    assert 6000 <= np.mean([r["static"]["mean_wait"] for r in runs]) <= 12000
    assert np.mean([r["continuous"]["frac_admitted_at_once"] for r in runs]) > 0.75
    assert np.mean([r["continuous"]["mean_wait"] for r in runs]) < 50
    # offered load 0.12 x 200 = 24 tokens/step = 3/4 of 32 slots: continuous carries it
    assert np.mean([r["continuous"]["utilization"] for r in runs]) == pytest.approx(0.75, abs=0.06)


@given(st.lists(st.tuples(st.floats(0, 50), st.integers(1, 40)), min_size=1, max_size=40), st.integers(1, 6))
@settings(max_examples=80, deadline=None, derandomize=True)
def test_continuous_never_waits_longer_than_static(reqs, B):
    # seed 003: "Under continuous batching nobody ever waits longer than under static batching,
    # whatever the traffic."
    reqs.sort()
    arr = [a for a, _ in reqs]
    out = [o for _, o in reqs]
    s = simulate_batching(arr, out, B, "static")
    c = simulate_batching(arr, out, B, "continuous")
    assert np.all(c["start"] <= s["start"] + 1e-9)
    assert np.all(c["finish"] <= s["finish"] + 1e-9)


def test_thousand_requests_are_each_served_once_on_32_slots():
    """Seed 003's cell at its full size: each of the 1,000 requests is served once, never before
    it arrives, for its whole length, never more than 32 at a time; continuous batching ends no
    later than static. (How fast the simulator runs is a benchmark's business, not a test's.)"""
    cell = batching_experiment(0.12, n_requests=1000, seed=1)
    for policy, r in cell.items():
        assert len(r["start"]) == len(r["finish"]) == 1000
        assert np.all(r["waits"] >= 0) and np.all(r["finish"] > r["start"]), policy
        starts, finishes = np.sort(r["start"]), np.sort(r["finish"])
        in_service = np.arange(1, 1001) - np.searchsorted(finishes, starts, side="right")   # at each start
        assert in_service.max() <= 32, policy
        assert 0 < r["utilization"] <= 1 and r["total_steps"] == r["finish"].max()
    assert cell["continuous"]["total_steps"] <= cell["static"]["total_steps"]


# -- the chunked-prefill widget (seed 003) ---------------------------------------------------------
@pytest.fixture(scope="module")
def widget():
    sm = StepModel(MODELS["llama-3.1-8b"], HARDWARE["h100"], mfu=0.5, t0=0.3e-3)
    out = {}
    for name, pol, budget in [("static", "static", None), ("continuous", "continuous", None),
                              ("64", "chunked", 64), ("512", "chunked", 512), ("4096", "chunked", 4096)]:
        out[name] = [simulate_serving(widget_requests(seed), sm, 8, pol, budget) for seed in range(5)]
    return out


def _mean(widget, name, key):
    return float(np.mean([r[key] for r in widget[name]]))


def test_widget_everyone_finishes(widget):
    for runs in widget.values():
        assert all(r["finished"] == 48 for r in runs)


def test_widget_longest_gap_direction_and_values(widget):
    # seed 003 (one run of its widget): longest gap ~300 ms continuous, 20 ms at budget 512, 6 ms at
    # 64, 142 ms at 4,096. Ours (mean of 5 seeds) must move the same way and sit within the seed's order.
    g = {k: _mean(widget, k, "longest_gap_s") * 1e3 for k in ("continuous", "64", "512", "4096")}
    assert g["64"] < g["512"] < g["4096"] < g["continuous"]
    assert 4 <= g["64"] <= 9
    assert 15 <= g["512"] <= 30
    assert 100 <= g["4096"] <= 200
    assert 150 <= g["continuous"] <= 450


def test_widget_ttft_direction_and_values(widget):
    # seed 003: p99 TTFT 0.87 s continuous, 0.54 s at 512, 1.9 s at 64; static batches wait far longer
    t = {k: _mean(widget, k, "ttft_p99_s") for k in widget}
    assert t["64"] > t["512"] and t["continuous"] > t["512"]
    assert t["static"] > 3 * t["continuous"]
    assert 0.2 <= t["512"] <= 1.2
    assert 0.3 <= t["continuous"] <= 2.0
    assert 0.6 <= t["64"] <= 4.0


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 300), st.integers(1, 20)), min_size=1, max_size=12),
       st.integers(2, 256))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_chunked_prefill_schedule_properties(reqs, budget):
    steps, first, finish = chunked_prefill_schedule(reqs, budget)
    pre = [0] * len(reqs)
    dec = [0] * len(reqs)
    for s in steps:
        n_tok = len(s["decode"]) + sum(c for _, c in s["prefill"])
        assert n_tok <= max(budget, len(s["decode"]))   # decodes first, chunks fill the rest
        for i in s["decode"]:
            dec[i] += 1
        for i, c in s["prefill"]:
            pre[i] += c
    for i, (a, p, o) in enumerate(reqs):
        assert pre[i] == p and dec[i] == o - 1
        assert a <= first[i] <= finish[i]
        # a prompt of p tokens alone needs at least ceil(p / budget) steps
        assert first[i] - a + 1 >= -(-p // budget)
