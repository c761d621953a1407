"""Scheduling simulators of seed 003 ("Why batching by request wastes the GPU", "Scheduling one step
at a time", "Mixing prefill and decode in one step") and seed 000 ("Static and continuous batching",
"Chunked prefill").

Two levels:
  * `simulate_batching`: the seed's slot-level experiment, time in decode steps, one token per slot
    per step (seed 003's placeholder made real). Continuous batching is list scheduling with a heap
    of slot-free times; static batching jumps from one batch to the next.
  * `simulate_serving`: a step-level, event-driven simulator in seconds, every step timed by the
    step-time model (stepmodel.StepModel.step_time), for static batches, continuous batching with
    whole-prompt prefill, and chunked prefill under a token budget (seed 003's widget).
All randomness comes from a numpy Generator seeded by the caller.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from .stepmodel import StepModel


# -- static batching utilisation -------------------------------------------------------------------
def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n."""
    return float(np.sum(1.0 / np.arange(1, n + 1)))


def static_utilization_theory(batch: int) -> float:
    """Seed 003 theorem: with i.i.d. exponential output lengths, the long-run fraction of slot-steps of
    static batching that make tokens is E[l] / E[max of B] = 1 / H_B (24.6% at B = 32)."""
    return 1.0 / harmonic(batch)


def static_batch_utilization(lengths) -> float:
    """Useful slot-steps over all slot-steps of one static batch: sum(l) / (B max(l)). Seed 003's opening
    example (31 answers of 50 tokens, one of 2,000): 3,550 / 64,000 = 5.5%."""
    lengths = np.asarray(lengths, float)
    return float(lengths.sum() / (len(lengths) * lengths.max()))


def simulate_static_utilization(batch: int, mean: float = 200.0, n_batches: int = 4000, seed: int = 0) -> float:
    """Seed 003's check of the theorem by simulation: n_batches batches of `batch` exponential lengths,
    utilisation = total useful work / total slot-steps (a ratio of sums, as the theorem's proof)."""
    rng = np.random.default_rng(seed)
    lengths = rng.exponential(mean, size=(n_batches, batch))  # [n_batches, B]
    return float(lengths.sum() / (batch * lengths.max(axis=1).sum()))


# -- slot-level batching experiment ----------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of n requests of a Poisson process with `rate` arrivals per unit time: [n]."""
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def exponential_lengths(n: int, mean: float, rng: np.random.Generator, minimum: int = 1,
                        maximum: int | None = None) -> np.ndarray:
    """Integer lengths >= minimum, geometric with the given mean (the discrete exponential): [n]."""
    p = 1.0 / max(mean - minimum + 1, 1.0)
    out = rng.geometric(p, size=n) + (minimum - 1)
    return np.minimum(out, maximum) if maximum is not None else out


def simulate_batching(arrivals, outputs, max_batch: int, policy: str) -> dict:
    """Seed 003 `simulate_batching`: serve requests (arrival time, output length in steps) on
    `max_batch` slots, one token per slot per step, under policy 'static' or 'continuous'.

    continuous: list scheduling in arrival order -- each request takes whichever slot frees first
        (a heap of slot-free times), starting at max(arrival, free time).
    static: when the batch ends, every request that has arrived by then (up to max_batch) forms the
        next batch, which holds all its slots until its longest member ends; if none has arrived, the
        server idles until the next arrival.
    Returns per-request start (admission) and finish times, waits (start - arrival), total_steps (the
    last finish) and utilization = useful slot-steps / (max_batch * total_steps).
    """
    arrivals = np.asarray(arrivals, float)
    outputs = np.asarray(outputs, float)
    n = len(arrivals)
    start = np.empty(n)
    if policy == "continuous":
        free = [0.0] * max_batch  # heap of times at which slots free up
        for i in range(n):
            t = max(arrivals[i], heapq.heappop(free))
            start[i] = t
            heapq.heappush(free, t + outputs[i])
        finish = start + outputs
    elif policy == "static":
        finish = np.empty(n)
        t, i = 0.0, 0
        while i < n:
            t = max(t, arrivals[i])
            j = i
            while j < n and j - i < max_batch and arrivals[j] <= t:
                j += 1
            start[i:j] = t
            finish[i:j] = t + outputs[i:j]
            t += outputs[i:j].max()
            i = j
    else:
        raise ValueError(f"policy must be 'static' or 'continuous', not {policy!r}")
    total = float(finish.max())
    waits = start - arrivals
    return {"start": start, "finish": finish, "waits": waits, "total_steps": total,
            "utilization": float(outputs.sum() / (max_batch * total)),
            "mean_wait": float(waits.mean()), "p99_wait": float(np.percentile(waits, 99)),
            "frac_admitted_at_once": float(np.mean(waits < 1.0))}


