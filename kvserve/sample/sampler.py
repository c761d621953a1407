"""Turn one step's logits into one token per sampling sequence (seed 000, "Prefill and decode").

Order, as in vLLM v0 and transformers' generate: vLLM's vocabulary masks first (allowed_token_ids,
bad_words: -inf), OpenAI's logit_bias added, penalties (repetition on prompt + output,
presence and frequency on output), min_tokens masking of stop tokens, then greedy argmax, or
temperature, top-k, top-p, min-p, typical-p (transformers' warper order) and a draw. (vLLM v1 applies min-p before top-k/top-p; the two
orders differ when top-p and min-p are combined.) `process_logits` / `processed_logprobs` give
the distribution each row is chosen from. Each seeded request draws from its own generator, so
its tokens do not depend on what else is in the batch. Logprobs are those of the raw model
distribution (log_softmax of the unprocessed logits), with the sampled token's rank. A
constrained row (structured outputs) comes in already masked by its grammar (sample/grammar_mask.py):
its "raw" distribution is the model's renormalised over the tokens the grammar allows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from kvserve import kernels
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.params import Sampled  # noqa: F401 (the sampler's record of a position)

if TYPE_CHECKING:
    from kvserve.engine.request import Request


def process_logits(logits: torch.Tensor, reqs: Sequence[Request], meta: SamplingMetadata | None = None
                   ) -> torch.Tensor:
    """The logits each row's token is chosen from, [S, V], one row per request in `reqs`.

    Every row: logit_bias added, penalties, then -inf on stop tokens while min_tokens is not reached. A sampled
    row then also gets temperature, top-k, top-p and min-p (-inf where filtered out): its token
    is drawn from softmax of the row. A greedy row's token is the row's argmax. `logits` is
    never written to; when no row changes it is returned as is. `meta`: the rows' parameters as
    arrays (the worker's SamplingTable gathers them); built from `reqs` when not given.
    """
    if meta is None:
        meta = SamplingMetadata.build([r.params for r in reqs], logits.shape[1], logits.device)
    short = [i for i in meta.min_tokens_rows if reqs[i].num_output_tokens < reqs[i].params.min_tokens]
    rows = meta.random_rows
    # copied only where rows are written in place: masks, biases, penalties, min_tokens, or sampled
    # rows written back beside greedy ones (the filters below make new tensors of their own)
    edits = meta.vocab_rows or meta.bias_rows or meta.penalty_rows or short
    x = logits.clone() if edits or (rows and len(rows) != logits.shape[0]) else logits
    _apply_vocabulary_masks(x, reqs, meta.vocab_rows)
    _apply_logit_bias(x, reqs, meta.bias_rows)
    _apply_penalties(x, reqs, meta.penalty_rows)
    _mask_early_stops(x, reqs, short)
    if rows:
        if len(rows) == x.shape[0]:
            idx, sub = None, x
        else:
            idx = torch.tensor(rows, device=x.device)
            sub = x[idx]
        temperature = meta.temperature[rows]
        if not bool((temperature == 1.0).all()):        # (at 1 a pass over [R, V] saved)
            sub = sub / temperature.unsqueeze(1)
        sub = apply_top_k_top_p_min_p(sub, meta.top_k[rows], meta.top_p[rows], meta.min_p[rows], meta.vocab_size)
        typical = meta.typical_p[rows]
        wanted = (typical < 1.0).nonzero().squeeze(1)
        if len(wanted):
            sub = sub.clone() if sub is logits else sub    # never written: the caller's logits
            sub[wanted] = apply_typical_p(sub[wanted], typical[wanted])
        if idx is None:
            x = sub
        else:
            x[idx] = sub
    return x


def apply_typical_p(x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022; transformers' TypicalLogitsWarper,
    llama.cpp's typ_p): keep the tokens whose surprisal -log p is closest to the entropy, in
    that order, until their mass reaches the row's `mass` (at least one token). x [R, V], mass [R]."""
    logp = torch.log_softmax(x, dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nansum(dim=-1, keepdim=True)          # -inf * 0: nan, left out
    shifted = (-logp - entropy).abs()
    sorted_shift, order = shifted.sort(dim=-1)
    cum = probs.gather(1, order).cumsum(dim=-1)
    m = mass.to(cum.dtype).unsqueeze(1)
    last = (cum < m).sum(dim=1).clamp_(max=x.shape[1] - 1)            # the token that reaches the mass
    drop = sorted_shift > sorted_shift.gather(1, last.unsqueeze(1))
    drop[:, 0] = False
    return x.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def processed_logprobs(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """log_softmax of `process_logits`, [S, V]: for a sampled row, the log-probabilities of the
    distribution its token is drawn from (-inf for the tokens it can not draw); for a greedy row,
    those of the penalised, masked distribution whose argmax it takes."""
    return torch.log_softmax(process_logits(logits, reqs), dim=-1)


def apply_top_k_top_p_min_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                             vocab_size: int) -> torch.Tensor:
    """x [R, V] temperature-scaled logits; top_k [R] (vocab_size: off), top_p [R], min_p [R]
    (SamplingMetadata's): top-k, then top-p on the renormalised survivors, then min-p; filtered
    tokens become -inf. A row whose top_p is 1 (off) loses no token to top-p, whatever the other
    rows ask."""
    V = x.shape[1]
    if bool((top_k < vocab_size).any()) or bool((top_p < 1.0).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)       # [R, V]
        rank = torch.arange(V, device=x.device).unsqueeze(0)    # [1, V]
        k = top_k.unsqueeze(1)
        drop = rank >= k
        sorted_probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs     # mass of higher-ranked tokens
        p = top_p.unsqueeze(1)
        # keeps at least the top token (a top_p below float32's smallest value rounds to 0);
        # rows with top_p == 1 are exempt, as rounding can push `before` of tail tokens to 1.0
        drop |= (before >= p) & (p < 1.0) & (rank > 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        mp = min_p.unsqueeze(1)
        x = x.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return x


def _apply_vocabulary_masks(logits: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
    """In place: -inf on every token outside allowed_token_ids, and on each bad word's last token
    where the output ends with the tokens before it (vLLM's rule; a one-token word always). A
    row left with no token raises ValueError (its sequence fails alone: worker/sampling.py).
    `rows`: the rows with allowed_token_ids or bad words."""
    for i in rows:
        r = reqs[i]
        p = r.params
        row = logits[i]
        if p.allowed_token_ids is not None:
            keep = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)] = True
            row.masked_fill_(~keep, float("-inf"))
        out = list(r.output_token_ids) if p.bad_words_token_ids else []
        banned = [seq[-1] for seq in p.bad_words_token_ids or ()
                  if len(seq) - 1 <= len(out) and out[len(out) - len(seq) + 1:] == seq[:-1]]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
        if bool(torch.isneginf(row).all()):
            raise ValueError("allowed_token_ids and bad_words leave no token to sample")


def _apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
    """In place: each of `rows`' logit_bias added to its tokens' logits (ids < V: verify_for_model)."""
    for i in rows:
        bias = reqs[i].params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
    """In place, on `rows` (those with a penalty): repetition penalty on every token of prompt +
    output (divide a positive logit, multiply a negative one), then logit -= frequency_penalty *
    count + presence_penalty * (count > 0) over the output tokens."""
    V = logits.shape[1]
    for i in rows:
        r, p = reqs[i], reqs[i].params
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=V)[:V].to(logits.dtype)          # [V]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(r.token_ids, dtype=torch.long, device=logits.device)] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        row -= p.frequency_penalty * counts
        row -= p.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_early_stops(logits: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
    """In place: -inf on the stop token ids (and EOS unless ignored) of `rows`, the requests that
    have fewer than min_tokens output tokens. Ids outside the vocabulary can never be sampled, so
    they need no mask and are skipped. A complete grammar, or allowed_token_ids / bad_words, that
    leave only stop tokens win over min_tokens (a constrained row is never left with no token)."""
    V = logits.shape[1]
    for i in rows:
        r = reqs[i]
        p = r.params
        stops = list(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            stops.append(r.eos_token_id)
        stops = [t for t in stops if 0 <= t < V]
        if stops:
            kept = logits[i, stops].clone()
            logits[i, stops] = float("-inf")
            masked = getattr(r, "grammar", None) is not None or p.masks_vocabulary
            if masked and bool(torch.isneginf(logits[i]).all()):    # only stops were left
                logits[i, stops] = kept


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """Raw-distribution logprobs of `tokens` [S] under `logits` [S, V]: (logprob per row,
    rank per row (1 = most likely), top-k ids per row, top-k logprobs per row), as lists."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)              # [S, V]
    chosen = logprobs.gather(1, tokens.unsqueeze(1))                  # [S, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1                        # [S]
    k = min(k, logprobs.shape[1])
    if k:
        top_lp, top_ids = logprobs.topk(k, dim=1)                     # [S, k]
        top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
    else:
        top_ids = top_lp = [[] for _ in range(logits.shape[0])]
    return chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_lp


def request_generator(r: Request, device: torch.device) -> torch.Generator:
    """A seeded request's own generator, made on first use from its seed: its draws do not
    depend on the rest of the batch (speculative verification draws from it too)."""
    if r.generator is None:
        r.generator = torch.Generator(device=device)
        # params allow seed + n - 1 <= 2**64 - 1; the modulo keeps any other int
        # (torch takes [-2**63, 2**64 - 1] and maps negatives the same way) from raising
        r.generator.manual_seed(int(r.seed) % 2**64)
    return r.generator


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else torch.seed() % (2**63))

    def __call__(self, logits: torch.Tensor, reqs: list[Request], meta: SamplingMetadata | None = None
                 ) -> list[Sampled]:
        """logits [S, V] float32, one row per request in `reqs`; `meta` their parameters as
        arrays (built from `reqs` when not given)."""
        if meta is None:
            meta = SamplingMetadata.build([r.params for r in reqs], logits.shape[1], logits.device)
        raw = logits
        tokens = self._choose(process_logits(logits, reqs, meta), reqs, meta)   # [S] int64
        k = int(meta.logprobs.max()) if len(meta.logprobs) else -1
        if k < 0:                                    # no row asked for logprobs
            return [Sampled(t, 0.0, 0) for t in tokens.tolist()]
        lp_l, rank_l, top_ids, top_lp = token_logprobs(raw, tokens, k)
        results = []
        for i, (n, t) in enumerate(zip(meta.logprobs.tolist(), tokens.tolist())):
            top = None
            if n > 0:                 # (a grammar's forbidden tokens, at -inf, are left out)
                top = [(t, lp) for t, lp in zip(top_ids[i][:n], top_lp[i][:n]) if lp != float("-inf")]
            results.append(Sampled(t, lp_l[i], rank_l[i], top))
        return results

    def _choose(self, x: torch.Tensor, reqs: list[Request], meta: SamplingMetadata) -> torch.Tensor:
        """x: `process_logits` of the step. Greedy rows take the argmax, sampled rows a draw."""
        rows = meta.random_rows
        if not rows:
            return greedy(x)                                         # [S]
        gens = [request_generator(reqs[i], x.device) if reqs[i].seed is not None else None for i in rows]
        u = uniforms(gens, self.generator, x.dtype, x.device)        # [R, 1]
        if x.dtype == torch.float32 and kernels.available(x.device):
            # the same inverse CDF in one op over the rows in place (csrc/sampling.h): at 64 rows
            # of a 49,152-token vocabulary, softmax + cumsum wrote 25 MB a step
            sampled = torch.ops.kvserve.draw_rows(x, torch.tensor(rows, device=x.device), u.squeeze(1))
        else:
            sampled = draw_at(torch.softmax(x[rows], dim=-1), u)    # [R]
        if len(rows) == x.shape[0]:
            return sampled
        out = greedy(x)
        out[torch.tensor(rows, device=x.device)] = sampled
        return out


def greedy(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] -> each row's argmax [S] (the first largest; a NaN the largest): kvserve's op on
    float32 CPU rows (0.84 against torch's 2.15 ms at 64 rows of 49,152, 2 threads), else torch's."""
    if (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and (x.stride(1) == 1 or x.shape[1] == 1)
            and kernels.available(x.device)):
        return torch.ops.kvserve.argmax_rows(x)
    return x.argmax(dim=-1)


def uniforms(gens: list, default: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    """u ~ U[0, 1) [R, 1], one per row: from the row's own generator (`gens[j]`, a seeded
    request's) or, for rows whose entry is None, from `default`."""
    u = torch.empty(len(gens), 1, dtype=dtype, device=device)
    unseeded = [j for j, g in enumerate(gens) if g is None]
    for j, g in enumerate(gens):
        if g is not None:
            u[j].uniform_(generator=g)
    if unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), 1, generator=default,
                                                             dtype=dtype, device=device)
    return u


def draw(probs: torch.Tensor, gens: list, default: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [R, V], at a uniform from each row's generator (`uniforms`)."""
    return draw_at(probs, uniforms(gens, default, probs.dtype, probs.device))


def draw_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [R, V] by inverse CDF at u [R, 1]: the first token whose
    cumulative probability passes u times the row's total. One uniform a token, not one random
    number per vocabulary entry (an exponential race over a 49,152-token vocabulary cost 13.5 ms
    a step at 16 rows, this 0.5 ms). A token of probability 0 is never drawn: the cumulative sum
    only rises at tokens of positive probability (and the rare u that rounds onto the total takes
    the row's most likely token). csrc/sampling.h's `draw_row` is the same rule on logits."""
    V = probs.shape[1]
    cdf = probs.cumsum(dim=-1)                                        # [R, V]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)   # [R]
    return torch.where(tokens < V, tokens, probs.argmax(dim=-1))


def beam_candidates(row: torch.Tensor, width: int) -> tuple[list[int], list[float]]:
    """A beam's top 2 * width (token ids, raw logprobs), best first."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top_lp, top_ids = lp.topk(min(2 * width, lp.shape[-1]))
    return top_ids.tolist(), top_lp.tolist()


@torch.inference_mode()
def prompt_entries(req, first: int, logits: torch.Tensor) -> list[Sampled]:
    """The entries of prompt tokens first + 1 .. first + r from `logits` [r, V], the raw rows
    at positions first .. first + r - 1: the token's logprob (log_softmax, the raw model
    distribution, like the sampler's) and rank, and the top `prompt_logprobs` tokens."""
    r = logits.shape[0]
    targets = req.prompt_token_ids[first + 1:first + 1 + r]
    chosen, ranks, top_ids, top_lps = token_logprobs(
        logits, torch.tensor(targets, dtype=torch.long, device=logits.device), req.params.prompt_logprobs)
    return [Sampled(tid, c, rank, list(zip(ids, lps)))
            for tid, c, rank, ids, lps in zip(targets, chosen, ranks, top_ids, top_lps)]
