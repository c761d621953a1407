"""The metrics of the KV below the pool: its tiers (kv/connector.py) and a PD pair's layer-wise
streams (engine/remote_kv.py), from an engine stats snapshot, as Prometheus families."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


# engine.stats().kv_tiers per tier (kv/connector.py) -> kvserve:kv_tier_*_total{model_name,tier}
_TIER_COUNTERS = (("hit_blocks", "blocks loaded from the tier instead of computed"),
                  ("bytes_loaded", "bytes fetched from the tier and verified"),
                  ("saved_blocks", "blocks written into the tier"),
                  ("bytes_saved", "bytes written into the tier"),
                  ("corrupt_blocks", "payloads that failed their checksum (recomputed)"),
                  ("failures", "store errors: unreachable (skipped for a while) or a failed write"),
                  ("bytes_refused", "payload bytes the tier did not store (failed writes, a full disk)"))


def kv_tier_metrics(model_name: str, tiers: dict | None):
    """KV tiers' counters, the reload/recompute decisions and each tier's measured bandwidth."""
    if not tiers:
        return
    for key, doc in _TIER_COUNTERS:
        fam = CounterMetricFamily(f"kvserve:kv_tier_{key}", f"KV tiers: {doc}.", labels=["model_name", "tier"])
        for t in tiers["tiers"]:
            fam.add_metric([model_name, t["name"]], float(t[key]))
        yield fam
    bw = GaugeMetricFamily("kvserve:kv_tier_bandwidth_bytes_per_second",
                           "KV tiers: measured fetch bandwidth.", labels=["model_name", "tier"])
    for t in tiers["tiers"]:
        if t.get("bandwidth") is not None:
            bw.add_metric([model_name, t["name"]], float(t["bandwidth"]))
    yield bw
    for key in ("reload_decisions", "recompute_decisions"):
        fam = CounterMetricFamily(f"kvserve:kv_tier_{key}", "KV tiers: requests whose tier hit was "
                                  f"{key.split('_')[0]}ed (seed 003's break-even).", labels=["model_name"])
        fam.add_metric([model_name], float(tiers.get(key, 0)))
        yield fam


def kv_stream_metrics(model_name: str, stream: dict | None):
    """Layer-wise KV streaming (engine/remote_kv.py): its events by kind (opened, done, aborted:why
    on the prefill side; completed, fallback:why, refused:why on the decode side) and its bytes."""
    if not stream:
        return
    recv = stream.get("receiver", {})
    events = {k: v for k, v in {**recv, **stream}.items()
              if k in ("opened", "done", "streamed", "reserved", "unclaimed") or ":" in k}
    fam = CounterMetricFamily("kvserve:kv_stream_events", "Layer-wise KV streaming: transfers by event "
                              "(prefill: opened, done, aborted:why; decode: reserved, refused:why, streamed, "
                              "fallback:why, where the decode side recomputed the prompt).",
                              labels=["model_name", "role", "event"])
    for k, v in sorted(events.items()):
        fam.add_metric([model_name, stream["role"], k], float(v))
    yield fam
    sent = stream.get("bytes_sent", recv.get("bytes_received", 0))
    fam = CounterMetricFamily("kvserve:kv_stream_bytes", "Layer-wise KV streaming: KV bytes sent (prefill) "
                              "or received (decode).", labels=["model_name", "role"])
    fam.add_metric([model_name, stream["role"]], float(sent))
    yield fam