def batching_experiment(rate: float, n_requests: int = 1000, slots: int = 32, mean_output: float = 200.0,
                        seed: int = 0) -> dict:
    """Seed 003's cell: 1,000 requests on 32 slots, exponential output lengths of mean 200 steps,
    Poisson arrivals at `rate` per step; both policies on the same trace."""
    rng = np.random.default_rng(seed)
    arr = poisson_arrivals(n_requests, rate, rng)
    out = exponential_lengths(n_requests, mean_output, rng)
    return {p: simulate_batching(arr, out, slots, p) for p in ("static", "continuous")}


# -- step-level serving simulator ------------------------------------------------------------------
@dataclass
class Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    admitted: float = math.nan
    prefilled: int = 0          # prompt tokens computed so far
    generated: int = 0          # output tokens produced so far
    token_times: list = field(default_factory=list)

    @property
    def context(self) -> int:
        return self.prefilled + self.generated


def make_requests(n: int, rate: float, mean_prompt: float, mean_output: float, seed: int = 0,
                  max_prompt: int | None = None, max_output: int | None = None) -> list[Request]:
    """n requests with Poisson arrivals (`rate` per second) and exponential prompt and output lengths."""
    rng = np.random.default_rng(seed)
    arr = poisson_arrivals(n, rate, rng)
    P = exponential_lengths(n, mean_prompt, rng, 1, max_prompt)
    O = exponential_lengths(n, mean_output, rng, 1, max_output)
    return [Request(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arr, P, O))]


def simulate_serving(requests: list[Request], step_model: StepModel, slots: int, policy: str,
                     token_budget: int | None = None, max_steps: int = 10_000_000) -> dict:
    """Seed 003's scheduling widget as a simulator: one GPU replica, `slots` batch rows, requests
    arriving over time, every step timed by `step_model.step_time`.

    policy 'static': when the replica is idle, up to `slots` arrived requests form a batch; one step
        prefills all their prompts padded to the longest, then decode steps run every row until the
        longest answer ends (finished rows keep their slot and their cache is still read).
    policy 'continuous': before every step, free slots admit waiting requests; each newcomer's whole
        prompt is computed in that step beside everyone's decode token (Orca), so running streams stall.
    policy 'chunked': stall-free batching (Sarathi-Serve, seed 003 `schedule`): every decoding
        sequence gets one token first, then prompts of admitted requests get chunks, in admission order,
        up to `token_budget` tokens per step.
    Each request's first output token comes from the step that finishes its prompt; it then needs
    output - 1 decode steps. Returns per-request TTFT and gaps and the summary `summarize` gives.
    """
    if policy not in ("static", "continuous", "chunked"):
        raise ValueError(f"policy must be 'static', 'continuous' or 'chunked', not {policy!r}")
    if policy == "chunked" and not token_budget:
        raise ValueError("policy 'chunked' needs a token_budget")
    reqs = sorted((Request(r.rid, r.arrival, r.prompt, r.output) for r in requests), key=lambda r: r.arrival)
    n = len(reqs)
    nxt = 0                 # next request not yet arrived
    waiting: list[Request] = []
    running: list[Request] = []   # holding a slot, in admission order
    done: list[Request] = []
    t = 0.0
    steps = useful_slot_steps = slot_steps = 0
    step_times = []
    static_rows: list[Request] = []
    pad = batch_steps = 0
    while len(done) < n and steps < max_steps:
        while nxt < n and reqs[nxt].arrival <= t:
            waiting.append(reqs[nxt]); nxt += 1
        if not running and not waiting:
            t = reqs[nxt].arrival
            continue
        decode_ctx, chunks, produced = [], [], []
        if policy == "static":
            if not running:
                static_rows = waiting[:slots]
                del waiting[:len(static_rows)]
                running = list(static_rows)
                for r in running:
                    r.admitted = t
                pad = max(r.prompt for r in running)
                batch_steps = 0
                chunks = [(pad, 0)] * len(running)
                for r in running:
                    r.prefilled = r.prompt
                    produced.append(r)
            else:
                batch_steps += 1
                for r in running:  # every row decodes, finished or not: pad + tokens so far
                    decode_ctx.append(pad + batch_steps)
                    if r.generated < r.output:
                        produced.append(r)
        else:
            while waiting and len(running) < slots:
                r = waiting.pop(0)
                r.admitted = t
                running.append(r)
            budget = token_budget if policy == "chunked" else math.inf
            for r in running:
                if r.prefilled == r.prompt:
                    decode_ctx.append(r.context)
                    produced.append(r)
            budget -= len(decode_ctx)
            for r in running:
                if r.prefilled < r.prompt and budget > 0:
                    c = int(min(r.prompt - r.prefilled, budget))
                    chunks.append((c, r.prefilled))
                    budget -= c
                    r.prefilled += c
                    if r.prefilled == r.prompt:
                        produced.append(r)
        dt = step_model.step_time(decode_ctx, chunks)
        t += dt
        steps += 1
        step_times.append(dt)
        slot_steps += slots
        useful_slot_steps += len(produced)
        for r in produced:
            r.generated += 1
            r.token_times.append(t)
        if policy == "static":
            if all(r.generated >= r.output for r in running):
                done.extend(running)
                running = []
        else:
            still = []
            for r in running:
                (done if r.generated >= r.output else still).append(r)
            running = still
    return summarize(done, t, steps, useful_slot_steps / max(slot_steps, 1), step_times, n)


