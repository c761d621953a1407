"""The planner on the engine it plans for: the calibrated step model in the simulator, seed 003's
budget rule, kvserve's measured steps as roofline points, and the real-time serving driver. Every
figure is checked against a computation done another way; no test asserts a time."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.analysis.calibrated import (CalibratedStepModel, budget_for_itl, largest_budget, load_fit,
                                         save_fit)
from kvserve.analysis.roofline import prefill_flops
from kvserve.analysis.simulate import Request, simulate_serving
from kvserve.analysis.specs import HARDWARE, MODELS, model_from_hf_config
from kvserve.analysis.stepmodel import StepFit, StepModel

STORIES_HF = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-hf"
FIT = StepFit(t0=2e-3, t_W=5e-3, t_kv=1e-6, t_tok=0.5e-3, rel_rmse=0.0, max_rel_err=0.0, n_memory=1, n_compute=1)


def test_calibrated_model_times_one_request_by_hand():
    # one request, prompt 100, 4 output tokens, budget 512: step 1 computes the prompt (100 tokens, no
    # cache): 2 + max(5, 0.5 * 100) = 52 ms -> TTFT. Then 3 decodes at contexts 101, 102, 103 (one
    # token each): 2 + max(5 + 0.001 * ctx, 0.5) ms = 7.101, 7.102, 7.103 ms.
    r = simulate_serving([Request(0, 0.0, 100, 4)], CalibratedStepModel(FIT), 1, "chunked", 512)
    assert r["ttft_p50_s"] == pytest.approx(0.052)
    assert r["itl_mean_s"] == pytest.approx((7.101 + 7.102 + 7.103) / 3e3)
    assert r["makespan_s"] == pytest.approx(0.052 + (7.101 + 7.102 + 7.103) / 1e3)


def test_fit_saved_and_loaded(tmp_path):
    save_fit(FIT, str(tmp_path / "fit.json"), model="x")
    assert load_fit(str(tmp_path / "fit.json")) == FIT


@pytest.mark.parametrize("itl_ms", [8.3, 20.2, 100.7, 333.1])
@pytest.mark.parametrize("decodes", [0, 4])
def test_budget_closed_form_matches_bisection_on_the_fit(itl_ms, decodes):
    # seed 003's rule two ways: floor((ITL - t_0) / t_tok) from the fit, and bisection on the step time
    c = budget_for_itl(FIT, itl_ms / 1e3, decodes, 50)
    assert c == largest_budget(CalibratedStepModel(FIT), itl_ms / 1e3, decodes, 50)


def test_budget_zero_when_the_memory_branch_alone_misses():
    assert budget_for_itl(FIT, 6e-3) == 0 == largest_budget(CalibratedStepModel(FIT), 6e-3)


@pytest.mark.parametrize("itl_ms", [6, 10, 20])
def test_largest_budget_on_the_analytic_model_is_the_edge(itl_ms):
    # H100, Llama 3.1 8B: the step at the budget meets the target, one more token misses it
    sm = StepModel(MODELS["llama-3.1-8b"], HARDWARE["h100"], mfu=0.5, t0=0.3e-3)
    c = largest_budget(sm, itl_ms / 1e3, 8, 1000)
    step = lambda n: sm.step_time([1000] * 8, [(n - 8, 0)])
    assert step(c) <= itl_ms / 1e3 < step(c + 1)


# -- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    if not STORIES_HF.exists():
        pytest.skip("stories260K-hf not found")
    from kvserve import LLM
    return LLM(model=str(STORIES_HF), enable_prefix_caching=False)


def test_model_spec_of_the_engine_counts_the_checkpoint(llm):
    # independent: the parameters in the safetensors file
    from safetensors import safe_open

    from kvserve.analysis.engine_measure import model_spec_of
    import math
    with safe_open(str(STORIES_HF / "model.safetensors"), framework="pt") as f:
        numel = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert model_spec_of(llm.engine).n_params == numel
    assert model_spec_of(llm.engine).n_layers == model_from_hf_config(str(STORIES_HF)).n_layers


def test_prefill_flops_count_every_weight_matrix_once_per_token():
    # independent: from the checkpoint's tensors, each 2-D weight matrix multiplies each of T tokens
    # (2 FLOPs per weight per token; the tied embedding is the LM head's matmul). The analytic count is
    # 2 N T + 2 L d_attn T^2 (causal attention), so without its attention term it agrees up to the
    # norm weights (vectors, 0.3% here).
    import math

    from safetensors import safe_open
    if not STORIES_HF.exists():
        pytest.skip("stories260K-hf not found")
    with safe_open(str(STORIES_HF / "model.safetensors"), framework="pt") as f:
        matrices = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                       if len(f.get_slice(k).get_shape()) == 2)
    spec = model_from_hf_config(str(STORIES_HF))
    T = 64
    analytic_linear = prefill_flops(spec, T) - 2 * spec.n_layers * spec.d_attn * T**2
    assert 2 * matrices * T == pytest.approx(analytic_linear, rel=0.005)
    assert 2 * matrices * T < analytic_linear


def test_roofline_points_of_the_engine(llm):
    from kvserve.analysis.engine_measure import roofline_points
    ops, spec, dtype = roofline_points(llm, prefill_tokens=(32, 128), decode_batches=(1, 4), context=32, repeats=1)
    names = [op.name for op in ops]
    assert names[:2] == ["kvserve prefill T=32", "kvserve prefill T=128"] and len(ops) == 4
    assert all(op.seconds and op.seconds > 0 for op in ops) and dtype == "fp32"
    # counted from the shape: weights once (fp32) plus the KV the step writes / reads
    assert ops[0].bytes == pytest.approx(4 * spec.n_params + 32 * 2 * 5 * 4 * 8 * 4)
    dec1, dec4 = ops[2], ops[3]
    assert dec4.intensity > dec1.intensity > 0 and ops[1].intensity > dec4.intensity


def test_run_serving_records_every_token(llm):
    from kvserve.analysis.engine_measure import run_serving
    reqs = [Request(i, 0.01 * i, 10 + 7 * i, 3 + i) for i in range(5)]
    r = run_serving(llm, reqs)
    assert r["finished"] == 5 and r["requests"] == 5
    assert r["ttft_p50_s"] > 0 and r["itl_mean_s"] > 0
    # throughput = output tokens / makespan, as the simulator defines it
    assert r["output_tokens_per_s"] == pytest.approx(sum(q.output for q in reqs) / r["makespan_s"])


def test_trimming_slow_steps_recovers_the_engine_under_one_sided_interference():
    # synthetic steps from known parameters; a quarter of them stretched 2-4x (a neighbour's load only
    # ever adds time). The plain fit is pulled off; the trimmed fit recovers the parameters and drops
    # exactly the stretched steps.
    import numpy as np

    from kvserve.analysis.stepmodel import fit_step_model, trim_slow_steps
    rng = np.random.default_rng(0)
    n = rng.integers(1, 2048, 120).astype(float)
    c = rng.integers(0, 20000, 120).astype(float)
    true = StepFit(3e-3, 20e-3, 0.5e-6, 0.4e-3, 0, 0, 0, 0)
    y = true.predict(n, c) * rng.uniform(0.99, 1.01, 120)
    slow = rng.random(120) < 0.25
    y[slow] *= rng.uniform(2, 4, slow.sum())
    samples = [{"n_tokens": a, "ctx_sum": b, "step_s": t, "i": i} for i, (a, b, t) in enumerate(zip(n, c, y))]
    plain = fit_step_model(n, c, y)
    fit, kept = trim_slow_steps(plain, samples, 0.5)
    assert {s["i"] for s in kept if s["trimmed"]} == set(np.flatnonzero(slow))
    for name in ("t0", "t_W", "t_tok"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=0.1)
    assert fit.rel_rmse < 0.02 < plain.rel_rmse


def test_lower_envelope_keeps_the_fastest_of_each_run_of_similar_steps():
    # three decode runs (8 sequences, contexts 1000-1070; 8 sequences at 4000-4070; 16 at 1000-1070),
    # each step timed with noise; the envelope keeps one step per run, the fastest of that run
    import numpy as np

    from kvserve.analysis.stepmodel import lower_envelope
    rng = np.random.default_rng(1)
    samples, fastest = [], {}
    for run, (seqs, ctx0) in enumerate([(8, 1000), (8, 4000), (16, 1000)]):
        for k in range(8):
            s = {"n_tokens": seqs, "n_seqs": seqs, "ctx_sum": ctx0 + 10 * k, "step_s": float(rng.uniform(1, 3)),
                 "run": run}
            samples.append(s)
            fastest[run] = min(fastest.get(run, 9), s["step_s"])
    out = lower_envelope(samples, 0.25)
    assert sorted((s["run"], s["step_s"]) for s in out) == sorted(fastest.items())
    # 'median': the lower median of each run's 8 times, by sorting each run separately
    medians = {run: sorted(x["step_s"] for x in samples if x["run"] == run)[3] for run in range(3)}
    assert sorted((s["run"], s["step_s"]) for s in lower_envelope(samples, 0.25, "median")) == sorted(
        medians.items())


def test_per_sequence_cost_recovered_from_noise_free_steps():
    # steps generated from known parameters with a cost per scheduled sequence: the fit with n_seqs
    # finds it; the seed's form without it cannot fit them as well
    import numpy as np

    from kvserve.analysis.stepmodel import fit_step_model
    rng = np.random.default_rng(3)
    q = rng.integers(1, 64, 80).astype(float)
    n = q + rng.integers(0, 2048, 80) * (rng.random(80) < 0.5)
    c = q * rng.integers(10, 600, 80)
    true = StepFit(10e-3, 5e-3, 4e-6, 0.5e-3, 0, 0, 0, 0, t_seq=0.2e-3)
    y = true.predict(n, c, q)
    fit = fit_step_model(n, c, y, n_seqs=q)
    for name in ("t0", "t_W", "t_kv", "t_tok", "t_seq"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-3, abs=1e-9), name
    assert fit.rel_rmse < 1e-6 < fit_step_model(n, c, y).rel_rmse


@pytest.mark.parametrize("itl_ms", [12.3, 40.7, 150.2])
@pytest.mark.parametrize("decodes", [0, 16])
def test_budget_with_a_per_sequence_cost_matches_bisection(itl_ms, decodes):
    fit = StepFit(2e-3, 5e-3, 1e-6, 0.5e-3, 0, 0, 1, 1, t_seq=0.1e-3)
    assert budget_for_itl(fit, itl_ms / 1e3, decodes, 50) == largest_budget(CalibratedStepModel(fit), itl_ms / 1e3,
                                                                            decodes, 50)
