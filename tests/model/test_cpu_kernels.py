"""The CPU kernel plan (kvserve/model/quant/cpu_paths.py): the table entry each capability gets,
kernels switched off when they fail their probe, the float-resident plan, and portable detection.
The whole quantization suite also runs under ATEN_CPU_CAPABILITY=default and =avx2 (.ci/run)."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.model.quant import cpu_paths
from kvserve.model.quant.cpu_paths import TABLE, entry_for, kernel_plan, native_bf16
from kvserve.model.quant.formats import Int4Weight, quantize
from tests.conftest import STORIES_HF


@pytest.fixture
def fresh_plan():
    """kernel_plan() recomputed in the test, and this process's own plan restored after it."""
    kernel_plan.cache_clear()
    cpu_paths._warned.clear()
    yield
    kernel_plan.cache_clear()


@pytest.mark.parametrize("capability,bf16,entry", [
    ("AVX512", True, "avx512_bf16"), ("AVX512", False, "avx512"), ("AVX2", False, "avx2"),
    ("AVX2", True, "avx2"), ("DEFAULT", False, "default"),
    ("SVE256", False, "default"), ("ZVECTOR", False, "default"), ("VSX", True, "default")])
def test_entry_per_capability(capability, bf16, entry):
    assert entry_for(capability, bf16) == entry


def test_every_entry_is_complete():
    for name, plan in TABLE.items():
        assert plan.name == name and plan.dense_dtype in (torch.float32, torch.bfloat16)
        if plan.float_resident:
            assert plan.int4_kernel_max_rows == plan.int8_kernel_max_rows == -1


def test_plan_of_this_process_names_its_capability():
    plan = kernel_plan()
    assert plan.capability == torch.backends.cpu.get_cpu_capability()
    assert plan.name == entry_for(plan.capability, native_bf16())
    assert plan.capability in plan.describe()


def test_unknown_capability_takes_the_portable_entry(monkeypatch, fresh_plan, caplog):
    """A capability string the table does not know (an Arm or POWER build's): DEFAULT's entry,
    one warning."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    with caplog.at_level(logging.WARNING):
        plan = kernel_plan()
        kernel_plan()
    assert plan.name == "default" and plan.capability == "SVE256" and plan.float_resident
    assert sum("SVE256" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1


def test_onednn_capped_below_bf16_is_not_native_bf16(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert native_bf16() == (kernels.cpu_flag("_is_avx512_bf16_supported")
                             or kernels.cpu_flag("_is_amx_tile_supported"))


def test_missing_cpuinfo_query_reads_as_absent(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert kernels.cpu_flag("_is_avx512_bf16_supported") is False


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_kernel_that_fails_its_probe_is_switched_off(monkeypatch, fresh_plan, caplog, broken):
    """A kernel missing from a build, or giving wrong results, is not used: the weights take the
    dequantize path (exact), with one warning that names the capability."""
    def probe():
        if broken == "raises":
            raise RuntimeError("no such kernel on this build")
        return False
    monkeypatch.setattr(cpu_paths, "_int4_probe_ok", probe)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.WARNING):
        plan = kernel_plan()
    assert plan.int4_kernel_max_rows == -1 and plan.int8_kernel_max_rows == TABLE["avx2"].int8_kernel_max_rows
    assert any("AVX2" in r.getMessage() and "int4" in r.getMessage() for r in caplog.records)
    w = quantize(torch.randn(64, 128), "int4", 32, torch.float32)
    assert isinstance(w, Int4Weight) and w.packed is None and w.kernel_max_rows == -1
    x = torch.randn(2, 128)
    ref = x.double() @ w.dequantize(dtype=torch.float32).double().T
    assert (w.linear(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_float_resident_plan(monkeypatch, fresh_plan, caplog):
    """Where no quantized path wins (DEFAULT), int4 weights keep their int4 values but are held
    as tensors in the model dtype, with one warning; quantize_activations is refused there."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(STORIES_HF), quantization="int4")
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.qkv, torch.Tensor) and layer.qkv.dtype == torch.float32
    held = sum("held dequantized" in r.getMessage() for r in caplog.records)
    assert held == 1
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="quantize_activations"):
        LLM(str(STORIES_HF), quantization="int8", quantize_activations=True)
    monkeypatch.undo()
    kernel_plan.cache_clear()
    if kernel_plan().float_resident:
        return                  # this process's own plan is DEFAULT's: nothing quantized to compare
    quantized = LLM(str(STORIES_HF), quantization="int4").engine.model.layers[0].qkv
    assert torch.equal(layer.qkv, quantized.dequantize(dtype=torch.float32))   # the same values
