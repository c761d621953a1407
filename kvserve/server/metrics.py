"""Prometheus metrics for `GET /metrics`, named as vLLM names them under a `kvserve:` prefix.

A Grafana dashboard built for vLLM works after replacing `vllm:` with `kvserve:`.

Per-request histograms, observed once when a request finishes, from the engine's own
`RequestOutput.metrics` timestamps (seed 001's vocabulary, measured inside the server):

    kvserve:time_to_first_token_seconds      arrival -> first generated token
    kvserve:inter_token_latency_seconds      one sample per gap between consecutive tokens
    kvserve:time_per_output_token_seconds    (last token - first token) / (tokens - 1), per request
                                             (also as kvserve:request_time_per_output_token_seconds)
    kvserve:e2e_request_latency_seconds      arrival -> finished
    kvserve:request_queue_time_seconds       arrival -> first scheduled
    kvserve:request_prefill_time_seconds     first scheduled -> first token
    kvserve:request_decode_time_seconds      first token -> last token
    kvserve:request_prompt_tokens            prompt length
    kvserve:request_generation_tokens        generated tokens
    kvserve:request_success_total{finished_reason=stop|length|abort|error|grammar_error}
                                             (grammar_error: the request's own grammar failed it)

Engine state, read from the latest `engine.stats()` snapshot (taken by the engine loop thread
after every step, because the engine is not thread-safe) at scrape time:

    kvserve:num_requests_running, kvserve:num_requests_waiting, kvserve:kv_cache_usage_perc,
    kvserve:num_kv_blocks_free, kvserve:num_kv_blocks_total (gauges);
    kvserve:num_preemptions_total, kvserve:prompt_tokens_total, kvserve:generation_tokens_total,
    kvserve:prefix_cache_queries_total, kvserve:prefix_cache_hits_total (counters; the prefix
    cache pair counts tokens, and is present when the engine reports it);
    kvserve:engine_steps_total, kvserve:engine_forward_time_seconds_total,
    kvserve:engine_step_time_seconds_total (counters: divide by steps for the mean step time);
    kvserve:spec_decode_num_drafts_total, kvserve:spec_decode_num_draft_tokens_total,
    kvserve:spec_decode_num_accepted_tokens_total and
    kvserve:spec_decode_num_accepted_tokens_per_pos_total{position} (speculative decoding,
    vLLM's names: acceptance rate = accepted / draft tokens; 0 with speculation off).

KV tiers (kv/connector.py): kvserve:kv_tier_{hit_blocks,bytes_loaded,saved_blocks,bytes_saved,
corrupt_blocks,failures,bytes_refused}_total{tier}, kvserve:kv_tier_bandwidth_bytes_per_second{tier},
kvserve:kv_tier_{reload,recompute}_decisions_total.
Layer-wise KV streams of a PD pair (engine/remote_kv.py): kvserve:kv_stream_events_total{role,event},
kvserve:kv_stream_bytes_total{role} (both families: server/kv_metrics.py).

Structured outputs (kvserve/structured/metrics.py): kvserve:grammar_compile_time_seconds
(histogram), kvserve:grammar_{compiles,compile_errors,compile_timeouts,cache_hits}_total,
kvserve:num_requests_waiting_for_grammar.

Memory, at scrape time (memory_metrics.py): kvserve:resident_memory_bytes (the server and its
engine processes); on CUDA kvserve:cuda_memory_used_bytes and kvserve:cuda_memory_total_bytes.

vLLM's per-step and per-request histograms: kvserve:iteration_tokens_total (prompt and generated
tokens per engine step, from consecutive step snapshots), kvserve:request_params_n and
kvserve:request_params_max_tokens (at acceptance), kvserve:request_max_num_generation_tokens (the
longest sequence of a finished request); kvserve:cache_config_info (1, labelled with the resolved
cache config and the pool's block count as num_gpu_blocks, whatever the device).

Server: kvserve:http_requests_rejected_total{reason=overloaded|bad_request|unauthorized}.
Tenants and answer caches register theirs in the same registry (server/tenants.py:
kvserve:tenant_{requests,prompt_tokens,generation_tokens,rate_limited}_total{tenant};
server/answers.py: kvserve:answer_cache_lookups_total{tenant,cache,result},
kvserve:semantic_cache_similarity, kvserve:semantic_cache_embedding_seconds).
Every series carries `model_name`.

`--metrics-prefix vllm` (ServerMetrics.set_prefix) serves the series vLLM also has under vLLM's
names (_VLLM_NAMES; the deprecated gpu_* names too, as vLLM 0.9-0.10 serve them) and the rest
as they are: kvserve:num_kv_blocks_*, engine_*, kv_tier_*, grammar_*, memory, tenants, caches.
vLLM's time_per_output_token_seconds is its inter-token latency (one sample per gap), so it is
kvserve:inter_token_latency_seconds there, and kvserve's per-request mean is served only as
vllm:request_time_per_output_token_seconds.

Who may read it, and what it names (app.py): with `--api-key` or `--api-keys`, /metrics needs a
valid key like /v1 (`--metrics-public` opens it). A `tenant` label never holds the tenant's name
unless `--metrics-tenant-labels` is given: it holds `tenant_pseudonym(name)`, a stable SHA-256
prefix, so dashboards can tell tenants apart without the scrape naming them.
"""
from __future__ import annotations

