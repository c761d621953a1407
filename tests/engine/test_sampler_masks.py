"""vLLM's allowed_token_ids and bad_words, and locally typical sampling (typical_p), in the sampler.

typical_p's kept set is compared with transformers' TypicalLogitsWarper on random logits (float64
there, kvserve's float32 here: rows where a token sits within MARGIN of the cut are skipped);
bad_words follow vLLM's rule (the last token banned where the output ends with the others).
"""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TypicalLogitsWarper

from kvserve.sample.params import SamplingParams
from kvserve.sample.sampler import Sampler, process_logits
from kvserve.worker.request_state import SequenceState

V = 256
EOS = 2
MARGIN = 1e-4


def state(params: SamplingParams, output=(), i: int = 0) -> SequenceState:
    return SequenceState(f"r{i}", [5, 6, 7, *output], 3, params, None, EOS)


def logits(seed: int, rows: int = 1, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def _typical_margin(row: torch.Tensor, mass: float) -> float:
    """How close the cumulative mass (in typical order) comes to `mass` around the cut."""
    logp = torch.log_softmax(row.double(), dim=-1)
    p = logp.exp()
    ent = -(logp * p).sum()
    order = (-logp - ent).abs().argsort()
    cum = p[order].cumsum(0)
    return (cum - mass).abs().min().item()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mass,temperature", [(0.2, 1.0), (0.5, 0.7), (0.9, 1.3), (0.95, 1.0)])
def test_typical_p_keeps_transformers_token_set(seed, mass, temperature):
    row = logits(seed)
    scaled = row[0].double() / temperature
    if _typical_margin(scaled, mass) < MARGIN:
        pytest.skip("a token sits on the cut")
    ids = torch.tensor([[5, 6, 7]])
    ref = TypicalLogitsWarper(mass=mass)(ids, TemperatureLogitsWarper(temperature)(ids, row.double()))
    got = process_logits(row, [state(SamplingParams(temperature=temperature, typical_p=mass))])
    kept_ref, kept = torch.isfinite(ref[0]), torch.isfinite(got[0])
    assert torch.equal(kept, kept_ref)
    assert 1 <= int(kept.sum()) < V          # the cut matters
    assert torch.allclose(got[0][kept].double(), scaled[kept], atol=1e-5)


def test_typical_p_rows_are_independent_and_one_is_off():
    x = logits(3, rows=3)
    params = [SamplingParams(temperature=1.0, typical_p=0.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, typical_p=0.9)]
    got = process_logits(x, [state(p, i=i) for i, p in enumerate(params)])
    assert torch.isfinite(got[1]).all()
    for i in (0, 2):
        alone = process_logits(x[i:i + 1], [state(params[i])])
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(alone[0]))
    assert int(torch.isfinite(got[0]).sum()) < int(torch.isfinite(got[2]).sum())


def test_allowed_token_ids_mask_every_other_token_and_greedy_takes_the_best_allowed():
    x = logits(1)
    order = x[0].argsort(descending=True).tolist()
    allowed = [order[10], order[3], order[50]]
    p = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    got = process_logits(x, [state(p)])[0]
    assert set(torch.isfinite(got).nonzero().flatten().tolist()) == set(allowed)
    out = Sampler(V, torch.device("cpu"), seed=0)(x, [state(p)])
    assert out[0].token_id == order[3]
    drawn = {Sampler(V, torch.device("cpu"), seed=s)(x, [state(SamplingParams(temperature=1.0,
             allowed_token_ids=allowed))])[0].token_id for s in range(20)}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_greedy_rows_without_masks_are_untouched():
    x = logits(2, rows=2)
    got = process_logits(x, [state(SamplingParams(temperature=0.0), i=0), state(SamplingParams(temperature=0.0), i=1)])
    assert got is x


def _bad(words_ids: list[list[int]], **kw) -> SamplingParams:
    p = SamplingParams(temperature=0.0, bad_words=["w"], **kw)
    p.bad_words_token_ids = words_ids          # what update_from_tokenizer makes of the words
    return p


def test_bad_words_ban_the_last_token_only_after_the_prefix():
    x = logits(4)
    p = _bad([[9], [20, 21, 22]])
    free = process_logits(x, [state(p, output=[1, 20])])[0]
    assert torch.isneginf(free[9]) and torch.isfinite(free[22]) and int(torch.isneginf(free).sum()) == 1
    after = process_logits(x, [state(p, output=[1, 20, 21])])[0]
    assert torch.isneginf(after[22]) and torch.isneginf(after[9]) and int(torch.isneginf(after).sum()) == 2
    short = process_logits(x, [state(p, output=[21])])[0]       # fewer output tokens than the prefix
    assert torch.isfinite(short[22])


def test_bad_words_steer_greedy_away():
    x = logits(5)
    best = int(x[0].argmax())
    assert Sampler(V, torch.device("cpu"), seed=0)(x, [state(_bad([[best]]))])[0].token_id != best


def test_masks_that_leave_nothing_raise_and_stops_win_over_min_tokens():
    x = logits(6)
    p = _bad([[40]], allowed_token_ids=[40])
    with pytest.raises(ValueError, match="no token"):
        process_logits(x, [state(p)])
    only_eos = SamplingParams(temperature=0.0, allowed_token_ids=[EOS], min_tokens=3)
    got = process_logits(x, [state(only_eos)])[0]
    assert torch.isfinite(got[EOS])


class _Tok:
    """A tokenizer whose words are one token each, a leading space another id."""
    vocab = {"foo": 10, " foo": 11, "foo bar": 12, " foo bar": 13}

    def encode(self, text, add_special_tokens=True):
        if text in ("hello world", " hello world"):
            return [30, 31] if text[0] != " " else [32, 31]
        if text == " one":
            return [40, 41]           # a different length: not a second form (vLLM's rule)
        if text == "one":
            return [42]
        return [self.vocab[text]]


def test_update_from_tokenizer_takes_both_forms_as_vllm():
    p = SamplingParams(bad_words=["foo", "  hello world", "one"])
    p.update_from_tokenizer(_Tok())
    assert p.bad_words_token_ids == [[10], [11], [30, 31], [32, 31], [42]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        p.verify_for_model(31)
    with pytest.raises(ValueError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)


@pytest.mark.parametrize("bad", [dict(typical_p=0.0), dict(typical_p=1.5), dict(allowed_token_ids=[]),
                                 dict(allowed_token_ids=[-1]), dict(bad_words=[""]), dict(bad_words="x"),
                                 dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2),
                                 dict(length_penalty=0.5),
                                 dict(use_beam_search=True, n=2, typical_p=0.5),
                                 dict(use_beam_search=True, n=2, allowed_token_ids=[1]),
                                 dict(use_beam_search=True, n=2, bad_words=["x"])])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_allowed_ids_are_checked_against_the_vocabulary():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 300]).verify_for_model(V)
    SamplingParams(allowed_token_ids=[3, 255]).verify_for_model(V)
