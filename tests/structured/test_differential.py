"""The differential harness (tests/reference/test_differential.py) with a share of constrained
requests: seeded workloads where half of the greedy and sampled requests carry a grammar (a
choice, a regex, a JSON schema), run through engines with tiny pools (preemption by recompute
and by swap), chunking budgets and prefix caching (hash, radix), and through the big reference
engine: every request that finished in both is equal token for token (prefix-equal where the
tiny pool cut it for length), integrity holds after every step (each matcher has consumed
exactly its sequence's output), and over the seeds constrained requests really were preempted."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kvserve import LLM
from kvserve.structured import StructuredOutputsParams as SO
from tests.conftest import STORIES_HF
from tests.reference.test_differential import CONSTRAINED, check_pressure, make_workload, run, tokens, unconstrained

GRAMMARS = [SO(choice=["yes", "no", "maybe"]), SO(regex=r"(Tom|Lily) (ran|sat|had) [a-z ]{1,20}\."),
            SO(json={"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9},
                                                      "v": {"type": "string", "maxLength": 6}},
                     "required": ["k", "v"]}),
            SO(regex=r"[a-z]+( [a-z]+)*")]
SETTINGS = [CONSTRAINED[0], CONSTRAINED[1], CONSTRAINED[2], CONSTRAINED[5]]   # recompute, swap, radix, swap
SEEDS_PER_SETTING = 6


def constrained_workload(rng: random.Random, n: int) -> list[dict]:
    """make_workload's requests, half of the non-beam ones with a grammar (and room to finish it)."""
    work = make_workload(rng, n)
    for w in work:
        if w["kind"] != "beam" and rng.random() < 0.5:
            p = w["params"]
            w["params"] = dataclasses.replace(p, structured_outputs=rng.choice(GRAMMARS),
                                              max_tokens=p.max_tokens + 16)
            w["kind"] += "+grammar"
    return work


@pytest.fixture(scope="module")
def reference():
    return unconstrained()


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_constrained_requests_under_pressure_equal_the_reference(reference, setting):
    stats, preempted_grammars, compared = [], 0, 0
    for seed in range(setting, setting + SEEDS_PER_SETTING * len(SETTINGS), len(SETTINGS)):
        rng = random.Random(1000 + seed)
        settings = dict(SETTINGS[setting], watermark=rng.choice([0.0, 0.05]))
        workload = constrained_workload(rng, rng.randrange(8, 14))
        small = LLM(str(STORIES_HF), **settings)
        sched, preempt = small.engine.scheduler, small.engine.scheduler._preempt

        def recording(req, *a, **k):
            nonlocal preempted_grammars
            group = preempt(req, *a, **k)
            preempted_grammars += sum(r.grammar is not None for r in group)
            return group

        sched._preempt = recording
        got, refused = run(small, workload, check=True)
        want, _ = run(reference, [dict(w, abort=None) for w in workload if w["id"] not in refused], check=False)
        for w in workload:
            rid = w["id"]
            if rid not in got or w["abort"] is not None:
                continue
            for i, (x, y) in enumerate(zip(tokens(got[rid]), tokens(want[rid]))):
                if got[rid].outputs[i].finish_reason == "length" and len(x) < len(y):
                    assert x == y[:len(x)], (seed, rid, w["kind"])     # outgrew the tiny pool
                else:
                    assert x == y, (seed, rid, w["kind"])
            compared += "grammar" in w["kind"]
        stats.append(small.engine.stats())
    assert compared >= 6, "too few constrained requests compared"
    check_pressure(SETTINGS[setting], stats)
    assert preempted_grammars > 0, "no constrained sequence was ever preempted"
