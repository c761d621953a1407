"""Greedy decoding with `transformers` as the reference kvserve must equal token for token."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """(greedy tokens, their log-probabilities) from full forward passes (no cache tricks)."""
    model = load_hf(str(model_dir))
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
