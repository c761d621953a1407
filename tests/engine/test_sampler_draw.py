"""The sampler's draw (sample/sampler.py `draw`: one uniform a token, inverse CDF): the frequencies
of many draws match the distribution, a token of probability 0 is never drawn (even at the
uniform's ends), and a seeded row's draws depend on its own generator only."""
from __future__ import annotations

import torch

from kvserve.sample.sampler import draw

V = 64


def test_frequencies_match_the_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, V, generator=g) * 2, dim=-1)
    probs[0, ::3] = 0.0                                        # a third of the tokens impossible
    probs /= probs.sum()
    n = 200_000
    counts = torch.bincount(draw(probs.expand(n, V), [None] * n, g), minlength=V).double()
    assert counts[::3].sum() == 0
    expected = probs[0].double() * n
    live = expected > 0
    # each count within 5 standard deviations of its expectation
    sd = (expected * (1 - probs[0].double())).sqrt()
    assert ((counts - expected).abs()[live] <= 5 * sd[live] + 1).all()


def test_zero_probability_tokens_are_never_drawn_at_the_uniforms_ends(monkeypatch):
    probs = torch.zeros(2, V)
    probs[:, 10] = probs[:, 20] = 0.5
    for u in (0.0, 1.0 - 2 ** -24, 1.0):                      # 1.0 itself: a rounding that reaches the total
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[:2], u))
        got = draw(probs, [None, None], torch.Generator()).tolist()
        assert set(got) <= {10, 20}


def test_a_seeded_row_depends_on_its_own_generator_only():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(3, V, generator=g), dim=-1)
    alone = draw(probs[1:2], [torch.Generator().manual_seed(7)], torch.Generator().manual_seed(0))
    batched = draw(probs, [None, torch.Generator().manual_seed(7), None], torch.Generator().manual_seed(99))
    assert alone[0] == batched[1]
