"""Sampling parameters behave as documented, on the real stories260K model."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES_HF), max_num_seqs=8)


def gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    alone = gen(llm, "Once upon a time", **p)
    again = gen(llm, "Once upon a time", **p)
    assert alone.token_ids == again.token_ids
    crowd = llm.generate(["The dog", "Once upon a time", "Lily was", "Tom"],
                         [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
                          SamplingParams(**p),
                          SamplingParams(temperature=0.7, seed=5, max_tokens=30),
                          SamplingParams(temperature=0.0, max_tokens=30)])
    assert crowd[1].outputs[0].token_ids == alone.token_ids
    other = gen(llm, "Once upon a time", **{**p, "seed": 99})
    assert other.token_ids != alone.token_ids


def test_temperature_zero_is_greedy_and_top_k_1_too(llm):
    greedy = gen(llm, "The cat", temperature=0.0, max_tokens=20)
    top1 = gen(llm, "The cat", temperature=1.3, top_k=1, seed=3, max_tokens=20)
    assert greedy.token_ids == top1.token_ids


def test_top_p_and_min_p_restrict_choices(llm):
    # With a tiny top_p (or min_p near 1) only the most likely token survives: greedy again.
    greedy = gen(llm, "The cat", temperature=0.0, max_tokens=15)
    assert gen(llm, "The cat", temperature=1.0, top_p=1e-6, seed=1, max_tokens=15).token_ids == greedy.token_ids
    assert gen(llm, "The cat", temperature=1.0, min_p=0.999, seed=1, max_tokens=15).token_ids == greedy.token_ids


def test_max_and_min_tokens(llm):
    out = gen(llm, "Once upon a time", temperature=0.0, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # From BOS the greedy story ends by emitting BOS (id 1), as run.c expects; min_tokens
    # masks that stop token until enough tokens exist.
    free = gen(llm, {"prompt_token_ids": [1]}, temperature=0.0, max_tokens=400, stop_token_ids=[1])
    assert free.finish_reason == "stop" and free.token_ids[-1] == 1
    longer = gen(llm, {"prompt_token_ids": [1]}, temperature=0.0, max_tokens=400, stop_token_ids=[1],
                 min_tokens=len(free.token_ids) + 5)
    assert len(longer.token_ids) >= len(free.token_ids) + 5
    assert 1 not in longer.token_ids[:len(free.token_ids) + 4]


def test_eos_stops_unless_ignore_eos(llm):
    # Find where greedy would go, then make one of its tokens the EOS id of this engine.
    greedy = gen(llm, "Once upon a time", temperature=0.0, max_tokens=20)
    eng = llm.engine.core
    saved = eng.eos_token_id
    eng.eos_token_id = greedy.token_ids[3]
    try:
        stopped = gen(llm, "Once upon a time", temperature=0.0, max_tokens=20)
        forced = gen(llm, "Once upon a time", temperature=0.0, max_tokens=20, ignore_eos=True)
    finally:
        eng.eos_token_id = saved
    assert stopped.token_ids == greedy.token_ids[:4] and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None
    assert forced.token_ids == greedy.token_ids and forced.finish_reason == "length"


def test_stop_token_ids(llm):
    greedy = gen(llm, "Once upon a time", temperature=0.0, max_tokens=30)
    stop_tok = greedy.token_ids[5]
    out = gen(llm, "Once upon a time", temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok])
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_stop_strings_are_cut_and_excluded(llm):
    greedy = gen(llm, "Once upon a time", temperature=0.0, max_tokens=40)
    assert "Lily" in greedy.text
    out = gen(llm, "Once upon a time", temperature=0.0, max_tokens=40, stop=["Lily"])
    assert out.text == greedy.text[:greedy.text.index("Lily")]
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    kept = gen(llm, "Once upon a time", temperature=0.0, max_tokens=40, stop="Lily",
               include_stop_str_in_output=True)
    assert kept.text.endswith("Lily")


def test_streamed_text_never_retracts_with_stop_strings(llm):
    eng = llm.engine
    eng.add_request("s", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=40, stop=[" named L"]))
    seen = ""
    while eng.has_unfinished_requests():
        for out in eng.step():
            text = out.outputs[0].text
            assert text.startswith(seen)
            seen = text
    assert seen.endswith("girl") and "named" not in seen


def test_penalties_change_repetition(llm):
    base = gen(llm, "The", temperature=0.0, max_tokens=60, ignore_eos=True)
    pen = gen(llm, "The", temperature=0.0, max_tokens=60, ignore_eos=True, frequency_penalty=1.5,
              presence_penalty=1.0)
    rep = gen(llm, "The", temperature=0.0, max_tokens=60, ignore_eos=True, repetition_penalty=1.8)
    distinct = lambda ids: len(set(ids))
    assert distinct(pen.token_ids) > distinct(base.token_ids)
    assert distinct(rep.token_ids) > distinct(base.token_ids)


def test_logprobs_top_k_and_rank(llm):
    out = gen(llm, "Once upon a time", temperature=0.0, max_tokens=5, logprobs=3)
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1 and len(entry) == 3
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert entry[tok].logprob == values[0]
        assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_n_samples_equal_separately_seeded_requests(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    out = llm.generate(["Tom"], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        single = gen(llm, "Tom", temperature=1.0, seed=7 + i, max_tokens=20, ignore_eos=True)
        assert c.token_ids == single.token_ids


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-3),
                                 dict(min_p=2), dict(max_tokens=0), dict(n=0), dict(min_tokens=5, max_tokens=2),
                                 dict(logprobs=-1), dict(stop=[""]), dict(presence_penalty=3),
                                 dict(repetition_penalty=0)])
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# -- server hardening, defect 1: values that used to pass validation and then crash the step ----

NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    # top_k: an int64 at use; bools and fractions are not counts
    (dict(top_k=2**63), "top_k"), (dict(top_k=2**70), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(top_k=-2), "top_k"),
    # seed: sample i uses seed + i, which torch.Generator must take
    (dict(seed=2**64), "seed"), (dict(seed=2**64 - 1, n=2), "seed"), (dict(seed=2**64 - 3, n=4), "seed"),
    (dict(seed=-2), "seed"), (dict(seed=-(2**63)), "seed"), (dict(seed=True), "seed"), (dict(seed=1.0), "seed"),
    # bools where integers are expected
    (dict(n=True), "n must"), (dict(max_tokens=True), "max_tokens"), (dict(min_tokens=True), "min_tokens"),
    (dict(logprobs=True), "logprobs"),
    # NaN / inf / out of range in every float field
    *[(dict([(name, v)]), name) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                             "frequency_penalty", "repetition_penalty", "length_penalty")
      for v in (NAN, INF, -INF)],
    (dict(temperature=101.0), "temperature"), (dict(temperature=1e39), "temperature"),
    (dict(temperature=True), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(repetition_penalty=1e-3), "repetition_penalty"),
    (dict(repetition_penalty=100.5), "repetition_penalty"), (dict(repetition_penalty=10**400), "repetition_penalty"),
    (dict(length_penalty=11.0), "length_penalty"), (dict(length_penalty=-11.0), "length_penalty"),
    # lists and counts
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=list(range(1025))), "stop_token_ids"), (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop=5), "stop"),
]


@pytest.mark.parametrize("bad,field", BAD_VALUES, ids=[repr(b)[:40] for b, _ in BAD_VALUES])
def test_bad_values_raise_a_clear_value_error(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


@pytest.mark.parametrize("ok", [dict(top_k=2**63 - 1), dict(top_k=10**6), dict(seed=2**64 - 1),
                                dict(seed=2**64 - 2, n=2), dict(seed=0), dict(temperature=100.0),
                                dict(repetition_penalty=0.01), dict(repetition_penalty=100.0),
                                dict(length_penalty=-10.0, use_beam_search=True), dict(logprobs=20),
                                dict(stop_token_ids=list(range(1024))), dict(temperature=0)])
def test_boundary_values_are_accepted(ok):
    SamplingParams(**ok)


def test_minus_one_disables_top_k_and_seed_as_in_vllm():
    p = SamplingParams(top_k=-1, seed=-1)
    assert p.top_k == 0 and p.seed is None


def test_seed_message_states_the_rule():
    with pytest.raises(ValueError) as e:
        SamplingParams(seed=2**64 - 1, n=3)
    assert "[0, 2**64 - n]" in str(e.value) and str(2**64 - 3) in str(e.value)


def test_verify_for_model_checks_ids_against_the_vocabulary():
    SamplingParams(stop_token_ids=[0, 511], top_k=10**6).verify_for_model(512)   # top_k > vocab is fine
    with pytest.raises(ValueError, match=r"stop_token_ids \[512\].*vocabulary \[0, 512\)"):
        SamplingParams(stop_token_ids=[3, 512], min_tokens=1).verify_for_model(512)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=20).verify_for_model(16)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().verify_for_model(0)


# The sampler holds on its own, for parameters that skipped validation.

def _sampler_step(params_list, V=64, eos=None, seeds=None, out_tokens=()):
    import torch
    from kvserve.sample.sampler import Sampler
    from kvserve.worker.request_state import SequenceState
    seeds = seeds or [None] * len(params_list)
    reqs = [SequenceState(f"r{i}", [1, 2, 3, *out_tokens], 3, p, seeds[i], eos)   # what the worker holds
            for i, p in enumerate(params_list)]
    row = torch.randn(V, generator=torch.Generator().manual_seed(0))
    logits = row.expand(len(reqs), V).contiguous()          # the same logits in every row
    return Sampler(V, torch.device("cpu"), seed=0)(logits, reqs), logits, reqs


def test_sampler_clamps_top_k_to_the_vocabulary():
    import torch
    from kvserve.sample.sampler import processed_logprobs
    huge = SamplingParams(temperature=1.0, seed=3)
    huge.top_k = 2**64                       # past validation: must still not reach an int64 tensor
    above = SamplingParams(temperature=1.0, top_k=10**6, seed=3)
    off = SamplingParams(temperature=1.0, seed=3)
    got, logits, reqs = _sampler_step([huge, above, off], seeds=[3, 3, 3])
    assert got[0].token_id == got[1].token_id == got[2].token_id
    lp = processed_logprobs(logits, reqs)
    assert torch.isfinite(lp).all() and torch.allclose(lp[0], lp[2]) and torch.allclose(lp[1], lp[2])


def test_min_tokens_mask_ignores_ids_outside_the_vocabulary():
    import torch
    from kvserve.sample.sampler import process_logits
    p = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[64, 10**6, 7])   # V = 64
    got, logits, reqs = _sampler_step([p], eos=99)
    x = process_logits(logits, reqs)[0]
    assert torch.isinf(x[7]) and int(torch.isinf(x).sum()) == 1
    assert got[0].token_id != 7


def test_sampler_survives_out_of_range_seeds_and_logprobs():
    p = SamplingParams(temperature=1.0, logprobs=5)
    p.logprobs = 1000                       # more than the vocabulary (64)
    got, _, _ = _sampler_step([p, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)],
                              seeds=[2**64, -5, 2**64 - 1])
    assert len(got[0].top) == 64


def test_engine_step_never_raises_on_vocab_dependent_params(llm):
    """stop_token_ids beyond the vocabulary with min_tokens used to raise inside the step. Now
    the request is either rejected when added (ValueError naming the vocabulary, once the engine
    calls verify_for_model) or runs, ignoring the unreachable id; the engine keeps serving."""
    try:
        out = gen(llm, "Once upon a time", temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[99999],
                  top_k=2**63 - 1)
    except ValueError as e:
        assert "vocabulary" in str(e)
    else:
        assert len(out.token_ids) == 6
    assert len(gen(llm, "Tom", temperature=1.0, top_k=2**63 - 1, seed=2**64 - 2, n=1, max_tokens=4).token_ids) == 4
    both = llm.generate(["Tom"], SamplingParams(n=2, seed=2**64 - 2, temperature=1.0, max_tokens=4))[0]
    assert [len(c.token_ids) for c in both.outputs] == [4, 4]


def test_a_top_p_too_small_for_float32_keeps_the_top_token():
    """top_p = 5e-324 rounds to 0.0 in float32: the top token stays, so the row is greedy (it
    once dropped every token and sampled token 0; the schema fuzz found it)."""
    import torch
    from kvserve.sample.metadata import SamplingMetadata
    from kvserve.sample.sampler import apply_top_k_top_p_min_p
    x = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    m = SamplingMetadata.build([SamplingParams(temperature=1.0, top_p=5e-324)], 4)
    out = apply_top_k_top_p_min_p(x, m.top_k, m.top_p, m.min_p, 4)
    assert out[0, 1] == 3.0 and torch.isinf(out[0, [0, 2, 3]]).all()
