"""`kvserve plan` / `kvserve simulate`: every subcommand runs, prints the seed's figure, and writes
its plot."""
from __future__ import annotations

import argparse
import re

import pytest

from kvserve.analysis import cli


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="kvserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_plan_roofline_prints_ridge_and_plots(tmp_path, capsys):
    png = tmp_path / "roof.png"
    rc, out = run(["plan", "roofline", "--hw", "a100-40gb-pcie", "--dtype", "fp32", "--vector-time", "0.0001",
                   "--batch", "--prefill", "--plot", str(png)], capsys)
    assert rc == 0 and "ridge point 12.54" in out and "0.0833" in out and png.stat().st_size > 10_000


def test_plan_kv_and_ceiling_and_little(capsys):
    rc, out = run(["plan", "kv", "--model", "llama-3.1-70b", "--seq-len", "4096", "--budget-gib", "50"], capsys)
    assert rc == 0 and "320" in out and "1.25" in out and re.search(r"contexts of 4096 that fit\s+40\n", out)
    rc, out = run(["plan", "ceiling", "--model", "llama-13b", "--params", "13e9", "--dtype", "int4",
                   "--batch", "1"], capsys)
    assert rc == 0 and "308" in out
    rc, out = run(["plan", "little"], capsys)
    assert rc == 0 and "1.60" in out and "1,600" in out


def test_plan_step_preempt_disagg(tmp_path, capsys):
    png = tmp_path / "step.png"
    rc, out = run(["plan", "step", "--batch", "1", "64", "--plot", str(png)], capsys)
    assert rc == 0 and "knee B* (t_K = 0)" in out and png.exists()
    rc, out = run(["plan", "preempt", "--model", "llama-3.1-70b", "--n-gpu", "8"], capsys)
    assert rc == 0 and "2.30" in out and "105" in out
    rc, out = run(["plan", "disagg", "--model", "llama-3.1-70b", "--n-gpu", "8", "--T-in", "32768",
                   "--link-gbs", "50"], capsys)
    assert rc == 0 and "0.184" in out and "215" in out and "1,525" in out
    assert "layer-wise streaming: transfer left on TTFT (ms)  2.68" in out     # 215 ms / 80 layers
    rc, out = run(["plan", "disagg", "--model", "smollm2-135m", "--T-in", "4096", "--link-gbs", "0.02",
                   "--prefill-ms", "1000", "--chunk", "2048"], capsys)
    assert rc == 0 and "4,719" in out and "3,719" in out      # the link is slower than that prefill
    rc, out = run(["plan", "disagg", "--rate", "10", "--T-in", "2000", "--T-out", "300", "--ttft-ms", "300",
                   "--tpot-ms", "12"], capsys)
    assert rc == 0 and "winner: disaggregated" in out


def test_simulate_commands(tmp_path, capsys):
    rc, out = run(["simulate", "batching", "--plot", str(tmp_path / "b.png")], capsys)
    assert rc == 0 and "24.6%" in out and (tmp_path / "b.png").exists()
    rc, out = run(["simulate", "serving", "--budget", "512", "--plot", str(tmp_path / "s.png")], capsys)
    assert rc == 0 and "chunked 512" in out and (tmp_path / "s.png").exists()
    rc, out = run(["simulate", "paging", "--steps", "160", "--plot", str(tmp_path / "p.png")], capsys)
    assert rc == 0 and "shared" in out and (tmp_path / "p.png").exists()
    rc, out = run(["simulate", "prefix", "--conversations", "20", "--pools", "4000", "16000",
                   "--plot", str(tmp_path / "x.png")], capsys)
    assert rc == 0 and "radix" in out and (tmp_path / "x.png").exists()


def test_calibrate_runs_on_the_engine_when_it_exists(tmp_path, capsys):
    # the engine-driven --calibrate path, on the real stories260K model (an engine import error fails)
    from pathlib import Path
    model = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
    if not model.exists():
        pytest.skip("stories260K not found")
    from kvserve.analysis.stepmodel import calibrate_engine
    fit, samples = calibrate_engine(str(model), batch_sizes=(1, 4), prompt_lens=(8, 64), n_decode=4)
    assert len(samples) >= 8 and all(s["step_s"] > 0 for s in samples)
    assert fit.t_tok > 0 or fit.t_W > 0


