"""The grouped MoE block (kvserve/model/moe.py) against a dense reference that runs every expert
on every token and weights each by the router."""
import torch
import torch.nn.functional as F

from kvserve.model.moe import experts_forward, route, shared_expert_forward


def _dense(h, gate, gate_up, down, top_k, renormalize):
    probs = torch.softmax(h @ gate.T, dim=-1)                          # [T, E]
    top = torch.topk(probs, top_k, dim=-1)
    mask = torch.zeros_like(probs).scatter(1, top.indices, 1.0)
    w = probs * mask
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    outs = []
    for e in range(gate.shape[0]):                                     # every expert, every token
        g, u = (h @ gate_up[e].T).chunk(2, dim=-1)
        outs.append((F.silu(g) * u) @ down[e].T)
    return (torch.stack(outs, 1) * w[..., None]).sum(1)               # [T, hidden]


def test_grouped_experts_match_dense_reference():
    torch.manual_seed(0)
    T, hidden, inter, E, k = 37, 16, 24, 8, 2
    h = torch.randn(T, hidden)
    gate = torch.randn(E, hidden)
    gate_up, down = torch.randn(E, 2 * inter, hidden) * 0.3, torch.randn(E, hidden, inter) * 0.3
    for renorm in (True, False):
        w, ids = route(h, gate, k, renorm)
        got = experts_forward(h, w, ids, gate_up, down)
        torch.testing.assert_close(got, _dense(h, gate, gate_up, down, k, renorm), rtol=1e-5, atol=1e-5)


def test_single_token_touches_only_its_experts():
    torch.manual_seed(1)
    E, hidden, inter = 6, 8, 12
    h = torch.randn(1, hidden)
    w, ids = route(h, torch.randn(E, hidden), 2, True)
    gate_up, down = torch.randn(E, 2 * inter, hidden), torch.randn(E, hidden, inter)
    unused = [e for e in range(E) if e not in ids[0].tolist()]
    gate_up[unused] = float("nan")                                      # an unused expert read would show
    assert torch.isfinite(experts_forward(h, w, ids, gate_up, down)).all()


def test_shared_expert_sigmoid_gate():
    torch.manual_seed(2)
    h, gu, dn, sg = torch.randn(5, 8), torch.randn(20, 8), torch.randn(8, 10), torch.randn(1, 8)
    g, u = (h @ gu.T).chunk(2, -1)
    ref = torch.sigmoid(h @ sg.T) * ((F.silu(g) * u) @ dn.T)
    torch.testing.assert_close(shared_expert_forward(h, gu, dn, sg), ref)
