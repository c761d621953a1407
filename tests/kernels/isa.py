"""The ISAs kvserve's kernels can run on here, and a context that runs code on one of them."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kvserve import kernels

BUILT = kernels.load()
if not BUILT and os.environ.get("KVSERVE_REQUIRE_KERNELS") == "1" and os.environ.get("KVSERVE_KERNELS") != "torch":
    raise RuntimeError("KVSERVE_REQUIRE_KERNELS=1 (CI) but kvserve's kernels did not build: see the warning "
                       "with the compiler's message")
needs_kernels = pytest.mark.skipif(not BUILT, reason="kvserve's kernels are not built here (KVSERVE_KERNELS=torch "
                                   "or no compiler): the pure-torch path is tested by the rest of the suite")


def capability_bits() -> int:
    """The widest ISA torch's capability allows (ATEN_CPU_CAPABILITY): kvserve's default."""
    return kernels.CAPABILITY_BITS.get(torch.backends.cpu.get_cpu_capability(), 0)


def allowed_isas() -> list[tuple[str, int]]:
    """(name, bits) of every ISA both the CPU and torch's capability allow, widest first."""
    if not BUILT:
        return []
    found: dict[str, int] = {}
    for bits in (512, 256, 0):
        if bits <= capability_bits():
            found.setdefault(torch.ops.kvserve.set_isa(bits), bits)
    torch.ops.kvserve.set_isa(capability_bits())
    return list(found.items())


ISAS = allowed_isas()
ISA_BITS = [pytest.param(bits, id=name) for name, bits in ISAS] or [pytest.param(0, id="none")]


@contextlib.contextmanager
def on_isa(bits: int):
    """Runs the block on ISA `bits` (set_isa), then restores torch's capability's."""
    name = torch.ops.kvserve.set_isa(bits)
    try:
        yield name
    finally:
        torch.ops.kvserve.set_isa(capability_bits())
