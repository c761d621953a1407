"""Structured outputs in /metrics: Prometheus families from `EngineStats.structured_outputs`
(the engine's GrammarWaitList.stats(), a plain dict so that it crosses the core's pipe).

    kvserve:grammar_compile_time_seconds         histogram of grammar compiles (cache misses)
    kvserve:grammar_compiles_total               compiles run (errors included)
    kvserve:grammar_compile_errors_total         compiles that failed
    kvserve:grammar_compile_timeouts_total       requests failed by --max-grammar-compile-s
    kvserve:grammar_cache_hits_total             requests whose grammar was cached (or compiling)
    kvserve:num_requests_waiting_for_grammar     sequences in WAITING_FOR_GRAMMAR (gauge)
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_COUNTERS = (("compiles", "kvserve:grammar_compiles", "Structured outputs: grammar compiles run."),
             ("compile_errors", "kvserve:grammar_compile_errors",
              "Structured outputs: grammar compiles that failed."),
             ("timeouts", "kvserve:grammar_compile_timeouts",
              "Structured outputs: requests whose grammar was not ready within --max-grammar-compile-s."),
             ("cache_hits", "kvserve:grammar_cache_hits",
              "Structured outputs: requests whose grammar was compiled already (or compiling)."))


def structured_output_metrics(model_name: str, stats: dict | None):
    """The families above for one snapshot; nothing when the engine reports none."""
    if not stats:
        return
    hist = HistogramMetricFamily("kvserve:grammar_compile_time_seconds",
                                 "Structured outputs: time to compile a grammar (cache misses).",
                                 labels=["model_name"])
    buckets = [("+Inf" if b == float("inf") else repr(float(b)), float(n)) for b, n in stats["compile_time_buckets"]]
    hist.add_metric([model_name], buckets, sum_value=float(stats["compile_time_sum"]))
    yield hist
    for key, name, doc in _COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model_name], float(stats[key]))
        yield fam
    gauge = GaugeMetricFamily("kvserve:num_requests_waiting_for_grammar",
                              "Structured outputs: sequences waiting for their grammar to compile.",
                              labels=["model_name"])
    gauge.add_metric([model_name], float(stats["num_waiting_for_grammar"]))
    yield gauge
