"""Verification of drafts against the target's logits (seed 004: "the output is the same as the
large model alone would produce").

For a sequence with drafts d_1..d_k the target ran its last token and the k drafts in one pass:
row i of its logits [k + 1, V] is the target's distribution for the token after d_i (row 0:
after the last verified token). Each row is processed as the sampler would process it at that
point (penalties and min_tokens see the drafts before it as output: `_Ahead`), then:

- greedy: accept the longest prefix of drafts equal to the rows' argmax, then take the argmax
  of the first row not accepted (the correction, or the bonus token when all k are accepted);
- sampled: rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Our proposers' draft
  distribution is a point mass q = delta(d_i), so d_i is kept with probability
  min(1, p(d_i) / q(d_i)) = p(d_i); the first rejected position draws from the residual
  norm(max(0, p - q)) = p without d_i, and when all are kept a bonus token is drawn from row k.
  The emitted tokens are then distributed exactly as the target's own samples. Draws come from
  the request's own generator (`request_generator`: seeded by `SamplingParams.seed`) or the
  engine's: k uniforms, then one inverse-CDF draw over V (sampler.draw), on every verification.

Logprobs of emitted tokens are those of the raw target rows, as the sampler reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.sampler import Sampled, draw, process_logits, request_generator, token_logprobs


class _Ahead:
    """A request as it will be once `extra` more tokens are output: what process_logits reads."""

    __slots__ = ("req", "extra", "params", "eos_token_id")

    def __init__(self, req, extra: list[int]):
        self.req, self.extra = req, extra
        self.params, self.eos_token_id = req.params, req.eos_token_id

    @property
    def token_ids(self) -> list[int]:
        return self.req.token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.extra)


@dataclass
class Verified:
    tokens: list[int]              # accepted drafts + one target token: what the sequence emits
    num_accepted: int              # drafts accepted
    logprobs: list[Sampled] | None = None   # per emitted token, when the request asks for logprobs

    @property
    def run(self) -> list[Sampled]:
        return self.logprobs if self.logprobs is not None else [Sampled(t) for t in self.tokens]


def accept_greedy(target: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """target: the argmax of each of the k + 1 rows. Longest equal prefix, plus one."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]], a


def rejection_sample(probs: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    """probs [k + 1, V]: the target's distributions; drafts: k tokens from a point-mass proposal."""
    k = len(drafts)
    a = k
    if k:
        d = torch.tensor(drafts, device=probs.device)
        u = torch.rand(k, generator=gen, device=probs.device)                  # [k]
        p_d = probs[:k].gather(1, d.unsqueeze(1)).squeeze(1)                   # [k]
        rejected = (u >= p_d).tolist()
        a = rejected.index(True) if True in rejected else k
    row = probs[a].clone()                                                     # [V]
    if a < k:
        row[drafts[a]] = 0.0          # the residual max(0, p - q), unnormalised
    return drafts[:a] + [int(draw(row.unsqueeze(0), [gen], gen)[0])], a


def verify(logits: torch.Tensor, reqs: list, drafts: list[list[int]], engine_gen: torch.Generator
           ) -> list[Verified]:
    """logits [sum(k_i + 1), V]: each request's k_i + 1 rows, in order. One Verified per request."""
    views, starts = [], []
    for r, d in zip(reqs, drafts):
        starts.append(len(views))
        views += [_Ahead(r, d[:i]) for i in range(len(d) + 1)]
    x = process_logits(logits, views)                                          # [R, V]
    greedy_rows = x.argmax(dim=-1).tolist() if any(r.params.greedy for r in reqs) else None
    out = []
    for r, d, s in zip(reqs, drafts, starts):
        rows = slice(s, s + len(d) + 1)
        if r.params.greedy:
            tokens, a = accept_greedy(greedy_rows[rows], d)
        else:
            gen = request_generator(r, x.device) if r.seed is not None else engine_gen
            tokens, a = rejection_sample(torch.softmax(x[rows], dim=-1), d, gen)
        out.append(Verified(tokens, a))
    _logprobs(logits, reqs, starts, out)
    return out


def _logprobs(logits, reqs, starts, out: list[Verified]) -> None:
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not want:
        return
    rows = [starts[i] + j for i in want for j in range(len(out[i].tokens))]
    toks = torch.tensor([t for i in want for t in out[i].tokens], device=logits.device)
    k = max(reqs[i].params.logprobs for i in want)
    lp, rank, top_ids, top_lp = token_logprobs(logits[rows], toks, k)
    at = 0
    for i in want:
        n, entries = reqs[i].params.logprobs, []
        for t in out[i].tokens:
            top = list(zip(top_ids[at][:n], top_lp[at][:n])) if n else None
            entries.append(Sampled(t, lp[at], rank[at], top))
            at += 1
        out[i].logprobs = entries