def test_plan_ceiling_moe_reads_active_weights(capsys):
    # seed 001: a mixture of experts reads only its active weights: 46.7B total, 12.9B active, H100 bf16
    rc, out = run(["plan", "ceiling", "--hw", "h100", "--params", "46.7e9", "--active-params", "12.9e9",
                   "--experts", "8", "--top-k", "2", "--batch", "1"], capsys)
    row = out.strip().splitlines()[-1].split()
    assert rc == 0 and "MoE_weights_only_tok/s" in out
    assert float(row[2]) == pytest.approx(3.35e12 / (46.7e9 * 2), rel=0.01)     # dense, every weight
    assert float(row[6]) == pytest.approx(3.35e12 / (12.9e9 * 2), rel=0.01)     # active weights only


def test_plan_budget_and_simulate_with_a_saved_fit(tmp_path, capsys):
    from kvserve.analysis.calibrated import save_fit
    from kvserve.analysis.stepmodel import StepFit
    fit = tmp_path / "fit.json"
    save_fit(StepFit(2e-3, 5e-3, 1e-6, 0.5e-3, 0.1, 0.2, 5, 5), str(fit))
    rc, out = run(["plan", "budget", "--itl-ms", "50.1", "--fit", str(fit), "--decodes", "0"], capsys)
    # floor((50.1 - 2) / 0.5) = 96
    assert rc == 0 and "--max-num-batched-tokens 96" in out and "closed form from the fit" in out
    rc, out = run(["plan", "budget", "--itl-ms", "20"], capsys)
    assert rc == 0 and "Llama 3.1 8B on H100" in out
    rc, out = run(["simulate", "serving", "--fit", str(fit), "--requests", "6", "--rate", "2", "--mean-prompt",
                   "100", "--mean-output", "10", "--budget", "256"], capsys)
    assert rc == 0 and "calibrated fit" in out and "chunked 256" in out


def test_plan_roofline_places_the_engines_measured_steps(tmp_path, capsys):
    from pathlib import Path
    model = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-hf"
    if not model.exists():
        pytest.skip("stories260K-hf not found")
    png = tmp_path / "roof.png"
    rc, out = run(["plan", "roofline", "--engine", str(model), "--batch", "1", "--context", "32",
                   "--prefill", "64", "--plot", str(png)], capsys)
    assert rc == 0 and "measured" in out and png.exists()
    assert "kvserve prefill T=64" in out and "model prefill T=64" in out and "kvserve decode B=1" in out


def test_plan_step_calibrate_saves_a_fit_that_loads(tmp_path, capsys):
    from pathlib import Path
    model = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-hf"
    if not model.exists():
        pytest.skip("stories260K-hf not found")
    from kvserve.analysis.calibrated import load_fit
    fit = tmp_path / "fit.json"
    rc, out = run(["plan", "step", "--batch", "1", "--calibrate", str(model), "--calibrate-batches", "1", "4",
                   "--calibrate-prompts", "8", "32", "--calibrate-repeats", "1", "--calibrate-decode", "3",
                   "--calibrate-trim", "0.5", "--calibrate-per-seq", "--save-fit", str(fit),
                   "--calibrate-plot", str(tmp_path / "fit.png")], capsys)
    assert rc == 0 and "fit error, relative RMSE" in out and f"wrote {fit}" in out
    assert "per-sequence cost (us)" in out and (tmp_path / "fit.png").exists()
    f = load_fit(str(fit))
    assert f.t0 >= 0 and (f.t_tok > 0 or f.t_W > 0)


def test_plan_pipeline_bubble(capsys):
    from kvserve.analysis.pipeline import bubble_fraction, measured_bubble, pipeline_speedup

    assert bubble_fraction(2, 1) == 0.5 and bubble_fraction(4, 13) == pytest.approx(3 / 16)
    assert pipeline_speedup(2, 1) == 1.0 and pipeline_speedup(4, 4) == pytest.approx(16 / 7)
    assert measured_bubble(60.0, 60.0, 2) == 0.5
    with pytest.raises(ValueError):
        bubble_fraction(0, 1)
    rc, out = run(["plan", "pipeline", "--stages", "4", "--microbatches", "8", "--measured-tok-s", "300",
                   "--one-device-tok-s", "100"], capsys)
    assert rc == 0
    assert re.search(r"bubble \(share of each stage's time idle\)\s+0.273", out)
    assert re.search(r"throughput vs one process on one stage's device\s+2.91", out)
    assert re.search(r"measured bubble \(hand-offs included\)\s+0.25", out)
