"""Greedy decoding with `transformers` as the reference kvserve must equal token for token."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def load_hf(model_dir: str, gguf_file: str | None = None):
    """transformers' model for an HF directory, or for `gguf_file` inside it (dequantized)."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int,
              gguf_file: str | None = None) -> tuple[list[int], list[float]]:
    """(greedy tokens, their log-probabilities) from full forward passes (no cache tricks)."""
    model = load_hf(str(model_dir), gguf_file)
    ids = torch.tensor([prompt_ids])
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        logits = model(ids).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return tokens, logprobs