import hashlib
import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvserve.server.kv_metrics import kv_stream_metrics, kv_tier_metrics
from kvserve.server.memory_metrics import MemoryCollector
from kvserve.structured.metrics import structured_output_metrics


# Fine at the low end: on a small model a decode step takes a millisecond or two.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)      # vLLM's request_params_n buckets

# engine.stats() attribute -> (metric name, kind, help)
_STATS_METRICS = (
    ("num_running", "kvserve:num_requests_running", "gauge", "Requests in the running batch."),
    ("num_waiting", "kvserve:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    ("kv_cache_usage", "kvserve:kv_cache_usage_perc", "gauge",
     "Fraction of KV-cache blocks in use (1 = full)."),
    ("num_free_blocks", "kvserve:num_kv_blocks_free", "gauge", "Free KV-cache blocks."),
    ("num_total_blocks", "kvserve:num_kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    ("num_preemptions_total", "kvserve:num_preemptions", "counter",
     "Requests preempted (their KV blocks freed for others) since start."),
    ("prompt_tokens_total", "kvserve:prompt_tokens", "counter", "Prompt tokens processed."),
    ("generation_tokens_total", "kvserve:generation_tokens", "counter", "Tokens generated."),
    ("prefix_cache_queries_total", "kvserve:prefix_cache_queries", "counter",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits_total", "kvserve:prefix_cache_hits", "counter",
     "Prompt tokens found in the prefix cache."),
    ("num_steps", "kvserve:engine_steps", "counter", "Engine steps (one packed forward pass each)."),
    ("forward_time_total", "kvserve:engine_forward_time_seconds", "counter",
     "Time spent in model forward passes."),
    ("step_time_total", "kvserve:engine_step_time_seconds", "counter",
     "Time spent in engine steps (scheduling, forward, sampling, detokenizing)."),
    ("spec_decode_num_drafts", "kvserve:spec_decode_num_drafts", "counter",
     "Speculative decoding: sequences whose drafts were verified."),
    ("spec_decode_num_draft_tokens", "kvserve:spec_decode_num_draft_tokens", "counter",
     "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "kvserve:spec_decode_num_accepted_tokens", "counter",
     "Speculative decoding: draft tokens accepted."),
)


