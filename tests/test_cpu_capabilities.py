"""The quantized paths on torch's other CPU capabilities (kvserve/model/quant/cpu_paths.py).

torch's CPU kernels, and the layout of their packed weights, change with the capability torch
dispatches to. ATEN_CPU_CAPABILITY forces a lower one, so an AVX-512 host also runs the AVX2 and
the DEFAULT (no SIMD; the portable path an Arm build takes) kernels: each capability below this
host's runs the quantization, GGUF, default-model, int8-KV, attention and self-int4 speculation
tests in a pytest of its own. (The host's own capability is the rest of the suite.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["DEFAULT", "AVX2", "AVX512"]
MODULES = ["tests/kernels", "tests/model/test_quant.py", "tests/model/test_gguf_quant.py", "tests/model/test_gguf.py",
           "tests/model/test_cpu_kernels.py", "tests/test_default_model.py",
           "tests/engine/test_kv_quant.py", "tests/engine/test_sharing.py",
           "tests/attention",    # the one-call prefill SDPA (torch's fused kernel per ISA), each backend end to end
           "tests/pooling/test_exactness.py"]   # embeddings: the same prefill path, and BERT's kernels
SELF_INT4 = "tests/reference/test_spec_exactness.py::test_constrained_speculative_engine_equals_unconstrained"
# greedy equals transformers and the differential fuzzer: with the fused decode step (on for float32
# models) on each capability's ISA, and with KVSERVE_KERNELS=torch on this host's
EXACTNESS = ["tests/reference/test_exactness.py", "tests/reference/test_differential.py"]
# tests of those modules whose subject no ISA changes (command-line plumbing, a failing
# compiler): the main run has them, the forced runs skip them
ISA_INDEPENDENT = ["tests/test_default_model.py::test_chat_without_model_over_stdin",
                   "tests/test_default_model.py::test_generate_without_model_uses_the_default",
                   "tests/kernels/test_fallback.py::test_a_failed_build_warns_with_the_compilers_message_and_falls_back"]


def below_this_host() -> list[str]:
    here = torch.backends.cpu.get_cpu_capability()
    return ORDER[:ORDER.index(here)] if here in ORDER else []


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2"])
def test_quantized_paths_under_a_forced_capability(capability):
    if capability not in below_this_host():
        pytest.skip(f"this host's capability is {torch.backends.cpu.get_cpu_capability()}: "
                    f"{capability} is not below it (the main run covers it where it is this host's)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    # seeds 4 and 10 of the speculative fuzz use the self-int4 draft
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES, *EXACTNESS,
           f"{SELF_INT4}[4]", f"{SELF_INT4}[10]",
           "-k", "not test_quantized_paths_under_a_forced_capability",
           *(f"--deselect={t}" for t in ISA_INDEPENDENT)]
    check = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    assert subprocess.run(check, env=env, capture_output=True, text=True).stdout.strip() == capability
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(run.stdout.splitlines()[-60:])
    assert run.returncode == 0, f"under ATEN_CPU_CAPABILITY={capability}:\n{tail}\n{run.stderr[-3000:]}"
    assert " passed" in tail and "failed" not in tail.splitlines()[-1]


def test_exactness_with_kvserve_kernels_off():
    """KVSERVE_KERNELS=torch: the pure-torch path (no compiler, or a failed build) stays exact."""
    env = {**os.environ, "KVSERVE_KERNELS": "torch"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EXACTNESS]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(run.stdout.splitlines()[-40:])
    assert run.returncode == 0, f"under KVSERVE_KERNELS=torch:\n{tail}\n{run.stderr[-3000:]}"
    assert " passed" in tail and "failed" not in tail.splitlines()[-1]
