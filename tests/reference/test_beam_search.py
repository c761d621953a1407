"""Native beam search equals a straightforward beam search over transformers' logits: the same
beams in the same order, scores within 1e-4, with and without a length penalty, with a stop
token that finishes some candidates early, under recompute and swap preemption; and beams share
blocks (copy on write) instead of each holding its own copy."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sample.params import BeamSearchParams
from tests.reference.hf_reference import load_hf


def score(seq_len, cum, ends_in_eos, length_penalty):
    return cum / ((seq_len - (1 if ends_in_eos else 0)) ** length_penalty)


@torch.inference_mode()
def reference_beam_search(model_dir, prompt, width, max_tokens, length_penalty=1.0, eos=2, stops=()):
    """vLLM's LLM.beam_search rules, on full transformers forward passes: every live beam
    proposes its top 2*width tokens; stop tokens finish a hypothesis; the best `width` of the
    rest survive; after max_tokens steps, finished + live are ranked by score."""
    model = load_hf(str(model_dir))
    stop = set(stops) | {eos}
    live = [(list(prompt), 0.0)]
    done = []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in live:
            lp = torch.log_softmax(model(torch.tensor([toks])).logits[0, -1].float(), dim=-1)
            top_lp, top_ids = lp.topk(2 * width)
            for t, l in zip(top_ids.tolist(), top_lp.tolist()):
                new = (toks + [t], cum + l)
                if t in stop:
                    done.append((*new, score(len(new[0]), new[1], t == eos, length_penalty)))
                else:
                    cands.append((*new, score(len(new[0]), new[1], False, length_penalty)))
        cands.sort(key=lambda c: -c[2])
        live = [(t, c) for t, c, _ in cands[:width]]
    done += [(t, c, score(len(t), c, False, length_penalty)) for t, c in live]
    done.sort(key=lambda c: -c[2])
    return [(t[len(prompt):], c, s) for t, c, s in done[:width]]


def prompt_ids(seed=5, n=9):
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 512) for _ in range(n)]


def compare(got_seqs, ref, prompt, length_penalty):
    assert [s.output_token_ids for s in got_seqs] == [r[0] for r in ref]
    for s, (toks, cum, sc) in zip(got_seqs, ref):
        assert abs(s.cum_logprob - cum) < 1e-4
        ends_eos = s.finish_reason == "stop" and s.stop_reason is None
        assert abs(score(len(prompt) + len(toks), s.cum_logprob, ends_eos, length_penalty) - sc) < 1e-4


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_matches_reference(length_penalty, random_model_dir):
    model_dir = random_model_dir("llama")
    prompt = prompt_ids()
    ref = reference_beam_search(model_dir, prompt, 3, 7, length_penalty)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=128)
    out = llm.beam_search([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=length_penalty))[0]
    compare(out.sequences, ref, prompt, length_penalty)
    eng = llm.engine
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.requests
    assert eng.stats().num_cow_copies_total > 0          # forks shared the partial block


def test_beam_search_with_stop_token_and_preemption(random_model_dir):
    """A stop token taken from the first step's candidates finishes hypotheses early; a pool too
    small for two beam searches at once preempts one of them (recompute, then swap)."""
    model_dir = random_model_dir("llama")
    prompts = [prompt_ids(5), prompt_ids(6, 11), prompt_ids(7, 12)]
    model = load_hf(str(model_dir))
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0, -1], -1)
    stop = int(lp.topk(2).indices[1])                    # the 2nd most likely first token
    refs = [reference_beam_search(model_dir, p, 2, 6, 1.0, stops=[stop]) for p in prompts]
    assert any(len(t) < 6 for t, _, _ in refs[0]), "the stop token should end a hypothesis early"
    for mode in ("recompute", "swap"):
        llm = LLM(str(model_dir), block_size=2, num_kv_blocks=20, watermark=0.0, preemption_mode=mode)
        params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=6, stop_token_ids=[stop])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, out, ref in zip(prompts, outs, refs):
            assert [c.token_ids for c in out.outputs] == [r[0] for r in ref]
            assert [c.finish_reason for c in out.outputs] == [
                "stop" if r[0][-1] == stop else "length" for r in ref]
            assert all(abs(c.cumulative_logprob - r[1]) < 1e-4 for c, r in zip(out.outputs, ref))
        eng = llm.engine
        eng.check_integrity()
        assert eng.stats().num_preemptions_total > 0, mode
        if mode == "swap":
            assert eng.stats().num_swap_preemptions_total > 0
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_beam_search_needs_a_pool_that_fits_it(random_model_dir):
    llm = LLM(str(random_model_dir("llama")), block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match="beam_width"):
        llm.engine.add_request("b", {"prompt_token_ids": prompt_ids()},
                               SamplingParams(use_beam_search=True, beam_width=4, max_tokens=20))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


@pytest.mark.parametrize("bad", [dict(use_beam_search=True, beam_width=0), dict(beam_width=3),
                                 dict(use_beam_search=True, beam_width=2, n=3),
                                 dict(use_beam_search=True, top_p=0.5)])
def test_bad_beam_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
