"""The seeds' own numbers, reproduced by kvserve.analysis's closed forms (tolerance 1% unless the
seed itself rounds more coarsely, which each test says)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.analysis import kvmath, roofline
from kvserve.analysis.disagg import (prefill_time, recompute_time, stall_time, swap_break_even_bw, swap_time,
                                     streamed_transfer_left, tier_reload_wins, transfer_fraction, transfer_time)
from kvserve.analysis.specs import HARDWARE, MODELS, model_from_hf_config
from kvserve.analysis.stepmodel import StepModel

L8, L70, M13 = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"], MODELS["llama-13b"]
H100, A100 = HARDWARE["h100"], HARDWARE["a100"]
KiB, GiB = 2**10, 2**30


def close(x, y, rel=0.01):
    return x == pytest.approx(y, rel=rel)


# -- specs ------------------------------------------------------------------------------------------
def test_llama_param_counts_match_seed():
    # seed 003: "2 x 8.03 x 10^9 x 8,000" -> N = 8.03e9 for Llama 3.1 8B
    assert close(L8.n_params, 8.03e9, 0.001)
    assert close(L70.n_params, 70.55e9, 0.001)   # Meta's published 70.6B
    assert close(MODELS["qwen3-0.6b"].n_params, 0.596e9, 0.005)


def test_model_from_hf_config_roundtrip():
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
           "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False, "model_type": "llama"}
    m = model_from_hf_config(cfg, "l8")
    assert m.n_params == L8.n_params and m.head_dim == 128 and kvmath.kv_bytes_per_token(m) == 131072


# -- KV sizes (seeds 003, 004, 001 exercise 2) --------------------------------------------------------
def test_llama8b_kv_per_token_is_128_kib():
    # seed 003: m_KV = 2 x 32 x 8 x 128 x 2 = 131,072 bytes, 128 KiB per token (exact)
    assert kvmath.kv_bytes_per_token(L8) == 131072 == 128 * KiB


def test_8k_request_about_1_gb_and_32_of_them_34_gb():
    # seed 004: "one 8,000-token request needs about 1 GB ... 32 concurrent requests need about 34 GB"
    # (the seed's code uses 8,192 tokens and decimal GB: 1.07 and 34.4)
    one = kvmath.kv_cache_bytes(L8, 8192) / 1e9
    assert round(one, 1) == 1.1 and abs(one - 1.0) < 0.1
    assert round(kvmath.kv_cache_bytes(L8, 8192, batch=32) / 1e9) == 34
    # seed 001: "~1.0 GiB per 8k-token sequence" (exact: 1.000 GiB)
    assert close(kvmath.kv_cache_bytes(L8, 8192) / GiB, 1.0)


def test_exercise_2_kib_gib_and_contexts():
    # seed 001 exercise 2: L = 80, H_kv = 8, d_h = 128, bf16
    per_tok = kvmath.kv_bytes_per_token(n_layers=80, n_kv_heads=8, head_dim=128)
    assert per_tok / KiB == 320                                              # (a) 320 KiB
    assert close(kvmath.kv_cache_bytes(L70, 4096) / GiB, 1.25)               # (b) 1.25 GiB
    assert kvmath.contexts_that_fit(50 * GiB, 4096, L70) == 40               # (c) 40 contexts


def test_exercise_3_fp16_and_int4_ceilings():
    # seed 001 exercise 3: 13B on 2.0 TB/s, tokens/s <= BW / (N P): fp16 76.9, int4 307.7, 4x
    fp16 = kvmath.decode_ceiling_weights_only(13e9, 2.0e12, "fp16")
    int4 = kvmath.decode_ceiling_weights_only(13e9, 2.0e12, "int4")
    assert close(fp16, 76.92) and close(int4, 307.7) and close(int4 / fp16, 4.0, 1e-9)


def test_exercise_4_littles_law():
    # seed 001 exercise 4: L = 40, T = 1000 tokens, TPOT 25 ms -> W = 25 s, 1.6 req/s, 1,600 tok/s
    r = kvmath.fleet_throughput(40, 1000, 0.025)
    assert close(r["latency_s"], 25.0) and close(r["requests_per_s"], 1.6) and close(r["tokens_per_s"], 1600)


def test_exercise_5_two_ceilings():
    # seed 001 exercise 5: 8B (16 GB fp16), B = 32, S = 8192, 2.0 TB/s. Weight-only: 4,000 tok/s;
    # with KV reads: 32 / ((16e9 + 34.36e9) / 2e12) = 1,271 tok/s; KV read ~2x the weight read.
    base = kvmath.decode_ceiling_weights_only(8e9, 2.0e12, "fp16", batch=32)
    full = kvmath.decode_ceiling_tps(16e9, 2.0e12, 32, 8192, L8)
    assert close(base, 4000) and close(full, 1270.8)
    assert round(kvmath.kv_cache_bytes(L8, 8192, 32) / 16e9) == 2


def test_attention_overtakes_linear_at_6d():
    # seed 000: 24 d^2 vs 4 T d -> T > 6d = 24,576 for d = 4096
    assert kvmath.attention_crossover_tokens(4096) == 24576
    lin, att = kvmath.flops_per_token_seed000(4096, 24576)
    assert lin == att


def test_decode_attention_intensity():
    # seed 001: 2 H_q / (H_kv P) = 4 FLOP/byte for Llama 3 8B in bf16, 1 for full MHA
    assert kvmath.decode_attention_intensity(L8) == 4
    assert kvmath.decode_attention_intensity(M13) == 1
    op = roofline.decode_attention(L8, 3000)
    assert close(op.intensity, 4.0, 1e-9)


# -- roofline (seed 000, seed 001) -------------------------------------------------------------------
def test_a100_fp32_ridge_point():
    # seed 000: 19,500 / 1,555 = 12.54 FLOP/byte
    hw = HARDWARE["a100-40gb-pcie"]
    assert round(hw.ridge_point("fp32"), 2) == 12.54


def test_vector_add_point():
    # seed 000: (0.083, 10): 1e6 FLOPs over 12e6 bytes, in 0.1 ms -> 10 GFLOP/s
    op = roofline.vector_op(1_000_000, dtype="fp32").timed(0.0001)
    assert round(op.intensity, 3) == 0.083 and close(op.achieved / 1e9, 10.0, 1e-9)
    assert roofline.bound(op, 19.5e12, 1555e9) == "memory"


def test_bf16_ridges_a100_h100():
    # seed 001: A100 312 TFLOP/s over 2.0 TB/s ~ 150 ("near ~150"); H100 ~ 300
    assert 140 < A100.ridge_point("bf16") < 160 and 290 < H100.ridge_point("bf16") < 310


def test_matmul_naive_and_cached():
    # seed 000: FLOPs 2ABC, naive 2ABC dt, cached (AB+BC+AC) dt; square: ~2N / (3 dt)
    op = roofline.matmul(4096, 4096, 4096, "fp32")
    assert op.flops == 2 * 4096**3 and close(op.intensity, 2 * 4096 / (3 * 4))
    naive = roofline.matmul(4096, 4096, 4096, "fp32", cached=False)
    assert naive.intensity == pytest.approx(1 / 4)
    # tensor multiplication: batch dims cancel in X, multiply FLOPs
    b = roofline.matmul(64, 128, 256, "bf16", batch=24)
    assert close(b.intensity, roofline.matmul(64, 128, 256, "bf16").intensity, 1e-12) and b.flops == 24 * 2 * 64 * 128 * 256


@given(st.integers(2, 4096), st.integers(2, 4096), st.integers(2, 4096))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_cached_matmul_never_less_intense_than_naive(A, B, C):
    # (AB + BC + AC) <= 2ABC iff 1/A + 1/B + 1/C <= 2: true for every dim >= 2. (The seed's naive count
    # leaves out the output write, so a 1x1x1 "naive" matmul moves fewer bytes than the cached one.)
    assert roofline.matmul(A, B, C).intensity >= roofline.matmul(A, B, C, cached=False).intensity * (1 - 1e-12)


@given(st.floats(1e-3, 1e4), st.floats(1e9, 1e16), st.floats(1e9, 1e13))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_attainable_is_the_roof(I, P, Bw):
    a = roofline.attainable(I, P, Bw)
    assert a <= P * (1 + 1e-12) and a <= Bw * I * (1 + 1e-12)
    assert roofline.attainable(I * 1.5, P, Bw) >= a * (1 - 1e-12)      # the roof never slopes down


def test_attainable_literal_points_a100_fp32():
    # seed 000's A100 40 GB PCIe, FP32: P = 19,500 GFLOP/s, B = 1,555 GB/s, ridge 12.54 FLOP/byte.
    # Vector add (1 FLOP per 12 bytes): 1,555 / 12 = 129.58 GFLOP/s, on the slanted roof.
    # 4096^3 fp32 matmul, cached: 2 x 4096 / 12 = 682.7 FLOP/byte, on the flat roof: 19,500 GFLOP/s.
    P, Bw = 19.5e12, 1555e9
    assert close(roofline.attainable(1 / 12, P, Bw), 129.58e9, 1e-4)
    assert close(roofline.attainable(682.7, P, Bw), 19.5e12, 1e-9)
    assert close(roofline.attainable(6.0, P, Bw), 9.33e12, 1e-3)         # 1,555 x 6 = 9,330


def test_decode_memory_bound_prefill_compute_bound():
    # seed 001: decode at B=1 sits two orders of magnitude below the ridge; prefill of 4k tokens above
    dec = roofline.decode_step(L8, 1, 1000)
    pre = roofline.prefill_step(L8, 4096)
    assert roofline.bound(dec, H100.peak(), H100.bandwidth) == "memory" and dec.intensity < 2
    assert roofline.bound(pre, H100.peak(), H100.bandwidth) == "compute"


# -- step-time model (seed 003) ---------------------------------------------------------------------
# Hand arithmetic for Llama 3.1 8B (N = 8,030,261,248 parameters, bf16: M_W = 16,060,522,496 bytes,
# m_KV = 131,072 bytes) on one H100 (beta = 3.35e12 bytes/s, pi = 989e12 FLOP/s), seed 003's symbols:
#   t_W = 16,060,522,496 / 3.35e12                      = 4.79418 ms
#   t_N = 2 x 8,030,261,248 / 989e12                      = 16.2392 us
#   t_K(2000) = 2000 x 131,072 / 3.35e12                  = 78.2519 us
#   t_F(2000) = (2N + 4 x 32 x 4096 x 2000) / 989e12      = 17.2994 us
#   B* = t_W / t_N = s_W pi / (2 beta) = 2 x 989 / 6.70   = 295.224  (N cancels)
# These literals are computed here, not by kvserve: a wrong t_W, t_N, t_K, t_F or a wrong
# combination of them in StepModel changes at least one of the numbers below.
T_W, T_N, B_STAR = 4.79418e-3, 16.2392e-6, 295.224


def test_knee_batch_is_sw_pi_over_2beta():
    sm = StepModel(L8, H100)
    assert close(sm.t_W, T_W, 1e-5) and close(sm.t_N, T_N, 1e-5)
    # with no context the step turns compute-bound at B* = 295.2 sequences
    assert close(sm.knee_batch(0), B_STAR, 1e-5)
    # at 2,000 tokens of context one sequence's cache read (78.3 us) outlasts its arithmetic
    # (17.3 us): a decode step never turns compute-bound, whatever the batch
    assert sm.knee_batch(2000) == math.inf


def test_chunk_budget_literal_values():
    # seed 003: C* = (t_W + B t_K) / t_N - B; "a few hundred on an H100", more at long contexts
    sm = StepModel(L8, H100)
    assert close(sm.chunk_budget(0), B_STAR, 1e-5)                    # 295.2: B* with no decodes
    assert close(sm.chunk_budget(32), B_STAR - 32, 1e-5)              # 263.2
    # B = 32 at 2,000 tokens: (16,060,522,496 + 32 x 2000 x 131,072) bytes / 3.35e12 = 7.29825 ms of
    # memory; / 16.2392 us = 449.42 token-times, less the 32 decode tokens = 417.42
    assert close(sm.chunk_budget(32, 2000), 417.42, 1e-4)


@given(st.integers(1, 256), st.floats(0, 16384), st.floats(1, 16384))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_chunk_budget_grows_with_context_and_shrinks_one_per_decode(B, ctx, extra):
    # seed 003: "Long contexts make that room bigger, because the cache reads lengthen the step
    # without adding arithmetic"; with t_K = 0, C* = B* - B (each decode token takes one slot)
    sm = StepModel(L8, H100)
    assert sm.chunk_budget(B, ctx + extra) > sm.chunk_budget(B, ctx)
    assert sm.chunk_budget(B + 1, 0) == pytest.approx(sm.chunk_budget(B, 0) - 1, abs=1e-9)


@pytest.mark.parametrize("ctx", [0, 2000])
def test_chunk_budget_is_where_the_packed_step_stops_being_free(ctx):
    # Two code paths: chunk_budget's closed form against step_time's token-by-token packed step
    # (prefill at peak, as seed 003's proof assumes). A chunk of 90% of C* rides along with 32
    # decodes for free (the step still costs its memory read); 110% of C* makes the step longer.
    sm = StepModel(L8, H100, mfu=1.0)
    B = 32
    C = sm.chunk_budget(B, ctx)
    decode_only = sm.step_time([ctx] * B)
    assert sm.step_time([ctx] * B, chunks=[(int(0.9 * C), 0)]) == pytest.approx(decode_only, rel=1e-12)
    assert sm.step_time([ctx] * B, chunks=[(int(1.1 * C), 0)]) > decode_only * 1.05


def test_step_time_literal_values_both_regimes():
    # seed 003's widget: 0.3 ms of overhead per step. t(B) = max(t_W + B t_K, B t_F) + t_0, by hand:
    sm = StepModel(L8, H100, t0=3e-4)
    cases = [
        # B=1, 2,000 ctx: memory 4.79418 + 0.07825 = 4.87243 ms  > compute 0.0173 ms
        (1, 2000, 5.17243e-3),
        # B=1024, 2,000 ctx: memory 4.79418 + 1024 x 0.0782519 = 84.9242 ms > compute 17.7146 ms
        (1024, 2000, 85.2242e-3),
        # B=64, no ctx: memory 4.79418 ms > compute 64 x 16.2392 us = 1.0393 ms
        (64, 0, 5.09418e-3),
        # B=1024, no ctx: compute-bound, 1024 x 16.2392 us = 16.6289 ms > memory 4.79418 ms
        (1024, 0, 16.9289e-3),
    ]
    for B, ctx, want in cases:
        assert close(sm.decode_step_time(B, ctx), want, 1e-5), (B, ctx)
        # the general packed step agrees with the closed form for a pure decode batch
        assert sm.step_time([ctx] * B) == pytest.approx(want, rel=1e-5)


@given(st.integers(1, 2048), st.floats(0, 32768), st.integers(1, 64), st.floats(1, 4096))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_step_time_grows_with_batch_and_context(B, ctx, dB, dctx):
    sm = StepModel(L8, H100, t0=3e-4)
    t = sm.decode_step_time(B, ctx)
    assert sm.decode_step_time(B + dB, ctx) >= t and sm.decode_step_time(B, ctx + dctx) > t
    # never below the weight read plus overhead (4.79418 ms + 0.3 ms)
    assert t >= 5.09418e-3 * (1 - 1e-5)


# -- planners (seed 003) -----------------------------------------------------------------------------
def test_swap_recompute_break_even():
    # seed 003: 8.1 GB/s per GPU for Llama 3.1 8B and 2.3 GB/s for the 70B on eight GPUs (H100, MFU 0.5)
    assert round(swap_break_even_bw(L8, H100) / 1e9, 1) == 8.1
    assert round(swap_break_even_bw(L70, H100) / 1e9, 1) == 2.3


def test_swap_105ms_vs_recompute_1_5s():
    # seed 003: "At 25 GB/s effective, a 32,000-token sequence of the 70B swaps in 105 ms and takes 1.5 s
    # to recompute" (8 H100s, MFU 0.5, recompute with the attention term: 1.48 s)
    assert close(swap_time(L70, 32000, 25e9, n_gpu=8), 0.105)
    assert round(recompute_time(L70, H100, 32000, n_gpu=8), 1) == 1.5


def test_8000_token_stall_about_290ms():
    # seed 003: ~1.3e14 weight FLOPs plus attention, "about 290 ms at 50% MFU". We compute 293.8 ms;
    # the seed rounds to two figures, so the test asks for 285-295 ms.
    assert close(2 * L8.n_params * 8000, 1.3e14, 0.02)
    assert 0.285 <= stall_time(L8, H100, 8000) < 0.295


def test_transfer_fractions_18_and_2_3_percent():
    # seed 003: 70B on 8 H100s, one 400 Gb/s NIC (50 GB/s): 18%; one NIC per GPU (400 GB/s): 2.3%
    assert round(transfer_fraction(L70, H100, 50e9, n_gpu=8), 2) == 0.18
    assert round(transfer_fraction(L70, H100, 400e9, n_gpu=8), 3) == 0.023


def test_32k_prompt_10_7_gb_215_ms_1_53_s():
    # seed 003: 32,768 tokens carry 10.7 GB, 215 ms over one NIC against 1.53 s of prefill
    assert close(kvmath.kv_cache_bytes(L70, 32768) / 1e9, 10.7)
    assert close(transfer_time(L70, 32768, 50e9), 0.215)
    assert close(prefill_time(L70, H100, 32768, n_gpu=8), 1.53)


def test_layer_wise_streaming_leaves_one_layers_share_or_what_the_link_could_not_carry():
    # seed 000: the 70B's 32k prompt (215 ms over one NIC, 1.53 s of prefill, 80 layers): the link
    # keeps up, so only the last layer's part of the last step's KV waits for the decode
    t_x, t_p = transfer_time(L70, 32768, 50e9), prefill_time(L70, H100, 32768, n_gpu=8)
    assert close(streamed_transfer_left(t_x, t_p, 80), t_x / 80)
    assert close(streamed_transfer_left(t_x, t_p, 80, last_step_frac=0.25), t_x / 320)
    # a link 20x slower than that carries 4.3 s: what it could not carry during the prefill stays
    assert close(streamed_transfer_left(20 * t_x, t_p, 80), 20 * t_x - t_p)


def test_tier_reload_is_swap_break_even_with_one_transfer():
    # seed 003: reload wins when b_tier > m_KV Theta_prefill; the swap break-even halves it (2 transfers
    # vs 1, and swap per GPU)
    r = tier_reload_wins(L8, H100, 25e9)
    assert close(r["break_even_bw"], swap_break_even_bw(L8, H100) / 2, 1e-9) and r["reload_wins"]


@given(st.integers(100, 200_000), st.floats(1e9, 1e11))
@settings(max_examples=50, deadline=None, derandomize=True)
def test_break_even_is_where_swap_equals_recompute(T, bw):
    # seed 003: T cancels; without attention, swap < recompute iff bw > break-even
    be = swap_break_even_bw(L70, H100)
    s, r = swap_time(L70, T, bw, 8), recompute_time(L70, H100, T, 8, attention=False)
    if abs(bw - be) / be > 1e-6:
        assert (s < r) == (bw > be)


def test_paging_waste_half_a_block():
    # seed 003: (n_blk - 1)/2 wasted slots on average; 7.5 for 16-token blocks
    from kvserve.analysis.paging import average_paging_waste
    assert kvmath.paging_waste_slots(16) == 7.5
    import numpy as np
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20000, 200_000)
    for n in (1, 4, 16, 64):
        assert average_paging_waste(n, lengths) == pytest.approx((n - 1) / 2, abs=0.02 * n + 0.01)
    assert kvmath.block_table_entries(128 * 1024, 16) == 8192  # seed 003: 8,192 entries


def test_measure_hardware_returns_positive_rates():
    from kvserve.analysis.specs import measure_hardware
    hw = measure_hardware(seconds=0.2, size_mb=8, n=256)
    assert hw.bandwidth > 1e8 and hw.peak("fp32") > 1e8 and hw.ridge_point("fp32") > 0
