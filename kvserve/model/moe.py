"""The mixture-of-experts feed-forward block in pure torch: a top-k softmax router and SwiGLU
experts run grouped by expert (index_select of each active expert's tokens, one matmul per
active expert, index_add of the weighted outputs back), so a decode step touches only the
experts its tokens chose. The router follows transformers' Mixtral / Qwen2-MoE / Qwen3-MoE /
OLMoE: softmax in float32 over all experts, top-k, optional renormalisation of the k weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden], gate [E, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(F.linear(h, gate).float(), dim=-1)          # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)                   # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """h [T, hidden], weights/ids [T, k], gate_up [E, 2I, hidden] (gate rows first), down
    [E, hidden, I] -> sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) [T, hidden]."""
    T, k = ids.shape
    out = torch.zeros_like(h)                                         # [T, hidden]
    flat = ids.reshape(-1)                                            # [T * k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // k                                             # [T * k] token of each slot
    w_sorted = weights.reshape(-1)[order]                             # [T * k]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]                              # [n]
        x = h.index_select(0, rows)                                   # [n, hidden]
        g, u = F.linear(x, gate_up[e]).chunk(2, dim=-1)               # [n, I] each
        y = F.linear(F.silu(g) * u, down[e])                          # [n, hidden]
        out.index_add_(0, rows, y * w_sorted[start:start + n, None].to(y.dtype))
        start += n
    return out


def shared_expert_forward(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          sigmoid_gate: torch.Tensor | None) -> torch.Tensor:
    """Qwen2-MoE's always-on expert: h [T, hidden] -> sigmoid(h @ gate^T) * SwiGLU(h) [T, hidden]."""
    g, u = F.linear(h, gate_up).chunk(2, dim=-1)
    y = F.linear(F.silu(g) * u, down)
    return y if sigmoid_gate is None else torch.sigmoid(F.linear(h, sigmoid_gate)) * y
