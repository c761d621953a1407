"""The mixture-of-experts feed-forward block in pure torch: a top-k softmax router and SwiGLU
experts run grouped by expert (index_select of each active expert's tokens, one matmul per
active expert, index_add of the weighted outputs back), so a decode step touches only the
experts its tokens chose. The router follows transformers' Mixtral / Qwen2-MoE / Qwen3-MoE /
OLMoE: softmax in float32 over all experts, top-k, optional renormalisation of the k weights.

An expert's weights are indexed by expert: a 3-D tensor, or a list of per-expert linear weights
(tensors or quant/formats.py QuantizedWeights). `expert_layout` and `check_expert_tensors` read
how a checkpoint names them (kvserve/model/moe_models.py builds the model from them)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from kvserve.model.quant.formats import linear

# An MoE layer's MLP prefix (after model.layers.N.): transformers' names, Mixtral's older one.
MLP_PREFIXES = ("mlp.", "block_sparse_moe.")
# Per-expert checkpoint names: experts.{e}.<part>.weight, gate / up / down (Mixtral: w1 / w3 / w2).
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
                "w2": "down"}
# Fused checkpoint names (transformers' in-memory layout): experts.gate_up_proj [E, 2I, hidden]
# (gate rows first) and experts.down_proj [E, hidden, I].
FUSED = ("experts.gate_up_proj", "experts.down_proj")
_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")


def route(h: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool, scale: float = 1.0,
          groups: tuple[int, int] | None = None, scoring: str = "softmax", bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden], gate [E, hidden] -> (weights [T, k] float32, expert ids [T, k] int64).
    DeepSeek: `groups` (n_group, topk_group) keeps the experts of the topk_group best groups (V2's
    "group_limited_greedy" scores a group by its best expert; V3, `scoring` "sigmoid", by its best
    two), `scale` (routed_scaling_factor) multiplies the weights. V3 chooses the top k of
    sigmoid(logits) + `bias` (e_score_correction_bias [E]) and weights them by the sigmoid alone."""
    logits = F.linear(h, gate).float()                                # [T, E]
    T, E = logits.shape
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.float()
        if groups is not None:
            n_group, topk_group = groups
            best = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)        # [T, n_group]
            keep = torch.zeros_like(best).scatter_(1, torch.topk(best, topk_group, dim=-1).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(E // n_group, dim=1), float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1).indices               # [T, k]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scale, ids
    probs = torch.softmax(logits, dim=-1)                             # [T, E]
    if groups is not None:
        n_group, topk_group = groups
        best = probs.view(T, n_group, E // n_group).amax(dim=-1)       # [T, n_group]
        keep = torch.zeros_like(best).scatter_(1, torch.topk(best, topk_group, dim=-1).indices, 1.0)
        probs = probs.masked_fill(~keep.bool().repeat_interleave(E // n_group, dim=1), 0.0)
    weights, ids = torch.topk(probs, top_k, dim=-1)                   # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scale if scale != 1.0 else weights), ids


def experts_forward(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down) -> torch.Tensor:
    """h [T, hidden], weights/ids [T, k], gate_up [E, 2I, hidden] (gate rows first), down
    [E, hidden, I] (or lists of E linear weights) -> sum_k weights[t, k] * expert_{ids[t, k]}(h[t])
    [T, hidden]."""
    T, k = ids.shape
    out = torch.zeros_like(h)                                         # [T, hidden]
    flat = ids.reshape(-1)                                            # [T * k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    token_of = order // k                                             # [T * k] token of each slot
    w_sorted = weights.reshape(-1)[order]                             # [T * k]
    start = 0
    for e, n in enumerate(counts):
        if n == 0 or gate_up[e] is None:          # (None: another rank's expert, expert parallelism)
            start += n
            continue
        rows = token_of[start:start + n]                              # [n]
        x = h.index_select(0, rows)                                   # [n, hidden]
        g, u = linear(x, gate_up[e]).chunk(2, dim=-1)                 # [n, I] each
        y = linear(F.silu(g) * u, down[e])                            # [n, hidden]
        out.index_add_(0, rows, y * w_sorted[start:start + n, None].to(y.dtype))
        start += n
    return out


def shared_expert_prefix(cfg) -> str:
    """Where a layer's always-on expert sits after its MLP prefix: Qwen2-MoE's gated
    shared_expert., DeepSeek-V2's ungated shared_experts. (n_shared_experts of them as one)."""
    return "shared_expert." if cfg.shared_expert_gated else "shared_experts."


def shared_expert_forward(h: torch.Tensor, gate_up, down, sigmoid_gate: torch.Tensor | None) -> torch.Tensor:
    """The always-on expert: h [T, hidden] -> sigmoid(h @ gate^T) * SwiGLU(h) [T, hidden]
    (Qwen2-MoE), or SwiGLU(h) without a gate (DeepSeek-V2); gate_up, down: linear weights,
    tensors or QuantizedWeights."""
    g, u = linear(h, gate_up).chunk(2, dim=-1)
    y = linear(F.silu(g) * u, down)
    return y if sigmoid_gate is None else torch.sigmoid(F.linear(h, sigmoid_gate)) * y


def held_experts(shapes, m: str) -> set[int]:
    """The experts whose per-expert tensors are under MLP prefix `m` (under expert parallelism a
    rank holds only its own: model/sharding.py)."""
    return {int(x.group(1)) for name in shapes if name.startswith(m)
            and (x := _EXPERT.match(name[len(m):])) is not None and x.group(2) in EXPERT_PARTS}


def expert_layout(shapes: dict[str, tuple], layer: str) -> tuple[str, str, int]:
    """How a checkpoint stores layer `layer`'s experts ("model.layers.N."), from its tensor names
    and shapes: (MLP prefix, "per_expert" or "fused", the number of experts it holds). A layer
    without a router gives ("", "", 0); one with a router but no expert tensors, (prefix, "", 0)."""
    for mlp in MLP_PREFIXES:
        p = layer + mlp
        if p + "gate.weight" not in shapes:
            continue
        if p + FUSED[0] in shapes and p + FUSED[1] in shapes:
            return mlp, "fused", shapes[p + FUSED[0]][0]
        ids = set()
        for name in shapes:
            m = _EXPERT.match(name[len(p):]) if name.startswith(p) else None
            if m is not None and m.group(2) in EXPERT_PARTS:
                ids.add(int(m.group(1)))
        return mlp, "per_expert" if ids else "", max(ids) + 1 if ids else 0
    return "", "", 0


def check_expert_tensors(cfg, shapes: dict[str, tuple]) -> None:
    """ValueError unless every MoE layer of `cfg` (a ModelConfig) has a router of num_experts rows
    and all num_experts experts' gate, up and down weights, of width moe_intermediate_size (or
    intermediate_size), in the checkpoint (`shapes`: name -> shape), a shared expert where the
    config gives it a width, and num_experts_per_tok is between 1 and num_experts."""
    E, H = cfg.num_experts, cfg.hidden_size
    I = cfg.moe_intermediate_size or cfg.intermediate_size
    field = f"config.json's num_experts (Mixtral: num_local_experts) is {E}"
    if not 1 <= cfg.num_experts_per_tok <= E:
        raise ValueError(f"config.json's num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 "
                         f"and num_experts={E}.")
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        layer = f"model.layers.{i}."
        mlp, kind, held = expert_layout(shapes, layer)
        if not mlp:
            raise ValueError(f"the checkpoint has no router {layer}mlp.gate.weight for MoE layer {i} "
                             f"({field}): not a checkpoint of this config.")
        m = layer + mlp
        if not kind:
            raise ValueError(f"the checkpoint lacks the expert tensors of MoE layer {i} ({m}experts.*; {field}).")
        router = shapes[m + "gate.weight"][0]
        if held != E or router != E:
            raise ValueError(f"the checkpoint holds {held} experts and a router of {router} in layer {i} "
                             f"({m}experts.*), but {field}.")
        if kind == "fused":
            want = {m + FUSED[0]: (E, 2 * I, H), m + FUSED[1]: (E, H, I)}
        else:
            want = {}
            for e in range(E):
                base = f"{m}experts.{e}."
                have = {role: base + part + ".weight" for part, role in EXPERT_PARTS.items()
                        if base + part + ".weight" in shapes}
                if len(have) != 3:
                    raise ValueError(f"expert {e} of layer {i} ({base}*) lacks its "
                                     f"{', '.join(sorted({'gate', 'up', 'down'} - set(have)))} weight ({field}).")
                want.update({have["gate"]: (I, H), have["up"]: (I, H), have["down"]: (H, I)})
        if cfg.shared_expert_intermediate_size:
            s, S = m + shared_expert_prefix(cfg), cfg.shared_expert_intermediate_size
            want.update({s + "gate_proj.weight": (S, H), s + "up_proj.weight": (S, H),
                         s + "down_proj.weight": (H, S)})
            if cfg.shared_expert_gated:
                want[m + "shared_expert_gate.weight"] = (1, H)
        for name, shape in want.items():
            if shapes.get(name) != shape:
                got = "it is missing" if name not in shapes else f"it is {list(shapes[name])}"
                raise ValueError(f"{name} should be {list(shape)} (hidden_size {H}, moe_intermediate_size "
                                 f"or intermediate_size {I}, shared_expert_intermediate_size "
                                 f"{cfg.shared_expert_intermediate_size}, num_experts {E}); {got}.")
