"""The sampler's arithmetic against independent implementations, on random logits.

Reference: transformers' logits processors and warpers (RepetitionPenaltyLogitsProcessor,
MinNewTokensLengthLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
MinPLogitsWarper), one row at a time in float64, and for presence/frequency penalties OpenAI's
definition written out by hand (transformers has none):

    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

with count over the generated tokens only (as vLLM), while the repetition penalty covers prompt
and output. The order is the one kvserve documents, which is transformers' and vLLM v0's:
penalties, min_tokens masking, temperature, top-k, top-p, min-p. (vLLM v1 applies min-p before
top-k/top-p; `test_min_p_applies_after_top_p` pins the documented order down.)

kvserve's side is `processed_logprobs`, the seam the Sampler draws from. Each filtering row is
checked to be non-degenerate (it keeps more than one token and drops some) and clear of its cuts:
no token lies within MARGIN of a top-k, top-p or min-p boundary, so float32 rounding cannot
decide membership, and the comparison of kept sets is exact.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from kvserve.worker.request_state import SequenceState
from kvserve.sample.params import SamplingParams
from kvserve.sample.sampler import Sampler, process_logits, processed_logprobs

V = 512
EOS = 2
MARGIN = 1e-5       # no token may sit closer than this to a cut (logit, mass or probability ratio)
PROB_TOL = 1e-5


def make_logits(seed: int, rows: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * scale


def make_request(i: int, params: SamplingParams, prompt: list[int], output: list[int],
                 seed: int | None = None) -> SequenceState:
    return SequenceState(f"r{i}", prompt + output, len(prompt), params, seed, EOS)   # the worker's copy


def reference(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
              min_p_first: bool = False) -> tuple[torch.Tensor, float]:
    """(probabilities [V] float64, the smallest distance of any token to a cut it went through).
    `min_p_first` swaps min-p before top-k/top-p (vLLM v1's order), for the order test."""
    ids = torch.tensor([prompt + output])
    s = row.double().unsqueeze(0)
    if p.repetition_penalty != 1.0:
        s = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(ids, s)
    for tok, count in Counter(output).items():
        s[0, tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.min_tokens:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])
        s = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops)(ids, s)
    margin = float("inf")
    if p.greedy:
        return torch.softmax(s, dim=-1)[0], margin

    def min_p(s):
        nonlocal margin
        probs = torch.softmax(s, dim=-1)[0]
        ratio = probs / probs.max()
        margin = min(margin, (ratio[torch.isfinite(s[0])] - p.min_p).abs().min().item())
        return MinPLogitsWarper(min_p=p.min_p)(ids, s)

    s = TemperatureLogitsWarper(temperature=float(p.temperature))(ids, s)
    if p.min_p > 0 and min_p_first:
        s = min_p(s)
    if 0 < p.top_k < V:
        top = s[0].sort(descending=True).values
        margin = min(margin, (top[p.top_k - 1] - top[p.top_k]).item())
        s = TopKLogitsWarper(top_k=p.top_k)(ids, s)
    if p.top_p < 1.0:
        probs = torch.softmax(s, dim=-1)[0].sort(descending=True).values
        before = probs.cumsum(0) - probs
        margin = min(margin, (before[probs > 0] - p.top_p).abs().min().item())
        s = TopPLogitsWarper(top_p=p.top_p)(ids, s)
    if p.min_p > 0 and not min_p_first:
        s = min_p(s)
    return torch.softmax(s, dim=-1)[0], margin


def history(row: torch.Tensor) -> tuple[list[int], list[int]]:
    """A prompt and an output that repeat tokens the penalties matter for: the row's best tokens
    (so that penalties move top-k/top-p/min-p cuts) and a few negative-logit ones (the repetition
    penalty's other branch)."""
    order = row.argsort(descending=True).tolist()
    prompt = [order[1], order[4], order[-1], order[-3], order[4], 7]
    output = [order[0], order[0], order[0], order[2], order[2], order[9], order[-2]]
    return prompt, output


def batch_rows() -> list[tuple[SamplingParams, bool]]:
    """(params, whether the row gets a history with repeats). Different parameters per row."""
    SP = SamplingParams
    return [
        (SP(temperature=0.7), False),
        (SP(temperature=1.3, top_k=50), False),
        (SP(temperature=1.0, top_k=5), False),
        (SP(temperature=1.0, top_p=0.9), False),
        (SP(temperature=0.7, top_p=0.7), False),
        (SP(temperature=1.3, min_p=0.05), False),
        (SP(temperature=0.7, min_p=0.2), False),
        (SP(temperature=0.7, top_k=50, top_p=0.7), False),
        (SP(temperature=1.3, top_p=0.9, min_p=0.05), False),
        (SP(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05), False),
        (SP(temperature=1.0, top_k=2000), False),                 # top_k above the vocabulary
        (SP(temperature=1.0, repetition_penalty=1.5, top_p=0.9), True),
        (SP(temperature=0.7, repetition_penalty=0.8, top_k=50), True),
        (SP(temperature=1.3, frequency_penalty=0.8, presence_penalty=0.5, top_k=50), True),
        (SP(temperature=1.0, frequency_penalty=-0.5, presence_penalty=1.5, min_p=0.05), True),
        (SP(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6,
            top_k=50, top_p=0.9, min_p=0.05), True),
        (SP(temperature=1.0, min_tokens=10, stop_token_ids=[11, 12], top_p=0.9), True),
        (SP(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5), True),
        (SP(temperature=0.0, min_tokens=10, stop_token_ids=[3]), True),
    ]


