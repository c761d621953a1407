"""worker/device.py keep_step_memory: after it, memory a CPU step frees is reused by the next
step instead of going back to the kernel and faulting in again (glibc's malloc). Run in a fresh
process: the malloc settings are process-wide."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from kvserve.worker.device import keep_step_memory

def faults_per_step():
    # a step's temporaries: three 12 MB tensors written, then all freed (36 MB at the heap's top)
    for _ in range(3):
        [torch.ones(3 << 20) for _ in range(3)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        [torch.ones(3 << 20) for _ in range(3)]
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

default = faults_per_step()
kept = keep_step_memory("cpu")
print(default, faults_per_step(), kept, keep_step_memory("meta"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_reuses_what_the_last_one_freed():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    default, kept_faults, kept, off_cpu = out.stdout.split()
    assert kept == "True" and off_cpu == "False"
    # 36 MB is ~9,200 pages: faulted in again every step by default, not once kept
    assert float(default) > 5000, f"the default malloc kept the memory here ({default} faults a step)"
    assert float(kept_faults) < 100
