"""worker/device.py keep_step_memory: after it, memory a CPU step frees is reused by the next
step instead of going back to the kernel and faulting in again (glibc's malloc). Each case runs
in a fresh process: the malloc settings are process-wide."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
from kvserve.worker.device import keep_step_memory
kept = keep_step_memory("cpu") if sys.argv[1] == "kept" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mb in range(8, 64, 4):      # steps whose temporaries grow: 8, 12, ..., 60 MB (past glibc's 32 MB cap), each written, then freed
    torch.ones(mb << 18)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, kept, keep_step_memory("meta"))
"""


def faults(mode: str) -> tuple[int, str, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    n, kept, off_cpu = out.stdout.split()
    return int(n), kept, off_cpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_reuses_what_the_last_one_freed():
    # glibc's default maps each chunk larger than any it freed before (and any past 32 MB) straight
    # from the kernel and unmaps it on free: all 476 MB (~122,000 pages) fault in. Kept: the heap
    # grows to 60 MB once (~15,000 pages).
    default, _, _ = faults("default")
    kept_faults, kept, off_cpu = faults("kept")
    assert kept == "True" and off_cpu == "False"
    assert default > 100_000, f"{default} faults with glibc's defaults"
    assert kept_faults < default / 3, f"{kept_faults} faults kept, {default} with glibc's defaults"