def build_batch(seed: int, scale: float = 1.5):
    rows = batch_rows()
    logits = make_logits(seed, len(rows), scale)
    reqs, hist = [], []
    for i, (params, repeats) in enumerate(rows):
        prompt, output = history(logits[i]) if repeats else ([5, 6, 7], [8, 9])
        if params.min_tokens:       # the masked ids must matter: make them the row's best tokens
            best = logits[i].argsort(descending=True).tolist()
            params.stop_token_ids = [best[0], best[3]]
            logits[i, EOS] = logits[i].max() + 1.0
        reqs.append(make_request(i, params, prompt, output))
        hist.append((prompt, output))
    return logits, reqs, hist


# (seed, logit scale): flat (1.0) and peakier (1.5) distributions
BATCHES = [(0, 1.0), (1, 1.0), (1, 1.5), (2, 1.5), (3, 1.5)]


@pytest.mark.parametrize("seed,scale", BATCHES)
def test_processed_distribution_matches_transformers(seed, scale):
    logits, reqs, hist = build_batch(seed, scale)
    before = logits.clone()
    ours = processed_logprobs(logits, reqs).exp().double()          # [S, V]
    assert torch.equal(logits, before), "processing must not write into the logits"
    for i, (r, (prompt, output)) in enumerate(zip(reqs, hist)):
        p = r.params
        ref, margin = reference(logits[i], p, prompt, output)
        what = (f"row {i} (T={p.temperature}, top_k={p.top_k}, top_p={p.top_p}, min_p={p.min_p}, "
                f"rep={p.repetition_penalty}, freq={p.frequency_penalty}, pres={p.presence_penalty}, "
                f"min_tokens={p.min_tokens})")
        assert margin > MARGIN, f"{what}: a token lies within {margin:.2g} of a cut; pick another seed"
        kept, ref_kept = ours[i] > 0, ref > 0
        if (0 < p.top_k < V or p.top_p < 1 or p.min_p) and not p.greedy:
            assert 1 < int(ref_kept.sum()) < V, f"{what}: degenerate filter"
        assert torch.equal(kept, ref_kept), (
            f"{what}: kept sets differ: only kvserve {(kept & ~ref_kept).nonzero().flatten().tolist()}, "
            f"only reference {(ref_kept & ~kept).nonzero().flatten().tolist()}")
        assert (ours[i] - ref).abs().max().item() < PROB_TOL, what


@pytest.mark.parametrize("seed,scale", BATCHES)
def test_penalties_and_masks_are_not_vacuous(seed, scale):
    """The histories and stop ids of `build_batch` do change the distribution, so the comparison
    above exercises them."""
    logits, reqs, hist = build_batch(seed, scale)
    for i, (r, (prompt, output)) in enumerate(zip(reqs, hist)):
        p = r.params
        if not (p.uses_penalties or p.min_tokens):
            continue
        plain = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        with_pen = reference(logits[i], p, prompt, output)[0]
        without = reference(logits[i], plain, prompt, output)[0]
        both = (with_pen > 0) & (without > 0)
        moved = (with_pen[both].log() - without[both].log()).abs().max().item()
        assert moved > 0.1 or not torch.equal(with_pen > 0, without > 0), f"row {i}: penalties change nothing"
        if p.greedy:
            assert with_pen.argmax() != without.argmax(), f"row {i}: greedy pick unchanged"


@pytest.mark.parametrize("seed,scale", BATCHES + [(0, 3.0), (1, 3.0)])
def test_each_row_is_processed_as_if_alone(seed, scale):
    """A row's distribution does not depend on its batch-mates' parameters. (Before the fix a
    top_p=1 row lost its tail tokens whenever another row used top-k or top-p.)"""
    logits, reqs, _ = build_batch(seed, scale)
    together = process_logits(logits, reqs)
    for i, r in enumerate(reqs):
        alone = process_logits(logits[i:i + 1], [r])[0]
        assert torch.equal(torch.isinf(together[i]), torch.isinf(alone)), f"row {i}"
        assert torch.allclose(together[i], alone, atol=1e-6, rtol=0), f"row {i}"


