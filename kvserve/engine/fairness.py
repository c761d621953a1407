"""Who goes first among waiting requests, and who is preempted first: the scheduling policy
(seed 003, "arrival-order admission lets one tenant's burst delay everyone"; the Virtual Token
Counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

The scheduler (engine/scheduler.py) stays the one place that decides who runs; a policy only
orders its waiting queue before admission (`order`), names the preemption victim among running
sequences (`victim_key`: the largest goes), hears of arrivals (`on_arrival`) and of what each
step scheduled (`on_scheduled`). `--scheduling-policy`:

- `fcfs`: arrival order (preempted requests at the front), the latest arrival preempted first.
- `priority`: vLLM's request `priority`, lower first, FCFS within a level; the victim is the
  running sequence of the lowest priority (largest value), the latest within it.
- `vtc`: a virtual token counter per tenant, c += (w_in * prompt tokens processed + w_out *
  tokens generated) / tenant weight; admission takes the earliest request of the backlogged
  tenant with the smallest counter, charging its prompt before the next pick (each request gets
  a virtual start tag); a tenant with nothing waiting that sends a request has its counter lifted
  to the smallest counter of the backlogged tenants (to the last admitted tenant's counter when
  none is), so idling earns no credit. The victim is a sequence of the tenant with the largest
  counter. Paper's weights: w_in = 1, w_out = 2. Its bound: two tenants backlogged over an
  interval receive service (in weighted tokens, per unit weight) within 2 * max(w_in * L_in,
  w_out * M) of each other, L_in the longest prompt, M the most tokens one batch can hold
  (tests/engine/test_fairness.py checks it on random arrivals).

Both reorderings are stable sorts applied after the cache-aware ordering (longest cached prefix
first, preempted and `max_wait_steps`-old requests before it), so that ordering, and its
starvation bound, still hold within a priority level or a tenant.
"""
from __future__ import annotations

from collections import deque

VTC_INPUT_WEIGHT = 1.0
VTC_OUTPUT_WEIGHT = 2.0
POLICIES = ("fcfs", "priority", "vtc")


def tenant_of(req) -> str:
    return getattr(req, "tenant", None) or ""


class FCFSPolicy:
    name = "fcfs"

    def on_arrival(self, req, queues) -> None:
        pass

    def order(self, queues) -> None:
        pass

    def victim_key(self, req):
        return req.arrival_key

    def on_scheduled(self, out) -> None:
        pass


def _resort(waiting: deque, key) -> None:
    items = sorted(waiting, key=key)        # stable: the current order breaks ties
    waiting.clear()
    waiting.extend(items)


class PriorityPolicy(FCFSPolicy):
    name = "priority"

    def order(self, queues) -> None:
        w = queues.waiting
        if len(w) > 1 and any(r.priority != w[0].priority for r in w):
            _resort(w, lambda r: r.priority)

    def victim_key(self, req):
        return req.priority, req.arrival_key


class VTCPolicy(FCFSPolicy):
    name = "vtc"

    def __init__(self, input_weight: float = VTC_INPUT_WEIGHT, output_weight: float = VTC_OUTPUT_WEIGHT):
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.service: dict[str, float] = {}     # weighted tokens received (counters before lifts)
        self._last: str | None = None

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def on_arrival(self, req, queues) -> None:
        """Before `req` joins the queue: lift its tenant's counter if it had nothing waiting."""
        t = tenant_of(req)
        self.weights[t] = float(getattr(req, "tenant_weight", 1.0) or 1.0)
        backlogged = {tenant_of(r) for r in queues.waiting}
        if t in backlogged:
            return
        c = self.counters.get(t, 0.0)
        if backlogged:
            c = max(c, min(self.counters.get(u, 0.0) for u in backlogged))
        elif self._last is not None:
            c = max(c, self.counters.get(self._last, 0.0))
        self.counters[t] = c

    def order(self, queues) -> None:
        w = queues.waiting
        if len(w) < 2:
            if w:
                self._last = tenant_of(w[0])
            return
        projected = dict(self.counters)
        tag: dict[int, float] = {}
        for r in w:                              # each tenant's requests in their queue order
            t = tenant_of(r)
            c = projected.get(t, 0.0)
            tag[id(r)] = c
            left = max(0, r.num_prompt_tokens - r.num_computed_tokens)
            projected[t] = c + self.input_weight * left / self._weight(t)
        _resort(w, lambda r: tag[id(r)])
        self._last = tenant_of(w[0])

    def victim_key(self, req):
        return self.counters.get(tenant_of(req), 0.0), req.arrival_key

    def charge(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        cost = self.input_weight * input_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self._weight(tenant)
        self.service[tenant] = self.service.get(tenant, 0.0) + cost / self._weight(tenant)

    def on_scheduled(self, out) -> None:
        """Charge what this step runs: prompt tokens processed, one token generated by every
        sequence whose known tokens are all computed after it."""
        for req, n in out.scheduled:
            done = req.num_computed_tokens
            prompt = max(0, min(n, req.num_prompt_tokens - done))
            generated = 1 if done + n >= req.num_tokens else 0
            self.charge(tenant_of(req), prompt, generated)


PROMPT_FIELDS = ("priority", "tenant", "tenant_weight")     # a prompt dict's scheduling fields


def prompt_fields(prompt) -> dict:
    """The scheduling fields of a prompt dict (the server adds them: server/tenants.py),
    checked; ValueError with what to change otherwise."""
    if not isinstance(prompt, dict):
        return {}
    out = {k: prompt[k] for k in PROMPT_FIELDS if prompt.get(k) is not None}
    p = out.get("priority", 0)
    if not isinstance(p, int) or isinstance(p, bool):
        raise ValueError(f"priority must be an integer, got {p!r}.")
    if not isinstance(out.get("tenant", ""), str):
        raise ValueError("tenant must be a string.")
    w = out.get("tenant_weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
        raise ValueError(f"tenant_weight must be a positive number, got {w!r}.")
    return out


def make_policy(name: str | None):
    if name in (None, "fcfs"):
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "vtc":
        return VTCPolicy()
    raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}.")
