"""Planners from seed 003: swap vs recompute ("When memory runs out"), KV tier reload vs recompute
("Tiers of KV storage"), the cost of moving the cache and the sizing of disaggregated prefill and
decode pools ("Separating prefill from decode", "The cost of moving the cache", `disagg_plan`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .kvmath import kv_bytes_per_token
from .roofline import prefill_flops
from .specs import HardwareSpec, ModelSpec, get_hardware
from .stepmodel import StepModel


def prefill_time(model: ModelSpec, hw: HardwareSpec, T: float, n_gpu: int = 1, mfu: float = 0.5,
                 dtype: str = "bf16", attention: bool = True) -> float:
    """Seed 003: t_prefill = (2 N_act T + 2 L d_attn T^2) / (n_gpu pi MFU), seconds; attention=False
    drops the quadratic term (as the seed does in its break-even derivations)."""
    flops = prefill_flops(model, T) if attention else 2.0 * model.n_act * T
    return flops / (n_gpu * hw.peak(dtype) * mfu)


def stall_time(model: ModelSpec, hw: HardwareSpec, prompt_tokens: float, n_gpu: int = 1, mfu: float = 0.5,
               dtype: str = "bf16") -> float:
    """Seed 003: the stall every running stream sees while a whole prompt is prefilled in one step
    (8,000 tokens of Llama 3.1 8B on an H100 at 50% MFU: about 290 ms)."""
    return prefill_time(model, hw, prompt_tokens, n_gpu, mfu, dtype)


# -- preemption: swap or recompute -------------------------------------------------------------------
def swap_time(model: ModelSpec, T: float, link_bw: float, n_gpu: int = 1, kv_dtype: str = "bf16") -> float:
    """Seed 003 Swap: two transfers of the cache, 2 T m_KV / (n_gpu b_pcie), seconds (each GPU moves
    its share over its own link)."""
    return 2.0 * T * kv_bytes_per_token(model, kv_dtype) / (n_gpu * link_bw)


def recompute_time(model: ModelSpec, hw: HardwareSpec, T: float, n_gpu: int = 1, mfu: float = 0.5,
                   dtype: str = "bf16", attention: bool = True) -> float:
    """Seed 003 Recompute: a prefill of the T cached tokens (see `prefill_time`)."""
    return prefill_time(model, hw, T, n_gpu, mfu, dtype, attention)


def swap_break_even_bw(model: ModelSpec, hw: HardwareSpec, mfu: float = 0.5, dtype: str = "bf16",
                       kv_dtype: str = "bf16") -> float:
    """Seed 003: swapping beats recomputing (without the attention term) when
    2 T m_KV / (n b) < 2 N_act T / (n pi MFU), i.e. b > m_KV pi MFU / N_act, bytes/s per GPU.
    T and n_gpu cancel: 8.1 GB/s for Llama 3.1 8B, 2.3 GB/s for 70B, on H100s at 50% MFU."""
    return kv_bytes_per_token(model, kv_dtype) * hw.peak(dtype) * mfu / model.n_act


# -- KV tiers ----------------------------------------------------------------------------------------
def prefill_throughput(model: ModelSpec, hw: HardwareSpec, n_gpu: int = 1, mfu: float = 0.5,
                       dtype: str = "bf16") -> float:
    """Theta_prefill = n_gpu pi MFU / (2 N_act), tokens/s of a replica (seed 003, attention dropped)."""
    return n_gpu * hw.peak(dtype) * mfu / (2.0 * model.n_act)


def tier_reload_wins(model: ModelSpec, hw: HardwareSpec, tier_bw: float, n_gpu: int = 1, mfu: float = 0.5,
                     dtype: str = "bf16", kv_dtype: str = "bf16") -> dict:
    """Seed 003 "Tiers of KV storage": reloading T cached tokens (T m_KV / b_tier) beats recomputing them
    (T 2 N_act / (n_gpu pi MFU)) when b_tier > m_KV Theta_prefill. Returns the break-even and verdict."""
    need = kv_bytes_per_token(model, kv_dtype) * prefill_throughput(model, hw, n_gpu, mfu, dtype)
    return {"break_even_bw": need, "tier_bw": tier_bw, "reload_wins": tier_bw > need,
            "speedup": tier_bw / need}


# -- moving the cache between pools ------------------------------------------------------------------
def transfer_time(model: ModelSpec, T_in: float, link_bw: float, kv_dtype: str = "bf16") -> float:
    """Seed 003: t_x = T_in m_KV / b_link, seconds (b_link: the replica's whole link, bytes/s)."""
    return T_in * kv_bytes_per_token(model, kv_dtype) / link_bw


def streamed_transfer_left(t_x: float, t_prefill: float, n_layers: int, last_step_frac: float = 1.0) -> float:
    """Seed 000 ("as soon as layer 1 finishes its prefill, it starts transmitting ... only the
    transfer of the last layer delays the decode"): the part of a prompt's KV transfer t_x that
    lands on TTFT when each layer's KV leaves as it is written, against all of t_x for a transfer
    after the prefill. A link that keeps up with the prefill leaves the last layer's part of the
    last step's KV, t_x f / L (f: the last step's share of the prompt, 1 unchunked); a slower
    link leaves what it could not carry while the prefill ran, t_x - t_prefill, when that is more."""
    return max(t_x - t_prefill, t_x * last_step_frac / n_layers)


def transfer_fraction(model: ModelSpec, hw: HardwareSpec, link_bw: float, n_gpu: int = 1, mfu: float = 0.5,
                      dtype: str = "bf16", kv_dtype: str = "bf16") -> float:
    """Seed 003: t_x / t_prefill = m_KV n_gpu pi MFU / (2 N_act b_link), the prompt length cancels
    (attention ignored, which only lowers the fraction). Llama 3.1 70B on 8 H100s: 18% over one
    400 Gb/s NIC, 2.3% with one NIC per GPU."""
    return kv_bytes_per_token(model, kv_dtype) * n_gpu * hw.peak(dtype) * mfu / (2.0 * model.n_act * link_bw)


def disagg_rate_bound(r_prefill: float, r_decode: float) -> float:
    """Seed 003: a disaggregated deployment serves at most 1 / (1/r_p + 1/r_d) requests/s per GPU,
    which a perfect time-sharing (collocated) GPU also reaches: splitting creates no capacity."""
    return 1.0 / (1.0 / r_prefill + 1.0 / r_decode)


# -- the planner -------------------------------------------------------------------------------------
def _md1_wait(rho: float, service_s: float) -> float:
    """Mean queueing delay of an M/D/1 queue: rho s / (2 (1 - rho)), seconds (Poisson arrivals,
    deterministic service). An assumption: the seed gives no queueing model."""
    return math.inf if rho >= 1 else rho * service_s / (2.0 * (1.0 - rho))


@dataclass
class PoolPlan:
    name: str
    replicas: int
    gpus: int
    ttft_s: float
    tpot_s: float
    per_replica_rate: float  # requests/s one replica sustains at the SLOs
    utilisation: float
    detail: dict
    feasible: bool

    def row(self) -> dict:
        return {"plan": self.name, "replicas": self.replicas, "gpus": self.gpus, "ttft_ms": self.ttft_s * 1e3,
                "tpot_ms": self.tpot_s * 1e3, "rate_per_replica": self.per_replica_rate,
                "utilisation": self.utilisation, "feasible": self.feasible}


def _max_decode_batch(sm: StepModel, T_in: float, T_out: float, tpot_slo: float, kv_budget: float) -> int:
    """Largest decode batch whose step at the final context meets the TPOT SLO and whose caches
    (B (T_in + T_out) m_KV) fit the KV budget."""
    fit_mem = int(kv_budget // ((T_in + T_out) * sm.m_kv))
    B = 0
    hi = max(fit_mem, 0)
    while B < hi and sm.decode_step_time(B + 1, T_in + T_out) <= tpot_slo:
        B += 1
        if B > 100_000:
            break
    return B


def disagg_plan(rate: float, T_in: float, T_out: float, cfg: ModelSpec, hw: HardwareSpec | str, link_bw: float,
                ttft_slo: float, tpot_slo: float, mfu: float = 0.5, max_util: float = 0.8, c_half: float = 256,
                n_gpu: int = 1, t0: float = 0.0, gpu_memory_utilization: float = 0.9,
                dtype: str = "bf16") -> dict:
    """Seed 003 `disagg_plan`: size a prefill pool and a decode pool for `rate` requests/s of T_in
    prompt and T_out output tokens against TTFT and TPOT SLOs, and compare with a collocated baseline
    that runs chunked prefill on every replica. Replicas are n_gpu GPUs each; link_bw is the bytes/s
    a replica's KV transfer gets.

    Model (assumptions, stated because the seed leaves the planner as an exercise):
      * Prefill replica: serves whole prompts one at a time, t_p = prefill_time(T_in) at MFU
        mfu * T_in / (T_in + c_half); queueing is M/D/1 at utilisation rho <= max_util;
        TTFT = wait + t_p + t_x (transfer not overlapped, a pessimistic bound).
      * Decode replica: the largest batch B whose step at context T_in + T_out meets tpot_slo and
        whose caches fit the KV budget; by Little's law it retires B / (T_out t_step) requests/s;
        it is loaded to at most max_util of that.
      * Collocated replica: chunked prefill with a token budget C per step. For each candidate decode
        batch B, C is the largest budget whose step meets tpot_slo; prefill chunks run at MFU
        mfu * (C - B) / (C - B + c_half) (small chunks are less efficient). In steady state, a
        fraction f of steps carry a chunk: rate per replica = min(B / T_out, (C - B) / T_in) / t_step;
        TTFT = ceil(T_in / (C - B)) steps + M/D/1 wait. The best B that meets both SLOs wins.
      * The plan with fewer GPUs wins; a tie goes to collocated (no transfer, no second pool).
    """
    hw = get_hardware(hw)
    kv_budget = gpu_memory_utilization * hw.memory * n_gpu - cfg.weight_bytes(dtype)
    base = StepModel(cfg, hw, n_gpu, dtype, dtype, mfu=mfu, t0=t0, c_half=c_half)
    m_kv = base.m_kv

    # ---- disaggregated: prefill pool
    t_p = base.prefill_time(T_in) + t0
    t_x = T_in * m_kv / link_bw
    r_p = 1.0 / t_p
    n_p = max(1, math.ceil(rate / (max_util * r_p)))
    while True:
        rho_p = rate / (n_p * r_p)
        ttft_d = _md1_wait(rho_p, t_p) + t_p + t_x
        if ttft_d <= ttft_slo or n_p > 10_000 or t_p + t_x > ttft_slo:
            break
        n_p += 1
    p_feasible = t_p + t_x <= ttft_slo
    # ---- disaggregated: decode pool
    B_d = _max_decode_batch(base, T_in, T_out, tpot_slo, kv_budget)
    if B_d >= 1:
        step_d = base.decode_step_time(B_d, T_in + T_out / 2)
        r_d = B_d / (T_out * step_d)
        n_d = max(1, math.ceil(rate / (max_util * r_d)))
        tpot_d = base.decode_step_time(B_d, T_in + T_out)
    else:
        step_d, r_d, n_d, tpot_d = math.inf, 0.0, 0, base.decode_step_time(1, T_in + T_out)
    disagg = PoolPlan(
        "disaggregated", n_p + n_d, (n_p + n_d) * n_gpu, ttft_d, tpot_d,
        disagg_rate_bound(r_p, r_d) if r_d > 0 else 0.0,
        max(rate / (n_p * r_p), rate / (n_d * r_d) if n_d else math.inf),
        {"prefill_replicas": n_p, "decode_replicas": n_d, "prefill_s": t_p, "transfer_s": t_x,
         "transfer_fraction": t_x / (t_p - t0) if t_p > t0 else math.inf, "decode_batch": B_d,
         "decode_step_s": step_d, "r_prefill": r_p, "r_decode": r_d},
        p_feasible and B_d >= 1 and ttft_d <= ttft_slo)

    # ---- collocated with chunked prefill
    best = None
    B_max = max(1, int(kv_budget // ((T_in + T_out) * m_kv)))
    grid = sorted({max(1, int(round(1.15 ** k))) for k in range(0, 80)} | {B_max})
    for B in [b for b in grid if b <= B_max]:
        ctx = [T_in + T_out / 2] * B
        if base.step_time(ctx) > tpot_slo:
            break
        lo, hi = B + 1, B + 1
        while base.step_time(ctx, [(hi - B, T_in / 2)]) <= tpot_slo and hi < 1 << 20:
            lo, hi = hi, hi * 2
        if lo == hi:  # even one prefill token breaks the SLO
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if base.step_time(ctx, [(mid - B, T_in / 2)]) <= tpot_slo:
                lo = mid
            else:
                hi = mid
        C = lo
        chunk = C - B
        t_step = base.step_time(ctx, [(chunk, T_in / 2)])
        r_c = min(B / T_out, chunk / T_in) / t_step
        n_c = max(1, math.ceil(rate / (max_util * r_c)))
        rho = rate / (n_c * r_c)
        t_pref = math.ceil(T_in / chunk) * t_step
        ttft_c = _md1_wait(rho, t_pref) + t_pref
        while ttft_c > ttft_slo and n_c < 10_000 and t_pref <= ttft_slo:
            n_c += 1
            rho = rate / (n_c * r_c)
            ttft_c = _md1_wait(rho, t_pref) + t_pref
        ok = ttft_c <= ttft_slo
        cand = PoolPlan("collocated (chunked prefill)", n_c, n_c * n_gpu, ttft_c, t_step, r_c, rho,
                        {"decode_batch": B, "token_budget": C, "step_s": t_step}, ok)
        if best is None or (cand.feasible, -cand.gpus, cand.per_replica_rate) > (
                best.feasible, -best.gpus, best.per_replica_rate):
            best = cand
    colloc = best or PoolPlan("collocated (chunked prefill)", 0, 0, math.inf, math.inf, 0.0, math.inf, {}, False)

    if disagg.feasible and (not colloc.feasible or disagg.gpus < colloc.gpus):
        winner = disagg.name
        why = ("collocated cannot meet both SLOs" if not colloc.feasible else
               f"it needs {colloc.gpus - disagg.gpus} fewer GPUs: decode runs batch {B_d} free of prefill chunks, "
               f"prefill runs whole prompts at full efficiency, and the transfer costs only "
               f"{disagg.detail['transfer_fraction']:.1%} of a prefill")
    elif colloc.feasible:
        winner = colloc.name
        why = ("disaggregation cannot meet the SLOs (transfer or prefill alone exceeds the TTFT target, or no "
               "decode batch meets TPOT)" if not disagg.feasible else
               f"it needs {disagg.gpus - colloc.gpus} fewer (or equal) GPUs: splitting the phases creates no "
               f"capacity (1/(1/r_p + 1/r_d) bound), and the two pools round up separately")
    else:
        winner, why = "neither", "no configuration meets both SLOs; relax them or use more GPUs per replica"
    return {"disaggregated": disagg, "collocated": colloc, "winner": winner, "why": why,
            "inputs": {"rate": rate, "T_in": T_in, "T_out": T_out, "model": cfg.name, "hw": hw.name,
                       "n_gpu": n_gpu, "link_bw": link_bw, "ttft_slo": ttft_slo, "tpot_slo": tpot_slo,
                       "mfu": mfu, "max_util": max_util, "c_half": c_half}}
