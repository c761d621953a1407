"""Without kvserve's kernels the pure-torch path runs, with one log line saying why, and never
a crash: `KVSERVE_KERNELS=torch`, and a build that fails (a compiler that refuses to compile:
one warning carrying its message). Each case in a fresh interpreter, since the extension is
loaded once per process; the failing build in a fresh cache directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvserve import LLM, SamplingParams
from tests.kernels.isa import BUILT

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 17, 23, 99, 4, 250]
SCRIPT = f"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from kvserve import LLM, SamplingParams, kernels
built = kernels.load()
llm = LLM(sys.argv[1])
out = llm.generate([{{"prompt_token_ids": {PROMPT}}}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print(json.dumps({{"built": built, "fused": llm.engine.model.fused is not None,
                  "tokens": out[0].outputs[0].token_ids}}))
"""
# A compiler that answers torch's version probe and fails every compile with a message of its own.
REFUSING_CXX = """#!/bin/sh
case "$*" in *--version*) exec c++ "$@";; esac
echo "kvserve-test: this compiler refuses to compile" >&2
exit 1
"""


def run_engine(model_dir, **env) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def greedy_here(model_dir) -> list[int]:
    """The same request in this process (the kernels and the fused step, where built)."""
    out = LLM(str(model_dir)).generate([{"prompt_token_ids": PROMPT}],
                                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_kvserve_kernels_torch_runs_the_torch_path(random_model_dir):
    model_dir = random_model_dir("llama")
    result, log = run_engine(model_dir, KVSERVE_KERNELS="torch")
    assert result["built"] is False and result["fused"] is False
    assert log.count("KVSERVE_KERNELS=torch: kvserve's fused CPU kernels are off; the pure-torch path runs") == 1
    assert "fused decode step off (no kvserve kernels here)" in log
    assert result["tokens"] == greedy_here(model_dir)          # the same greedy tokens as the kernels'


def test_a_failed_build_warns_with_the_compilers_message_and_falls_back(random_model_dir, tmp_path):
    compiler = tmp_path / "cxx"
    compiler.write_text(REFUSING_CXX)
    compiler.chmod(0o755)
    model_dir = random_model_dir("llama")
    result, log = run_engine(model_dir, KVSERVE_KERNEL_CACHE=str(tmp_path / "cache"), CXX=str(compiler),
                             KVSERVE_KERNELS="")
    assert result["built"] is False and result["fused"] is False
    warning = log[log.index("WARNING kvserve.kernels"):]
    assert warning.startswith("WARNING kvserve.kernels: kvserve's fused CPU kernels did not build, so the "
                              "pure-torch path runs")
    assert "this compiler refuses to compile" in warning               # the compiler's own message
    assert len(result["tokens"]) == 8
    if BUILT:
        assert result["tokens"] == greedy_here(model_dir)
