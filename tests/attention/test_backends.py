"""The attention seam (kvserve/attention/): one selection point ("auto" decided once, a named
backend that cannot run refused with why), backends that derive their own per-step metadata
(`prepare`), a new backend in one registry line, and every backend equal to transformers end to
end (greedy tokens, logprobs within 1e-4), with chunked prefill, tiny blocks and preemption."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvserve import LLM
from kvserve.attention import selector
from kvserve.attention.cpu_fused import FusedCpuAttention
from kvserve.attention.metadata import AttentionMetadata, build_decode_key_mask
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.kv.block_pool import NULL_BLOCK
from tests.conftest import STORIES_HF
from tests.kernels.isa import BUILT, needs_kernels
from tests.reference.test_exactness import ENGINE_SETTINGS, check, prompts_for

HEADS = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=None)
select = selector.select_attention_backend


@needs_kernels
def test_auto_takes_the_kernels_where_they_run_and_logs_why_not(caplog):
    assert select("auto", HEADS, "cpu", torch.float32, "auto") is FusedCpuAttention
    assert select("auto", HEADS, "cpu", torch.bfloat16, "int8") is FusedCpuAttention
    with caplog.at_level(logging.INFO, logger="kvserve.attention.selector"):
        assert select("auto", HEADS, "cpu", torch.float16, "auto") is TorchPagedAttention
        assert select("auto", HEADS, "cpu", torch.float32, "fp8_e4m3") is TorchPagedAttention
        wide = SimpleNamespace(num_heads=34, num_kv_heads=2, head_dim=16, sliding_window=None)
        assert select("auto", wide, "cpu", torch.float32, "auto") is TorchPagedAttention
    assert "attention backend: torch (auto; not cpu_fused: a float16 cache)" in caplog.text
    assert "not cpu_fused: kv_cache_dtype fp8_e4m3" in caplog.text
    assert "not cpu_fused: 34 query heads on 2 KV heads" in caplog.text


def test_a_backend_named_that_cannot_run_or_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"cpu_fused cannot run this model here \(a float16 cache\)"):
        select("cpu_fused", HEADS, "cpu", torch.float16, "auto")
    with pytest.raises(ValueError, match="auto or one of torch, cpu_fused, mla, got 'flash'"):
        select("flash", HEADS, "cpu", torch.float32, "auto")
    with pytest.raises(ValueError, match="got 'flash'"):
        LLM(str(STORIES_HF), attention_backend="flash")
    assert select("torch", HEADS, "cuda", torch.float16, "auto") is TorchPagedAttention   # portable


def test_each_backend_derives_its_own_step_metadata():
    def step():
        return AttentionMetadata(slot_mapping=torch.tensor([40, 81]), num_decode_tokens=2,
                                 decode_block_tables=torch.tensor([[2, 3], [5, NULL_BLOCK]]),
                                 decode_context_lens=torch.tensor([20, 5]))
    torch_attn = TorchPagedAttention(4, 2, 16, 16, sliding_window=8)
    meta = torch_attn.prepare(step())
    assert torch.equal(meta.decode_key_mask, build_decode_key_mask(torch.tensor([20, 5]), 32, 8))
    assert FusedCpuAttention(4, 2, 16, 16, sliding_window=8).prepare(step()).decode_key_mask is None
    prefill_only = AttentionMetadata(slot_mapping=torch.arange(3))
    assert torch_attn.prepare(prefill_only).decode_key_mask is None


BACKENDS = ["torch"] + (["cpu_fused"] if BUILT else [])


@pytest.mark.parametrize("setting", ["default", "block4_budget7", "preempt"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_equals_transformers(backend, setting, random_model_dir):
    llm = check(random_model_dir("qwen3"), {**ENGINE_SETTINGS[setting], "attention_backend": backend},
                prompts_for(3), expect_preemption=setting == "preempt")
    assert llm.engine.model.attn.name == backend
    assert (llm.engine.model.fused is not None) == (backend == "cpu_fused")   # the fused step is cpu_fused's


class CountingAttention(TorchPagedAttention):
    """A toy backend: the portable one, counting its calls."""
    name = "counting"
    calls = 0

    def forward(self, *args):
        CountingAttention.calls += 1
        return super().forward(*args)


def test_a_new_backend_is_one_module_and_one_registry_line(monkeypatch, random_model_dir):
    monkeypatch.setitem(selector.BACKENDS, "counting", CountingAttention)       # the line
    CountingAttention.calls = 0
    llm = check(random_model_dir("llama"), {"attention_backend": "counting"}, prompts_for(4, n=2))
    assert type(llm.engine.model.attn) is CountingAttention and llm.engine.model.fused is None
    assert CountingAttention.calls >= 2 * 12          # every layer of every step went through it
