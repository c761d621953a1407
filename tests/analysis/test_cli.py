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
    # the engine-driven --calibrate path, on the real stories260K model; skipped if either is missing
    from pathlib import Path
    model = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
    pytest.importorskip("kvserve.llm")
    if not model.exists():
        pytest.skip("stories260K not found")
    from kvserve.analysis.stepmodel import calibrate_engine
    fit, samples = calibrate_engine(str(model), batch_sizes=(1, 4), prompt_lens=(8, 64), n_decode=4)
    assert len(samples) >= 8 and all(s["step_s"] > 0 for s in samples)
    assert fit.t_tok > 0 or fit.t_W > 0
