"""The architecture registry (vLLM's model registry, at kvserve's size): an HF `architectures`
name -> the model class that runs it and the family's defaults that a config.json leaves out.

Adding an architecture is one module holding its model class and one line in ARCHITECTURES
(or, from outside the package, one `register_architecture` call). A model class is built as

    cls(cfg: ModelConfig, weights: dict[str, Tensor] (HF names), attn: AttentionBackend, device,
        dtype, quantization, quantization_group_size, tp=TPGroup | None, quantize_activations=bool)

and runs `forward(input_ids [T], positions [T], meta, kv_caches, logits_indices [R]) -> [R, V]`
and `hidden_states(...) -> [R, hidden]` (kvserve/model/llama.py is the reference). Classes are
named by "module:Class" and imported when first built, so reading a config imports no model.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Architecture:
    """One architecture: its model class ("module:Class", or the class itself), the GGUF
    `general.architecture` name its files carry (None: no GGUF loader), and the ModelConfig
    fields its family sets when config.json does not say (`defaults`), e.g. Qwen2's q/k/v biases."""
    model: str | type
    gguf: str | None = None
    defaults: dict = field(default_factory=dict)
    sliding_window_opt_in: bool = False     # config.json's sliding_window counts only with use_sliding_window
    experts: bool = False                   # MoE: the checkpoint's expert tensors are checked at load
    adapter: str | None = None  # a module with config_fields(hf) -> dict and/or adapt_weights(weights, cfg)
    note: str = ""              # what the README's list says of it beside its GGUF name and experts

    def adapt(self, hook: str):
        """The adapter module's `hook` function, or None (kvserve/model/families.py)."""
        return getattr(importlib.import_module(self.adapter), hook, None) if self.adapter else None

    def model_class(self) -> type:
        if isinstance(self.model, type):
            return self.model
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)


LLAMA = "kvserve.model.llama:LlamaModel"
MOE = "kvserve.model.moe_models:MoeModel"         # Llama's layers, the MLP a mixture of experts
GEMMA, FAMILIES = "kvserve.model.gemma:GemmaModel", "kvserve.model.families"
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LLAMA, gguf="llama"),      # also SmolLM, TinyLlama, Llama 2/3
    "MistralForCausalLM": Architecture(LLAMA),
    "Qwen2ForCausalLM": Architecture(LLAMA, gguf="qwen2", defaults={"attention_bias": True},
                                     sliding_window_opt_in=True),
    "Qwen3ForCausalLM": Architecture(LLAMA, gguf="qwen3", defaults={"qk_norm": True},
                                     sliding_window_opt_in=True),
    "MixtralForCausalLM": Architecture(MOE, gguf="llama", defaults={"norm_topk_prob": True}, experts=True),
    "Qwen2MoeForCausalLM": Architecture(MOE, gguf="qwen2moe", defaults={"attention_bias": True}, sliding_window_opt_in=True,
                                        experts=True),
    "Qwen3MoeForCausalLM": Architecture(MOE, gguf="qwen3moe", defaults={"qk_norm": True},
                                        sliding_window_opt_in=True,
                                        experts=True),
    "OlmoeForCausalLM": Architecture(MOE, gguf="olmoe", defaults={"qk_norm": True, "qk_norm_full": True}, experts=True),
    "Phi3ForCausalLM": Architecture(LLAMA, adapter=FAMILIES),        # Phi-3, Phi-3.5, Phi-4(-mini)
    "Gemma2ForCausalLM": Architecture(GEMMA, adapter=FAMILIES),
    "Gemma3ForCausalLM": Architecture(GEMMA, adapter=FAMILIES, defaults={"qk_norm": True}),
    "DeepseekV2ForCausalLM": Architecture("kvserve.model.deepseek:DeepseekV2Model", gguf="deepseek2", adapter=FAMILIES,
                                          experts=True,
                                          note="multi-head latent attention"),
    "DeepseekV3ForCausalLM": Architecture("kvserve.model.deepseek:DeepseekV2Model", adapter=FAMILIES, experts=True,
                                          note="multi-head latent attention, sigmoid router; GGUF `deepseek2` with expert_gating_func 2"),
}


def register_architecture(name: str, arch: Architecture) -> None:
    """Add (or replace) an architecture: `name` as config.json's `architectures` lists it."""
    ARCHITECTURES[name] = arch


def find_architecture(names: list[str]) -> str | None:
    """The first of config.json's `architectures` that kvserve runs, or None."""
    return next((a for a in names if a in ARCHITECTURES), None)


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {name!r}; kvserve runs {', '.join(ARCHITECTURES)}.")
    return ARCHITECTURES[name]


def gguf_architecture(gguf_name: str, experts: bool = False) -> str | None:
    """The registered architecture whose GGUF files say `general.architecture = gguf_name`, with
    experts or without (llama.cpp's `llama` is Llama or, with `llama.expert_count`, Mixtral)."""
    return next((n for n, a in ARCHITECTURES.items() if a.gguf == gguf_name and a.experts == experts), None)


def architectures_line() -> str:
    """The README's list of architectures, from ARCHITECTURES (tests/model/test_registry.py
    checks the README holds it, and prints it when not)."""
    def one(name, a):
        notes = ([f"GGUF `{a.gguf}`"] if a.gguf else []) + (["experts"] if a.experts else []) + (
            [a.note] if a.note else [])
        return f"`{name}`" + (f" ({', '.join(notes)})" if notes else "")
    return "Architectures: " + ", ".join(one(n, a) for n, a in ARCHITECTURES.items()) + "."
