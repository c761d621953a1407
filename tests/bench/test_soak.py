"""benchmarks/soak.py's arithmetic (the soak itself runs for minutes and is not a test): the
least-squares slope, the warm-up cut and the growth figures on synthetic samples; and
kvserve/memory_probe.py's record on a toy object graph."""
from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvserve import memory_probe

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fit_slope_is_least_squares(soak):
    xs = [0, 1, 2, 3, 4]
    assert soak.fit_slope(xs, [3 + 2 * x for x in xs]) == pytest.approx(2.0)
    assert soak.fit_slope(xs, [1, 3, 2, 5, 4]) == pytest.approx(0.8)      # numpy.polyfit's
    assert soak.fit_slope([1, 1, 1], [1, 2, 3]) is None
    assert soak.fit_slope([1, 2], [1, 2]) is None


def test_summary_tells_warmup_from_a_leak(soak):
    """RSS steps up during warm-up, then leaks 0.5 MiB per 1,000 requests: the warm-up growth
    is the step, the slope after the cut the leak."""
    samples = [{"t": 0, "phase": "idle", "requests": 0, "api": {"rss_mib": 100.0}, "engine": {"rss_mib": 200.0}}]
    for i in range(100):
        req = 100 * i
        engine = 200.0 + (40.0 if i >= 10 else 4.0 * i) + (0.5 * (req - 3000) / 1000 if req > 3000 else 0)
        samples.append({"t": i + 1, "phase": "load", "requests": req, "api": {"rss_mib": 110.0},
                        "engine": {"rss_mib": engine}, "metrics": {}})
    s = soak.summarize(samples, warmup_frac=0.3)
    assert s["requests"] == 9900
    assert s["engine_rss_mib"]["warmup_growth"] == pytest.approx(40.0, abs=0.5)
    assert s["engine_rss_mib"]["slope_per_10k_requests"] == pytest.approx(5.0, rel=0.01)
    assert s["api_rss_mib"]["warmup_growth"] == 10.0
    assert s["api_rss_mib"]["slope_per_10k_requests"] == pytest.approx(0.0, abs=1e-9)
    assert s["kv_blocks_in_use"]["slope_per_10k_requests"] is None


def test_parse_metrics_sums_labels(soak):
    m = soak.parse_metrics('# HELP x\nkvserve:a{t="1"} 2.0\nkvserve:a{t="2"} 3\nkvserve:b 1e3\n')
    assert m["kvserve:a"] == 5.0 and m['kvserve:a{t="1"}'] == 2.0 and m["kvserve:b"] == 1000.0


class _Cache:
    def __init__(self):
        self.entries = OrderedDict((i, str(i)) for i in range(7))
        self.inner = _Inner()


class _Inner:
    __slots__ = ("queue",)

    def __init__(self):
        self.queue = [1, 2, 3]


_Cache.__module__ = _Inner.__module__ = "kvserve.test_probe"     # walked into: "ours"


def test_probe_record_names_containers_by_path(tmp_path, monkeypatch):
    rec = memory_probe.record({"root": _Cache()})
    assert rec["sizes"]["root.entries"] == 7
    assert rec["sizes"]["root.inner.queue"] == 3
    assert rec["gc_objects"] > 0 and "builtins.dict" in rec["types"]
    json.dumps(rec)
    monkeypatch.delenv(memory_probe.ENV, raising=False)
    assert memory_probe.start("x", {}) is None
