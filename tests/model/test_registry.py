"""The architecture registry (kvserve/model/registry.py): a new architecture is one model class
and one registry line, and every place that builds a model (worker/build.py) then runs it.

The toy architecture is Llama with Gemma 2's final logit soft-capping (logits -> cap * tanh(logits
/ cap)): the same greedy tokens as Llama, different logprobs, so the reference below (transformers'
Llama on the same weights, capped the same way) tells the toy's class ran from Llama's."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaModel
from kvserve.model.registry import ARCHITECTURES, Architecture, architecture, gguf_architecture
from tests.reference.hf_reference import load_hf

CAP = 2.0
MAX_TOKENS = 8
PROMPTS = [[1, 45, 300, 22, 9], [1, 7, 7, 480, 120, 33, 61, 2]]


class SoftCappedLlama(LlamaModel):
    """ToyForCausalLM: Llama whose logits are soft-capped at +-CAP."""

    def forward(self, *args, **kwargs):
        logits = super().forward(*args, **kwargs)                        # [S, V]
        return CAP * torch.tanh(logits / CAP)


@torch.inference_mode()
def reference(model_dir, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = load_hf(str(model_dir))
    ids, tokens, lps = torch.tensor([prompt]), [], []
    for _ in range(MAX_TOKENS):
        lp = torch.log_softmax(CAP * torch.tanh(model(ids).logits[0, -1].float() / CAP), dim=-1)
        t = int(lp.argmax())
        tokens.append(t)
        lps.append(float(lp[t]))
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return tokens, lps


@pytest.fixture
def toy_dir(tmp_path, random_model_dir):
    """The random Llama's files, its config.json naming the toy architecture."""
    src = random_model_dir("llama")
    out = tmp_path / "toy"
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["ToyForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    return src, out


def test_an_unregistered_architecture_is_refused_by_name(toy_dir):
    with pytest.raises(ValueError, match="unsupported model architecture.*ToyForCausalLM.*LlamaForCausalLM"):
        LLM(str(toy_dir[1]))


@pytest.mark.parametrize("settings", [{}, dict(block_size=4, num_kv_blocks=6, max_num_batched_tokens=8, max_num_seqs=2)],
                         ids=["default", "chunked_preempting"])
def test_a_new_architecture_is_one_class_and_one_registry_line(toy_dir, monkeypatch, settings):
    llama_dir, toy = toy_dir
    monkeypatch.setitem(ARCHITECTURES, "ToyForCausalLM", Architecture(SoftCappedLlama))   # the line
    llm = LLM(str(toy), **settings)
    assert type(llm.engine.model) is SoftCappedLlama
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    plain = LLM(str(llama_dir)).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for p, out, base in zip(PROMPTS, outs, plain):
        got = out.outputs[0]
        ref_tokens, ref_lps = reference(llama_dir, p)
        assert got.token_ids == ref_tokens == base.outputs[0].token_ids     # capping keeps the argmax
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
        base_lps = [lp[t].logprob for lp, t in zip(base.outputs[0].logprobs, base.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, base_lps)) > 1e-2       # ... and is not Llama's
    llm.engine.check_integrity()
    assert bool(settings) == (llm.engine.stats().num_preemptions_total > 0)


def test_family_defaults_come_from_the_registry():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                sliding_window=64)
    qwen2 = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.sliding_window is None   # opt-in window
    qwen3 = ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True})
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.sliding_window == 64
    mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_window == 64 and not mistral.attention_bias
    assert architecture("LlamaForCausalLM").model_class() is LlamaModel
    assert gguf_architecture("qwen2") == "Qwen2ForCausalLM" and gguf_architecture("gpt2") is None


def test_the_readme_lists_the_registry():
    """The README's list of architectures is the registry's (`architectures_line`)."""
    from pathlib import Path

    from kvserve.model.registry import architectures_line

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = architectures_line()
    assert line in " ".join(readme.split()), f"put this line in the README's Models item:\n{line}"
