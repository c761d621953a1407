"""Scheduling policies (engine/fairness.py): VTC's service-difference bound on random arrivals
(hypothesis), its counter lift, priority order and preemption by priority."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.fairness import FCFSPolicy, PriorityPolicy, VTCPolicy, make_policy

W_IN, W_OUT = 1.0, 2.0


class FakeReq:
    """What a policy reads of a request."""

    def __init__(self, seq: int, tenant: str, prompt: int, out: int, weight: float = 1.0, priority: int = 0):
        self.tenant, self.tenant_weight, self.priority = tenant, weight, priority
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = 0
        self.num_tokens = prompt
        self.max_out = out
        self.arrival_key = (float(seq), seq)


def simulate(policy, arrivals, seats: int):
    """A batch of `seats` sequences; an admitted prompt is prefilled in its first step, then one
    token per step. Yields (step, service per tenant this step, backlogged tenants, admitted)."""
    q = SimpleNamespace(waiting=deque())
    running: list[FakeReq] = []
    arrivals = sorted(arrivals, key=lambda a: a[0])
    i, step = 0, 0
    while i < len(arrivals) or q.waiting or running:
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, tenant, prompt, out, weight = arrivals[i]
            req = FakeReq(i, tenant, prompt, out, weight)
            policy.on_arrival(req, q)
            q.waiting.append(req)
            i += 1
        policy.order(q)
        admitted = []
        while q.waiting and len(running) < seats:
            r = q.waiting.popleft()
            running.append(r)
            admitted.append(r)
        backlogged = {r.tenant for r in q.waiting}
        scheduled = [(r, r.num_tokens - r.num_computed_tokens) for r in running]
        before = dict(getattr(policy, "service", {}))
        policy.on_scheduled(SimpleNamespace(scheduled=scheduled))
        after = getattr(policy, "service", {})
        service = {t: after[t] - before.get(t, 0.0) for t in after}
        for r, n in scheduled:
            r.num_computed_tokens += n
            r.num_tokens += 1                   # the token this step generated
        running = [r for r in running if r.num_tokens - r.num_prompt_tokens < r.max_out]
        yield step, service, backlogged, admitted
        step += 1


arrival = st.tuples(st.integers(0, 40), st.sampled_from("abc"), st.integers(1, 32), st.integers(1, 12))


@settings(max_examples=60, deadline=None)
@given(st.lists(arrival, min_size=2, max_size=80), st.integers(1, 6),
       st.fixed_dictionaries({"a": st.sampled_from([1.0, 2.0]), "b": st.just(1.0), "c": st.sampled_from([1.0, 3.0])}))
def test_vtc_service_difference_bound(arrivals, seats, weights):
    """Over any interval in which two tenants are both backlogged, the service each received
    (weighted tokens per unit of tenant weight) differs by at most 2 * max(w_in * L_in, w_out * M),
    M the tokens one batch can hold (Sheng et al. 2024, Theorem 4.3)."""
    arrivals = [(s, t, p, o, weights[t]) for s, t, p, o in arrivals]
    l_in = max(p for _, _, p, _, _ in arrivals)
    m = seats * max(p + o for _, _, p, o, _ in arrivals)
    bound = 2 * max(W_IN * l_in, W_OUT * m)
    trace = list(simulate(VTCPolicy(W_IN, W_OUT), arrivals, seats))
    tenants = sorted({a[1] for a in arrivals})
    for f in tenants:
        for g in tenants:
            if f >= g:
                continue
            diff, lo, hi = 0.0, 0.0, 0.0     # W_f - W_g since the start of the co-backlogged run
            for _, service, backlogged, _ in trace:
                if f in backlogged and g in backlogged:
                    diff += service.get(f, 0.0) - service.get(g, 0.0)
                    lo, hi = min(lo, diff), max(hi, diff)
                    assert hi - lo <= bound + 1e-9, (f, g, hi - lo, bound)
                else:
                    diff = lo = hi = 0.0


def test_vtc_lifts_a_newly_active_tenant():
    """b arrives after a ran alone for a while: b gets no credit for its idle time (its counter is
    lifted to a's), so admissions alternate instead of b taking every seat."""
    arrivals = [(0, "a", 8, 4, 1.0)] * 60 + [(20, "b", 8, 4, 1.0)] * 20
    policy = VTCPolicy(W_IN, W_OUT)
    order = [r.tenant for step, _, _, admitted in simulate(policy, arrivals, 2) if step >= 20 for r in admitted]
    first = order[:10]
    assert "a" in first and "b" in first and first.count("b") <= 7, first
    # FCFS would serve all of a's earlier requests first.
    fcfs = [r.tenant for step, _, _, admitted in simulate(FCFSPolicy(), arrivals, 2) if step >= 20 for r in admitted]
    assert "b" not in fcfs[:10]


def test_vtc_weights_share_service():
    """Two backlogged tenants, weights 2 and 1: a receives about twice b's weighted tokens."""
    arrivals = [(0, "a", 4, 8, 2.0)] * 40 + [(0, "b", 4, 8, 1.0)] * 40
    policy = VTCPolicy(W_IN, W_OUT)
    raw = {"a": 0.0, "b": 0.0}
    for _, service, backlogged, _ in simulate(policy, arrivals, 4):
        if backlogged == {"a", "b"}:
            raw["a"] += service.get("a", 0.0) * 2.0
            raw["b"] += service.get("b", 0.0)
    assert 1.6 < raw["a"] / raw["b"] < 2.4, raw


def test_priority_order_and_victim():
    reqs = [FakeReq(i, "t", 4, 1, priority=p) for i, p in enumerate([1, 0, 2, 0, 1])]
    q = SimpleNamespace(waiting=deque(reqs))
    PriorityPolicy().order(q)
    assert [(r.priority, r.arrival_key[1]) for r in q.waiting] == [(0, 1), (0, 3), (1, 0), (1, 4), (2, 2)]
    victim = max(reqs, key=PriorityPolicy().victim_key)
    assert (victim.priority, victim.arrival_key[1]) == (2, 2)       # the lowest priority goes first
    assert max(reqs, key=FCFSPolicy().victim_key) is reqs[-1]       # FCFS: the latest arrival
    assert isinstance(make_policy("vtc"), VTCPolicy) and isinstance(make_policy(None), FCFSPolicy)