def summarize(done: list[Request], makespan: float, steps: int, utilization: float, step_times, n: int) -> dict:
    """TTFT / ITL percentiles, longest stall, waits, finished requests and utilisation of a run."""
    ttft = np.array([r.token_times[0] - r.arrival for r in done]) if done else np.array([math.nan])
    gaps = np.concatenate([np.diff(r.token_times) for r in done if len(r.token_times) > 1] or [np.array([0.0])])
    waits = np.array([r.admitted - r.arrival for r in done]) if done else np.array([math.nan])
    pct = lambda a, q: float(np.percentile(a, q))
    return {
        "finished": len(done), "requests": n, "steps": steps, "makespan_s": makespan,
        "utilization": utilization,
        "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_mean_s": float(gaps.mean()), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
        "longest_gap_s": float(gaps.max()),
        "wait_mean_s": float(waits.mean()), "wait_p99_s": pct(waits, 99),
        "step_mean_s": float(np.mean(step_times)) if len(step_times) else 0.0,
        "output_tokens_per_s": float(sum(r.output for r in done) / makespan) if makespan else 0.0,
    }


def widget_requests(seed: int = 0, n: int = 48, rate: float = 6.0, mean_prompt: float = 1500,
                    mean_output: float = 150) -> list[Request]:
    """Seed 003's scheduling widget workload: 48 requests arriving at random, 6 per second, prompt and
    answer lengths exponential with means 1,500 and 150 tokens."""
    return make_requests(n, rate, mean_prompt, mean_output, seed)


def chunked_prefill_schedule(requests, budget: int):
    """Seed 003 `chunked_prefill_schedule`, made real, in step units: requests are (arrival step,
    prompt tokens, output tokens); every step gives one token to each decoding request, then prompt
    chunks in arrival order up to `budget` tokens (no slot limit). Returns (steps, first, finish):
    each step's {"decode": [ids], "prefill": [(id, n)]}, and each request's first-token and last-token
    step indices.
    """
    reqs = [(int(a), int(p), int(o)) for a, p, o in requests]
    n = len(reqs)
    pre = [0] * n
    gen = [0] * n
    first = [-1] * n
    finish = [-1] * n
    steps = []
    t = 0
    while any(f < 0 for f in finish):
        live = [i for i in range(n) if reqs[i][0] <= t and finish[i] < 0]
        if not live:
            t = min(reqs[i][0] for i in range(n) if finish[i] < 0)
            continue
        dec = [i for i in live if pre[i] == reqs[i][1]]
        left = budget - len(dec)
        pf = []
        for i in live:
            if pre[i] < reqs[i][1] and left > 0:
                c = min(reqs[i][1] - pre[i], left)
                pf.append((i, c))
                left -= c
                pre[i] += c
        steps.append({"decode": dec, "prefill": pf})
        for i in dec + [i for i, _ in pf if pre[i] == reqs[i][1]]:
            gen[i] += 1
            if gen[i] == 1:
                first[i] = t
            if gen[i] == reqs[i][2]:
                finish[i] = t
        t += 1
    return steps, first, finish
