"""kvserve's draw from logits (torch.ops.kvserve.draw_rows, csrc/sampling.h) against the sampler's
torch rule (sample/sampler.py `draw_at`: inverse CDF over softmax) on every ISA allowed here:
the same token for the same uniform, -inf tokens never drawn even at the uniform's ends, rows
picked out of a bigger batch in place, bad input refused; greedy rows' argmax
(torch.ops.kvserve.argmax_rows) equal to torch.argmax with ties, NaN and -inf; and the Sampler's
tokens equal with and without the kernels."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sample import sampler as sampler_mod
from kvserve.sample.params import SamplingParams
from kvserve.sample.sampler import Sampler, draw_at
from tests.kernels.isa import ISA_BITS, needs_kernels, on_isa

pytestmark = needs_kernels


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), R=st.integers(1, 9), V=st.integers(1, 3000),
       spread=st.sampled_from([0.1, 3.0, 30.0]), masked=st.sampled_from([0, 2, 7]))
def test_the_kernel_draws_the_torch_rules_token(bits, seed, R, V, spread, masked):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * spread
    if masked:
        x[:, ::masked] = float("-inf")
        x[:, -1] = 0.0                                   # every row keeps a token
    u = torch.rand(R, generator=g)
    with on_isa(bits):
        got = torch.ops.kvserve.draw_rows(x, torch.arange(R), u)
    want = draw_at(torch.softmax(x, dim=-1), u.unsqueeze(1))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("bits", ISA_BITS)
def test_minus_inf_is_never_drawn_at_the_uniforms_ends(bits):
    V = 1000
    x = torch.full((3, V), float("-inf"))
    x[:, 10] = x[:, 500] = x[:, 990] = 1.0
    x[1, 10] = -80.0                                     # far below the rest, still drawable
    with on_isa(bits):
        for u in (0.0, 1.0 - 2 ** -24, 1.0):
            got = torch.ops.kvserve.draw_rows(x, torch.arange(3), torch.full((3,), u)).tolist()
            assert set(got) <= {10, 500, 990}
        assert torch.ops.kvserve.draw_rows(x, torch.arange(3), torch.zeros(3)).tolist() == [10, 10, 10]


@pytest.mark.parametrize("bits", ISA_BITS)
def test_listed_rows_are_read_in_place(bits):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1400, generator=g)[:, :700]       # contiguous rows, a row stride of 1,400
    rows, u = torch.tensor([4, 1, 4]), torch.rand(3, generator=g)
    with on_isa(bits):
        got = torch.ops.kvserve.draw_rows(x, rows, u)
    assert got.tolist() == draw_at(torch.softmax(x[rows], dim=-1), u.unsqueeze(1)).tolist()


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), S=st.integers(0, 9), V=st.integers(1, 3000), levels=st.sampled_from([0, 3, 50]),
       nan=st.booleans(), masked=st.sampled_from([0, 1, 3]))
def test_argmax_rows_is_torchs_argmax(bits, seed, S, V, levels, nan, masked):
    """Ties (values drawn from a few levels: the first largest wins), NaN (the first NaN wins),
    rows all -inf (index 0), a row stride past V."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, V + 5, generator=g)[:, :V]
    if levels:
        x = torch.round(x * levels / 3) / levels
    if masked and S:
        x[::2, ::masked] = float("-inf")
    if nan and S and V > 1:
        x[S // 2, torch.randint(0, V, (2,), generator=g)] = float("nan")
    with on_isa(bits):
        got = torch.ops.kvserve.argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_bad_input_is_refused():
    x = torch.randn(4, 100)
    with pytest.raises(RuntimeError, match="outside 0..3"):
        torch.ops.kvserve.draw_rows(x, torch.tensor([0, 4]), torch.rand(2))
    with pytest.raises(RuntimeError, match="float32 logits"):
        torch.ops.kvserve.draw_rows(x.double(), torch.tensor([0]), torch.rand(1))
    with pytest.raises(RuntimeError, match="float32 logits"):
        torch.ops.kvserve.draw_rows(x.t(), torch.tensor([0]), torch.rand(1))
    with pytest.raises(RuntimeError, match="rows \\[R\\] int64"):
        torch.ops.kvserve.draw_rows(x, torch.tensor([0, 1]), torch.rand(3))
    with pytest.raises(RuntimeError, match="argmax_rows takes float32"):
        torch.ops.kvserve.argmax_rows(x.t())


class _Req:
    def __init__(self, params, seed=None):
        self.params, self.seed, self.generator = params, seed, None
        self.num_output_tokens, self.output_token_ids, self.prompt_token_ids = 0, [], [1]


def test_the_sampler_draws_the_same_tokens_without_the_kernels(monkeypatch):
    """Seeded rows beside greedy ones: the kernel's path and the torch path give the same tokens."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 4096, generator=g) * 4

    def tokens():
        reqs = [_Req(SamplingParams(temperature=t, seed=s), s)
                for t, s in ((0.7, 1), (0.0, None), (1.0, 2), (1.3, 3), (0.0, None))]
        return [s.token_id for s in Sampler(4096, torch.device("cpu"), seed=0)(logits, reqs)]
    with_kernels = tokens()
    monkeypatch.setattr(sampler_mod.kernels, "available", lambda device="cpu": False)
    assert tokens() == with_kernels
