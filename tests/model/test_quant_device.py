"""Quantized weights off the CPU (kvserve/model/quant/cpu_paths.py: refuse_off_cpu): kvserve's quantized
matmuls are CPU kernels, so int8 / int4 / a GGUF file's quantized tensors on another device
(CUDA) are refused with a ValueError that names the fix, instead of being dequantized on every
call. No GPU here: torch.device("cuda") is only a name until a tensor is put there, and the
refusal comes before any is; "meta" stands in for a device where tensors can go (floats pass)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.model.fusion import embedding_weight, linear_weight
from kvserve.model.quant.formats import Int4Weight, Int8Weight, quantize, quantize_int4, quantize_int8
from kvserve.model.quant.gguf_blocks import Int4Values, Int8BlockWeight
from tests.conftest import STORIES_HF

FIX = r"quantization='dequant'.*dtype='bfloat16'"
CUDA = torch.device("cuda")


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("device", [CUDA, "cuda:1", "meta"])
def test_quantizing_off_the_cpu_is_refused(method, device):
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match=rf"{method} weights on .*{FIX}"):
        quantize(w, method, None, torch.bfloat16, device)
    with pytest.raises(ValueError, match=FIX):
        linear_weight([w[:16], w[16:]], "qkv", method, None, device, torch.bfloat16)


def test_already_quantized_weights_are_refused_off_the_cpu():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match=FIX):
        Int8Weight(*quantize_int8(w, torch.bfloat16), device=CUDA)
    with pytest.raises(ValueError, match=FIX):
        Int4Weight(*quantize_int4(w, 32, torch.bfloat16), device=CUDA)
    with pytest.raises(ValueError, match=FIX):        # a GGUF Q8_0 embedding / LM head
        Int8BlockWeight(torch.randint(-128, 128, (16, 64), dtype=torch.int8), torch.rand(16, 2), device=CUDA)
    q, scale = quantize_int4(w, 32, torch.float32)    # a GGUF Q4 tensor as the file holds it
    parts = [Int4Values(q[:16], scale[:16]), Int4Values(q[16:], scale[16:])]
    with pytest.raises(ValueError, match=FIX):
        linear_weight(parts, "qkv", None, None, CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match=FIX):
        embedding_weight(parts[0], None, CUDA, torch.bfloat16)


def test_float_weights_still_go_anywhere():
    w = torch.randn(32, 64)
    out = linear_weight([w[:16], w[16:]], "qkv", None, None, torch.device("meta"), torch.bfloat16)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (32, 64)
    assert isinstance(quantize(w, "int8", None, torch.float32, "cpu"), Int8Weight)


def test_the_engine_refuses_int8_on_a_device_other_than_the_cpu():
    with pytest.raises(ValueError, match=FIX):
        LLM(str(STORIES_HF), device="meta", quantization="int8")