class _EngineStatsCollector:
    """Exposes the latest engine-stats snapshot; the snapshot is replaced, never mutated."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot = None
        self.cache_info: dict[str, str] | None = None      # ServerMetrics.set_cache_config

    def collect(self):
        snap = self.snapshot
        if self.cache_info is not None:
            info = GaugeMetricFamily("kvserve:cache_config_info", "Information of the KV cache's configuration.",
                                     labels=["model_name", *self.cache_info])
            info.add_metric([self.model_name, *self.cache_info.values()], 1.0)
            yield info
        for attr, name, kind, doc in _STATS_METRICS:
            value = getattr(snap, attr, None) if snap is not None else None
            if value is None:
                if snap is None and kind == "gauge":
                    value = 0            # before the first step: an idle engine
                else:
                    continue             # the engine does not report this one
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], float(value))
            yield fam
        per_pos = getattr(snap, "spec_decode_num_accepted_tokens_per_pos", None) if snap is not None else None
        if per_pos:
            fam = CounterMetricFamily("kvserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: draft tokens accepted, by draft position.",
                                      labels=["model_name", "position"])
            for pos, value in enumerate(per_pos):
                fam.add_metric([self.model_name, str(pos)], float(value))
            yield fam
        yield from kv_tier_metrics(self.model_name, getattr(snap, "kv_tiers", None))
        yield from kv_stream_metrics(self.model_name, getattr(snap, "kv_stream", None))
        yield from structured_output_metrics(self.model_name, getattr(snap, "structured_outputs", None))


class ServerMetrics:
    """All metrics of one server, in their own registry (so tests can build several apps)."""

    def __init__(self, model_name: str, prefix: str = "kvserve"):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("kvserve:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvserve:inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM >= 0.10 also exports TPOT under this name; dashboards use either.
        self.request_tpot = Histogram("kvserve:request_time_per_output_token_seconds",
                                      "Mean time per output token after the first, per request.", labels,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds",
                             "Time from arrival to the request finishing.", labels,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("kvserve:request_queue_time_seconds",
                               "Time from arrival to first being scheduled.", labels,
                               buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram("kvserve:request_prefill_time_seconds",
                                 "Time from first scheduled to the first token.", labels,
                                 buckets=_REQUEST_BUCKETS, registry=r)
        self.decode = Histogram("kvserve:request_decode_time_seconds",
                                "Time from the first token to the last.", labels,
                                buckets=_REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("kvserve:request_prompt_tokens", "Prompt tokens per request.",
                                       labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("kvserve:request_generation_tokens",
                                           "Generated tokens per request.", labels,
                                           buckets=_TOKEN_BUCKETS, registry=r)
        self.success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.iteration_tokens = Histogram("kvserve:iteration_tokens_total", "Tokens counted in one engine step.",
                                          labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.params_n = Histogram("kvserve:request_params_n", "The n of each request.", labels, buckets=_N_BUCKETS, registry=r)
        self.params_max_tokens = Histogram("kvserve:request_params_max_tokens", "The max_tokens of each request.",
                                           labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.max_generation_tokens = Histogram("kvserve:request_max_num_generation_tokens", "The most tokens "
                                               "a sequence of a finished request generated.", labels,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        for hist in (self.iteration_tokens, self.params_n, self.params_max_tokens, self.max_generation_tokens):
            hist.labels(model_name)         # served (empty) from the start, as vLLM does
        self._last_step: tuple[int, int] | None = None      # (num_steps, prompt + generated tokens)
        self.rejected = Counter("kvserve:http_requests_rejected", "HTTP requests refused, by reason.",
                                labels + ["reason"], registry=r)
        self.set_prefix(prefix)                 # "vllm" renames on the way out
        self.stats = _EngineStatsCollector(model_name)
        r.register(self.stats)
        r.register(MemoryCollector(model_name))   # resident memory; device memory on CUDA

    def set_prefix(self, prefix: str) -> None:
        """Serve vLLM's names (`vllm`) or kvserve's (`kvserve`, the default)."""
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.prefix = prefix

    def update_stats(self, snapshot) -> None:
        """A new snapshot; one taken a step after the last gives iteration_tokens that step's tokens."""
        self.stats.snapshot = snapshot
        steps = getattr(snapshot, "num_steps", None)
        if steps is None:
            return
        tokens = snapshot.prompt_tokens_total + snapshot.generation_tokens_total
        last, self._last_step = self._last_step, (steps, tokens)
        if last is not None and steps == last[0] + 1:
            self.iteration_tokens.labels(self.model_name).observe(tokens - last[1])

    def set_cache_config(self, cache_config, num_blocks: int) -> None:
        """kvserve:cache_config_info from the resolved `CacheConfig` and the pool's block count."""
        self.stats.cache_info = {
            "block_size": str(cache_config.block_size), "num_gpu_blocks": str(num_blocks),
            "cache_dtype": str(cache_config.kv_cache_dtype),
            "enable_prefix_caching": str(cache_config.enable_prefix_caching),
            "prefix_cache": str(cache_config.prefix_cache_kind),
            "swap_space": str(cache_config.swap_space),
            "gpu_memory_utilization": str(cache_config.gpu_memory_utilization)}

    def observe_params(self, params) -> None:
        """A request the engine accepted: its `n` and `max_tokens`."""
        self.params_n.labels(self.model_name).observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.labels(self.model_name).observe(params.max_tokens)

    def observe_finished(self, output) -> None:
        """Record one finished `RequestOutput` (called once per engine request)."""
        m = output.metrics
        name = self.model_name
        if m is not None:
            _observe(self.ttft, name, getattr(m, "ttft", None))
            _observe(self.tpot, name, getattr(m, "tpot", None))
            _observe(self.request_tpot, name, getattr(m, "tpot", None))
            _observe(self.e2e, name, getattr(m, "e2e", None))
            _observe(self.queue, name, getattr(m, "queue_time", None))
            first_sched = getattr(m, "first_scheduled_time", None)
            first_tok = getattr(m, "first_token_time", None)
            last_tok = getattr(m, "last_token_time", None)
            if first_sched is not None and first_tok is not None:
                _observe(self.prefill, name, first_tok - first_sched)
            if first_tok is not None and last_tok is not None:
                _observe(self.decode, name, last_tok - first_tok)
            hist = self.itl.labels(name)
            for gap in getattr(m, "itl", None) or ():
                if gap is not None and math.isfinite(gap) and gap >= 0:
                    hist.observe(gap)
        self.prompt_tokens.labels(name).observe(len(output.prompt_token_ids or ()))
        if output.outputs:
            self.max_generation_tokens.labels(name).observe(max(len(c.token_ids) for c in output.outputs))
        for c in output.outputs:
            self.generation_tokens.labels(name).observe(len(c.token_ids))
            reason = "grammar_error" if c.error_code == "grammar_error" else c.finish_reason or "abort"
            self.success.labels(name, reason).inc()

    def observe_abort(self, num_sequences: int = 1) -> None:
        self.success.labels(self.model_name, "abort").inc(num_sequences)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self, tenant_labels: bool = False) -> bytes:
        """The Prometheus text; `tenant` labels as pseudonyms unless `tenant_labels`."""
        source = self.registry if tenant_labels else _PseudonymousTenants(self.registry)
        return generate_latest(_VllmNames(source) if self.prefix == "vllm" else source)