def test_top_p_off_keeps_every_token_next_to_a_filtering_row():
    """Regression: with top_p=1 a row keeps its whole tail (transformers applies no top-p
    warper then), even when a batch-mate's top-k/top-p makes the sampler sort the batch. The
    cumulative mass used to round to >= 1.0 on peaked rows and drop tail tokens."""
    logits = make_logits(0, 3, scale=3.0)
    reqs = [make_request(0, SamplingParams(temperature=1.0), [5], []),
            make_request(1, SamplingParams(temperature=1.0, top_p=0.9), [5], []),
            make_request(2, SamplingParams(temperature=1.0, top_k=5), [5], [])]
    probs = processed_logprobs(logits, reqs).exp()
    assert int((probs[0] > 0).sum()) == V
    assert (probs[0].double() - torch.softmax(logits[0].double(), -1)).abs().max().item() < PROB_TOL


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    logits, reqs, hist = build_batch(3)
    results = Sampler(V, torch.device("cpu"), seed=0)(logits.clone(), reqs)
    for i, (r, (prompt, output)) in enumerate(zip(reqs, hist)):
        if r.params.greedy:
            assert results[i].token_id == int(reference(logits[i], r.params, prompt, output)[0].argmax())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.5),
    SamplingParams(temperature=0.7, top_k=5),
])
def test_sampler_draws_follow_the_processed_distribution(params):
    """The Sampler draws from what `processed_logprobs` gives: N unseeded draws of one request's
    row never leave the kept set and match its probabilities within 5 standard deviations."""
    N = 4000
    row = make_logits(11, 1)[0]
    prompt, output = history(row)
    reqs = [make_request(i, params, prompt, output) for i in range(N)]
    logits = row.expand(N, V).contiguous()
    probs = processed_logprobs(logits[:1], reqs[:1]).exp()[0].double()
    tokens = torch.tensor([res.token_id for res in Sampler(V, torch.device("cpu"), seed=5)(logits, reqs)])
    freq = torch.bincount(tokens, minlength=V).double() / N
    assert bool((probs[tokens] > 0).all()), "drew a filtered-out token"
    sd = (probs * (1 - probs) / N).sqrt()
    assert bool(((freq - probs).abs() <= 5 * sd + 1e-3).all())


def test_min_p_applies_after_top_p():
    """kvserve's documented order (top-k, top-p, then min-p, as transformers and vLLM v0) against
    vLLM v1's (min-p first): on this row the two keep different sets, and kvserve keeps the first."""
    p = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05)
    row = make_logits(0, 1)[0]
    req = make_request(0, p, [5], [])
    ours = processed_logprobs(row.unsqueeze(0), [req]).exp()[0] > 0
    documented, m1 = reference(row, p, [5], [])
    v1_order, m2 = reference(row, p, [5], [], min_p_first=True)
    assert min(m1, m2) > MARGIN
    assert not torch.equal(documented > 0, v1_order > 0), "this row does not tell the orders apart"
    assert torch.equal(ours, documented > 0)


def test_logprobs_are_raw_model_logprobs_with_ranks():
    """Sampled.logprob / rank / top (logprobs=k) come from log_softmax of the unprocessed
    logits, whatever penalties and filters chose the token (as vLLM's default)."""
    SP = SamplingParams
    params = [
        SP(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, logprobs=5),   # pick is not raw top 1
        SP(temperature=1.3, top_k=5, repetition_penalty=1.5, logprobs=20, seed=7),
        SP(temperature=0.7, top_p=0.9, logprobs=0, seed=8),
        SP(temperature=1.0, logprobs=None, seed=9),
        SP(temperature=1.0, min_p=0.2, logprobs=1, seed=10),
        SP(temperature=0.0, logprobs=3),
    ]
    logits = make_logits(21, len(params))
    reqs = []
    for i, p in enumerate(params):
        prompt, output = history(logits[i])
        reqs.append(make_request(i, p, prompt, output, seed=p.seed))
    results = Sampler(V, torch.device("cpu"), seed=0)(logits.clone(), reqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    processed = processed_logprobs(logits, reqs).double()
    for i, (p, res) in enumerate(zip(params, results)):
        tok = res.token_id
        assert processed[i, tok] > float("-inf")
        assert res.logprob == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert res.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        if not p.logprobs:
            assert res.top is None
            continue
        top_lp, top_ids = ref[i].topk(p.logprobs)
        assert [t for t, _ in res.top] == top_ids.tolist()
        assert [lp for _, lp in res.top] == pytest.approx(top_lp.tolist(), abs=1e-5)
    assert results[0].rank > 1, "the penalised greedy row should not pick the raw argmax"
    raw_best = results[0].top[0][0]              # the raw argmax, penalised out of first place
    assert results[0].top[0][1] == pytest.approx(ref[0, raw_best].item(), abs=1e-5)
    assert processed[0, raw_best] < ref[0, raw_best] - 1.0, "raw and processed should differ here"
    assert results[5].rank == 1 and results[5].top[0][0] == results[5].token_id


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=1.0, typical_p=0.9), SamplingParams(temperature=1.0)],   # every row samples at 1
    [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.0)],
    [SamplingParams(temperature=0.7, min_p=0.1)] * 2])
def test_the_callers_logits_are_never_written(params):
    """process_logits may return the logits themselves (nothing to change at temperature 1), but
    never writes into them: typical-p, top-k and min-p work on copies."""
    logits = make_logits(3, len(params))
    before = logits.clone()
    reqs = [make_request(i, p, [1, 5], [7]) for i, p in enumerate(params)]
    process_logits(logits, reqs)
    Sampler(V, torch.device("cpu"), seed=0)(logits, reqs)
    assert torch.equal(logits, before)
