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
    eng = llm.engine
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