def tenant_pseudonym(name: str) -> str:
    """The `tenant` label of `name` in /metrics: "t-" and 12 hex digits of SHA-256. Stable
    across restarts and servers; it hides a name from a reader who cannot guess it."""
    return "t-" + hashlib.sha256(b"kvserve tenant\0" + name.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class _PseudonymousTenants:
    """The registry's metric families with every `tenant` label value replaced by its pseudonym."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for fam in self.registry.collect():
            fam.samples = [s._replace(labels={**s.labels, "tenant": tenant_pseudonym(s.labels["tenant"])})
                           if "tenant" in s.labels else s for s in fam.samples]
            yield fam


METRICS_PREFIXES = ("kvserve", "vllm")

# kvserve family -> the vLLM families serving its samples (the current name first, then the
# deprecated one vLLM still serves); () drops it (its vLLM counterpart is served elsewhere).
_VLLM_NAMES = {
    "kvserve:num_requests_running": ("vllm:num_requests_running",),
    "kvserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "kvserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "kvserve:prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "kvserve:prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "kvserve:num_preemptions": ("vllm:num_preemptions",),
    "kvserve:prompt_tokens": ("vllm:prompt_tokens",),
    "kvserve:generation_tokens": ("vllm:generation_tokens",),
    "kvserve:request_success": ("vllm:request_success",),
    "kvserve:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "kvserve:request_generation_tokens": ("vllm:request_generation_tokens",),
    "kvserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "kvserve:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                            "vllm:time_per_output_token_seconds"),
    "kvserve:time_per_output_token_seconds": (),
    "kvserve:request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "kvserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "kvserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "kvserve:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "kvserve:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "kvserve:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "kvserve:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "kvserve:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "kvserve:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "kvserve:iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "kvserve:request_params_n": ("vllm:request_params_n",),
    "kvserve:request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "kvserve:request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    "kvserve:cache_config_info": ("vllm:cache_config_info",),
}


class _VllmNames:
    """The source's metric families, those in _VLLM_NAMES under vLLM's names."""

    def __init__(self, source):
        self.source = source

    def collect(self):
        for fam in self.source.collect():
            names = _VLLM_NAMES.get(fam.name)
            if names is None:
                yield fam
                continue
            for name in names:      # e.g. kvserve:request_success_total -> vllm:request_success_total
                out = Metric(name, fam.documentation, fam.type, fam.unit)
                out.samples = [s._replace(name=name + s.name[len(fam.name):]) for s in fam.samples]
                yield out


def _observe(hist: Histogram, name: str, value) -> None:
    if value is not None and math.isfinite(value) and value >= 0:
        hist.labels(name).observe(value)
