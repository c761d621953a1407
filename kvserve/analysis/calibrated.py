"""The step-time model calibrated on the engine it plans for, and seed 003's budget rule.

`plan step --calibrate MODEL_DIR --save-fit FIT.json` times the real engine's steps and fits
t = t_0 + max(t_W + t_kv ctx_sum, t_tok n_tokens) (stepmodel.fit_step_model); `CalibratedStepModel`
puts that fit where `simulate_serving` expects a StepModel, so `simulate serving --fit FIT.json`
predicts this engine on this machine. Seed 003: "Profile the step time against the number of tokens
on the real GPU, and take the largest budget that meets the ITL target" -- `budget_for_itl` (closed
form from the fit) and `largest_budget` (bisection on any step-time model) do that.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from .stepmodel import StepFit


def save_fit(fit: StepFit, path: str, **meta) -> None:
    """Write a fit (and what it was measured on) as JSON."""
    with open(path, "w") as f:
        json.dump({"fit": asdict(fit), **meta}, f, indent=1)


def load_fit(path: str) -> StepFit:
    with open(path) as f:
        return StepFit(**json.load(f)["fit"])


@dataclass
class CalibratedStepModel:
    """A fitted StepFit with StepModel's `step_time(decode_contexts, chunks)` interface.

    A step of decodes at cached contexts S_i and prefill chunks (n_new, n_cached) schedules
    n_tokens = #decodes + sum n_new tokens and reads ctx_sum = sum S_i + sum n_cached cached tokens,
    the two quantities `calibrate_engine` records from the scheduler (and, for a fit with a
    per-sequence cost, n_seqs = #decodes + #chunks)."""
    fit: StepFit

    @property
    def t0(self) -> float:
        return self.fit.t0

    def step_time(self, decode_contexts=(), chunks=()) -> float:
        n_tokens = len(decode_contexts) + sum(n for n, _ in chunks)
        ctx_sum = float(sum(decode_contexts)) + sum(c for _, c in chunks)
        return float(self.fit.predict(n_tokens, ctx_sum, len(decode_contexts) + len(chunks)))


def budget_for_itl(fit: StepFit, itl_s: float, batch: int = 0, context: float = 0.0) -> int:
    """The largest token budget C whose full step meets the ITL target, from the fitted model: a step
    of `batch` decodes at `context` cached tokens each, filled up to C tokens with prefill, takes
    t_0 + max(t_W + t_kv (B S), t_tok C) (chunks' cached prefixes ignored), so
    C* = floor((ITL - t_0) / t_tok) if the memory branch alone meets the target, else 0 (no budget
    does). A budget never goes below the decodes it must carry: max(C*, B) when feasible. A fit with a
    per-sequence cost charges it for the B decodes and one chunk."""
    slack = itl_s - fit.t0 - fit.t_seq * (batch + 1)
    if slack <= 0 or fit.t_W + fit.t_kv * batch * context > slack:
        return 0
    if fit.t_tok <= 0:
        return math.inf
    return max(int(math.floor(slack / fit.t_tok + 1e-9)), batch)


def largest_budget(step_model, itl_s: float, batch: int = 0, context: float = 0.0, hi: int = 1 << 20) -> int:
    """The largest budget C for which a step of `batch` decodes at `context` plus one prefill chunk of
    C - batch new tokens takes at most itl_s under any step model with `step_time` (bisection; the
    step time grows with the chunk). 0 if even the decodes alone miss the target."""
    def t(c):
        return step_model.step_time([context] * batch, [(c - batch, 0)] if c > batch else [])
    if t(batch) > itl_s:
        return 0
    lo = batch
    if t(hi) <= itl_s:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if t(mid) <= itl_s else (lo, mid)
    return lo
