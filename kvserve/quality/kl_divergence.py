"""KL divergence between two runs of `kvserve perplexity`, in the spirit of llama-perplexity's
`--kl-divergence-base` / `--kl-divergence`: how far a model (quantized, another dtype, another
engine setting) moves the next-token distributions of a base run on the same tokens.

Run 1 (`Recorder`) keeps, for every scored token, the base distribution P as log-probabilities
(log_softmax of the raw logits): the whole vocabulary, or the top k and the mass of the rest,
and saves them with the chunks' tokens in one .npz file. Run 2 (`Comparison`) scores the same
chunks and, row by row as the engine returns them, computes

    KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))

over the whole vocabulary, or over the k + 1 outcomes "each of P's top k, or anything else"
(a lower bound of the full KL), and whether P and Q put the same token first. A full-vocabulary
file takes chunks x (ctx/2) x vocab x 4 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class _Rows:
    """Rows come per chunk in pieces (chunked prefill), at positions pos .. pos + r - 1; the
    scored ones are positions first .. ctx - 2, row i of a chunk's arrays being position first + i."""

    def __init__(self, first: int):
        self.first = first

    def scored(self, pos: int, logits: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(row of the first scored position here, its log-probs [r', V] float32), or None."""
        skip = max(0, self.first - pos)
        if skip >= logits.shape[0]:
            return None
        return pos + skip - self.first, torch.log_softmax(logits[skip:].float(), dim=-1)


class Recorder(_Rows):
    """Run 1: the base distributions of every scored token, whole or top k."""

    def __init__(self, chunks: list[list[int]], first: int, top_k: int = 0):
        super().__init__(first)
        if top_k < 0:
            raise ValueError(f"--kl-top-k must be >= 0, got {top_k}.")
        self.tokens = np.asarray(chunks, dtype=np.int64)                  # [C, ctx]
        self.top_k = top_k
        self.n = self.tokens.shape[1] - 1 - first                          # scored per chunk
        self.nll = np.zeros((len(self.tokens), self.n))                 # [C, n] base NLL
        self.lp: np.ndarray | None = None      # [C, n, V or k] log-probs
        self.ids: np.ndarray | None = None     # [C, n, k] their token ids (top k only)

    def __call__(self, chunk: int, pos: int, logits: torch.Tensor) -> None:
        got = self.scored(pos, logits)
        if got is None:
            return
        at, lp = got
        r = lp.shape[0]
        targets = torch.from_numpy(self.tokens[chunk, self.first + 1 + at:self.first + 1 + at + r])
        self.nll[chunk, at:at + r] = -lp.gather(1, targets.to(lp.device).unsqueeze(1)).squeeze(1).cpu().numpy()
        if self.top_k:
            lp, ids = lp.topk(min(self.top_k, lp.shape[-1]), dim=-1)
            if self.ids is None:
                self.ids = np.zeros((len(self.tokens), self.n, ids.shape[-1]), dtype=np.int64)
            self.ids[chunk, at:at + r] = ids.cpu().numpy()
        if self.lp is None:
            self.lp = np.zeros((len(self.tokens), self.n, lp.shape[-1]), dtype=np.float32)
        self.lp[chunk, at:at + r] = lp.cpu().numpy()

    def save(self, path: str) -> None:
        arrays = {"tokens": self.tokens, "first": np.int64(self.first), "lp": self.lp, "nll": self.nll}
        if self.ids is not None:
            arrays["ids"] = self.ids
        with open(path, "wb") as f:
            np.savez(f, **arrays)


@dataclass
class Base:
    tokens: np.ndarray          # [C, ctx]
    first: int
    lp: np.ndarray              # [C, n, V] or [C, n, k]
    ids: np.ndarray | None      # [C, n, k] for a top-k file
    nll: np.ndarray             # [C, n] the base run's NLL of each scored token

    @property
    def ctx(self) -> int:
        return int(self.tokens.shape[1])

    def chunks(self, num_chunks: int = -1) -> list[list[int]]:
        n = len(self.tokens) if num_chunks < 0 else min(num_chunks, len(self.tokens))
        return self.tokens[:n].tolist()


def load_base(path: str) -> Base:
    with np.load(path) as z:
        return Base(z["tokens"], int(z["first"]), z["lp"], z["ids"] if "ids" in z else None, z["nll"])


@dataclass
class KLResult:
    kl: np.ndarray              # per scored token, nats
    same_top: np.ndarray        # per scored token: P and Q agree on the most likely token
    base_nll: float             # the base run's mean NLL over the same tokens
    top_k: int                  # 0: whole vocabulary

    def report(self) -> str:
        n, kl, same = len(self.kl), self.kl, self.same_top.mean()
        err = kl.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
        same_err = np.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0
        over = "the whole vocabulary" if not self.top_k else f"the base's top {self.top_k} + the rest"
        return (f"KL divergence over {over}, {n} tokens (base PPL {np.exp(self.base_nll):.4f}):\n"
                f"  mean KLD   {kl.mean():.6f} +/- {err:.6f}\n"
                f"  median     {np.median(kl):.6f}\n"
                f"  99%        {np.percentile(kl, 99):.6f}\n"
                f"  max        {kl.max():.6f}\n"
                f"  same top token: {100 * same:.3f} +/- {100 * same_err:.3f} %")


class Comparison(_Rows):
    """Run 2: KL(base || this run) and top-token agreement, computed as rows arrive."""

    def __init__(self, base: Base, num_chunks: int, first: int):
        super().__init__(first)
        if first != base.first:
            raise ValueError(f"the base file scores from position {base.first}, this run from {first}.")
        self.base = base
        shape = (num_chunks, base.lp.shape[1])
        self.kl = np.full(shape, np.nan)
        self.same = np.zeros(shape, dtype=bool)

    def __call__(self, chunk: int, pos: int, logits: torch.Tensor) -> None:
        got = self.scored(pos, logits)
        if got is None:
            return
        at, q = got
        q = q.cpu().numpy().astype(np.float64)                       # [r, V]
        p = self.base.lp[chunk, at:at + len(q)].astype(np.float64)   # [r, V] or [r, k]
        if self.base.ids is None:
            if p.shape[-1] != q.shape[-1]:
                raise ValueError(f"the base file has {p.shape[-1]} tokens per row, this model {q.shape[-1]}.")
            kl = (np.exp(p) * (p - q)).sum(-1)
            top = p.argmax(-1)
        else:
            ids = self.base.ids[chunk, at:at + len(q)]
            qk = np.take_along_axis(q, ids, axis=-1)                 # [r, k]
            p_rest = np.clip(1 - np.exp(p).sum(-1), 0, 1)
            q_rest = np.clip(1 - np.exp(qk).sum(-1), 1e-30, 1)
            rest = np.where(p_rest > 0, p_rest * (np.log(np.maximum(p_rest, 1e-30)) - np.log(q_rest)), 0.0)
            kl = (np.exp(p) * (p - qk)).sum(-1) + rest
            top = ids[:, 0]
        self.kl[chunk, at:at + len(q)] = kl
        self.same[chunk, at:at + len(q)] = top == q.argmax(-1)

    def summary(self) -> KLResult:
        if np.isnan(self.kl).any():
            raise RuntimeError("some scored tokens never came back from the engine.")
        base_nll = float(self.base.nll[:len(self.kl)].mean())
        return KLResult(self.kl.ravel(), self.same.ravel(), base_nll,
                        0 if self.base.ids is None else self.base.ids.shape[-1])
