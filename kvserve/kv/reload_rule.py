"""Reload or recompute a prefix held by a lower KV tier (seed 003, "Tiers of KV storage").

"A prompt of T cached tokens reloads in T m_KV / b_tier and recomputes in about
T 2 N_act / (n_gpu pi MFU), so reloading wins when b_tier > m_KV Theta_prefill": the tier must
deliver cached tokens faster than the replica computes new ones (the swap break-even of
"When memory runs out", with one transfer instead of two). `kvserve plan preempt` gives the
analytic figure (kvserve/analysis/disagg.py: `tier_reload_wins`); this rule uses the measured
one: m_KV from the pool's layout, Theta_prefill from the engine's own forward passes, b_tier
from each tier's fetches (kv/connector.py). The connector applies it per request at admission.
"""
from __future__ import annotations


class ReloadRule:
    """Seed 003's break-even, measured: reload wins when b_tier > m_KV x Theta_prefill.
    policy: "auto" (the rule; reload until the prefill throughput is measured), "always", "never"."""

    DECAY = 0.9       # older forward passes weigh less: Theta follows the running engine

    def __init__(self, m_kv: float, policy: str = "auto"):
        self.m_kv = m_kv                 # bytes per token of K/V, all layers
        self.policy = policy
        self._tokens = 0.0
        self._seconds = 0.0

    def observe_forward(self, scheduled, seconds: float) -> None:
        """One forward pass: count it when prefill tokens are most of it (decode-only steps are
        memory-bound and would understate Theta_prefill)."""
        total = sum(n for _, n, _ in scheduled)
        prefill = sum(n for _, n, _ in scheduled if n > 1)
        if total >= 16 and 2 * prefill >= total and seconds > 0:
            self._tokens = self.DECAY * self._tokens + total
            self._seconds = self.DECAY * self._seconds + seconds

    @property
    def prefill_throughput(self) -> float | None:
        """Theta_prefill, tokens/s (None until a prefill-heavy forward pass ran)."""
        return self._tokens / self._seconds if self._seconds > 0 else None

    @property
    def break_even_bandwidth(self) -> float | None:
        """m_KV x Theta_prefill, bytes/s."""
        theta = self.prefill_throughput
        return self.m_kv * theta if theta is not None else None

    def reload_wins(self, tier_bw: float | None) -> bool:
        if self.policy != "auto":
            return self.policy == "always"
        need = self.break_even_bandwidth
        return need is None or tier_bw is None or tier_bw > need
