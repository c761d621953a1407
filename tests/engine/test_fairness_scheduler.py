"""The scheduling policies inside the real scheduler (engine/scheduler.py + engine/fairness.py),
mostly without a model: priority admission order, preemption of the lowest priority first, VTC interleaving
of a late tenant, priority over cache-aware ordering, and (on stories260K) the fields every sequence of a
request carries."""
from __future__ import annotations

from kvserve.engine.fairness import PriorityPolicy, VTCPolicy
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from kvserve.sample.params import SamplingParams
from tests.engine.runner_outputs import runner_output


def make(num_blocks=64, block_size=4, max_seqs=1, budget=64, policy=None, cache=None, cache_aware=False):
    kv = KVCacheManager(num_blocks, block_size, prefix_cache=cache)
    sched = Scheduler(kv, budget, max_seqs, cache_aware=cache_aware)
    if policy is not None:
        sched.policy = policy
    return sched


def req(rid, prompt, max_tokens=2, seq=0, **kw):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=float(seq),
                   arrival_seq=seq, **kw)


def step(sched):
    out = sched.schedule()
    samples = {r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    sched.update_from_output(out, runner_output(samples, {}))
    return out


def admission_order(sched, steps=200):
    order = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        for r, _ in step(sched).scheduled:
            if r.request_id not in order:
                order.append(r.request_id)
    return order


def test_priority_admission_order():
    sched = make(policy=PriorityPolicy())
    for i, p in enumerate([2, 0, 1, 0]):
        sched.add(req(f"r{i}", [1, 2, 3], seq=i, priority=p))
    assert admission_order(sched) == ["r1", "r3", "r2", "r0"]       # lower first, FCFS within


def test_preemption_takes_the_lowest_priority_first():
    def run(policy):
        # 4 blocks of 2 tokens: two sequences of 3-token prompts fill the pool as they decode.
        sched = make(num_blocks=4, block_size=2, max_seqs=2, budget=16, policy=policy)
        sched.add(req("early-low", [1, 2, 3], max_tokens=6, seq=0, priority=5))
        sched.add(req("late-high", [4, 5, 6], max_tokens=6, seq=1, priority=0))
        for _ in range(20):
            out = step(sched)
            if out.preempted:
                return [r.request_id for r in out.preempted]
        return []
    assert run(PriorityPolicy()) == ["early-low"]
    assert run(None) == ["late-high"]                                  # fcfs: the latest arrival


def test_vtc_interleaves_a_late_tenant():
    sched = make(max_seqs=1, policy=VTCPolicy())
    for i in range(12):
        sched.add(req(f"a{i}", [1, 2, 3, 4], seq=i, tenant="a"))
    for _ in range(6):                                              # a runs alone for a while
        step(sched)
    for i in range(4):
        sched.add(req(f"b{i}", [5, 6, 7, 8], seq=100 + i, tenant="b"))
    order = [rid for rid in admission_order(sched) if not rid.startswith("a") or int(rid[1:]) > 2]
    first = order[:6]
    assert sum(r.startswith("b") for r in first) >= 2 and sum(r.startswith("a") for r in first) >= 2, order
    fcfs = make(max_seqs=1)
    for i in range(12):
        fcfs.add(req(f"a{i}", [1, 2, 3, 4], seq=i, tenant="a"))
    for i in range(4):
        fcfs.add(req(f"b{i}", [5, 6, 7, 8], seq=100 + i, tenant="b"))
    assert admission_order(fcfs)[:12] == [f"a{i}" for i in range(12)]


def test_priority_composes_with_cache_aware_order():
    """Within one priority level the longest cached prefix goes first; a higher level still
    goes before it."""
    sched = make(num_blocks=64, block_size=2, max_seqs=1, policy=PriorityPolicy(), cache="radix",
                 cache_aware=True)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    sched.add(req("warm", shared + [1], seq=0))
    admission_order(sched)                                          # its blocks stay cached
    sched.add(req("cold-p1", [40, 41, 42, 43, 44, 45, 46, 47], seq=1, priority=1))
    sched.add(req("hit-p1", shared + [50], seq=2, priority=1))
    sched.add(req("cold-p0", [60, 61, 62, 63, 64, 65], seq=3, priority=0))
    assert admission_order(sched) == ["cold-p0", "hit-p1", "cold-p1"]


def test_vtc_composes_with_cache_aware_order():
    """Within a tenant the longest cached prefix goes first; across tenants the counters decide:
    b, newly active, is lifted to a's counter (no credit for idling), so a's next request and b's
    tie (queue order breaks it) and b goes before a's second."""
    sched = make(num_blocks=64, block_size=2, max_seqs=1, policy=VTCPolicy(), cache="radix", cache_aware=True)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    sched.add(req("warm", shared + [1], seq=0, tenant="a"))
    admission_order(sched)                       # a has been served: its counter is ahead of b's
    sched.add(req("a-cold", [40, 41, 42, 43, 44, 45], seq=1, tenant="a"))
    sched.add(req("a-hit", shared + [50], seq=2, tenant="a"))
    sched.add(req("b-cold", [60, 61, 62, 63, 64, 65], seq=3, tenant="b"))
    assert sched.policy.counters["b"] == sched.policy.counters["a"] > 0
    assert admission_order(sched) == ["a-hit", "b-cold", "a-cold"]


def test_beams_and_samples_keep_their_requests_priority_and_tenant():
    """Every sequence of a request (n > 1 samples, beams forked mid-search) is scheduled, charged
    (VTC) and chosen as a victim under the request's own priority and tenant."""
    from kvserve import LLM
    from tests.conftest import STORIES_HF

    llm = LLM(str(STORIES_HF), scheduling_policy="priority")
    eng = llm.engine
    fields = {"priority": 3, "tenant": "acme", "tenant_weight": 2.0}
    eng.add_request("beams", {"prompt": "Once upon a time", **fields},
                    SamplingParams(use_beam_search=True, beam_width=3, max_tokens=6, temperature=0.0))
    eng.add_request("samples", {"prompt": "The dog", **fields}, SamplingParams(n=3, max_tokens=6, seed=1))
    seen = set()
    while eng.has_unfinished_requests():
        eng.step()
        for r in eng.scheduler.running:
            seen.add(r.request_id)
            assert (r.priority, r.tenant, r.tenant_weight) == (3, "acme", 2.0), r
    assert sum("beam" in rid for rid in seen) >= 3 and len(seen) >= 6
