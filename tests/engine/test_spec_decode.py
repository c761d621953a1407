"""Speculative decoding (kvserve/spec_decode/): config errors, the n-gram proposer, rejection sampling
keeping the target's distribution (chi-square, fixed seeds: deterministic), stops that land
inside an accepted run, logprobs, load awareness and the counters. The equality tests against
speculation off and against transformers are in tests/reference/test_spec_exactness.py."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import CPU_SPEC_DISABLE_BY_BATCH_SIZE, EngineConfig
from kvserve.config.resolved import resolve_config
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram import ngram_lookup
from kvserve.sample.rejection import accept_greedy, rejection_sample
from tests.conftest import STORIES_C, STORIES_HF

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "max_backoff_steps": 0}
SELF = {"model": "self", "num_speculative_tokens": 6}      # the target as its own draft: all accepted
ALPHA = 1e-3                                              # significance of the chi-square tests


def chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df / 2, stat / 2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- config --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"method": "ngram"},                                             # no num_speculative_tokens
    {"method": "ngram", "num_speculative_tokens": 0},
    {"method": "eagle", "num_speculative_tokens": 2},
    {"method": "draft_model", "num_speculative_tokens": 2},          # no model
    {"method": "ngram", "model": "x", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
    {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
    {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3},
    "{not json", [1, 2],
])
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(bad)


def test_config_defaults_and_cli_flag():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)      # one bound given: both
    c = SpeculativeConfig.parse({"model": "self-int4", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "self-int4"
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = p.parse_args(["--model", str(STORIES_C), "--speculative-config", json.dumps(NGRAM)])
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.speculative == SpeculativeConfig.parse(NGRAM)          # the field is never rewritten
    got = resolve_config(dataclasses.replace(cfg, device="cpu"), 2048).speculative
    # resolved on CPU, an unset load threshold becomes CPU_SPEC_DISABLE_BY_BATCH_SIZE; the rest as given
    assert got == dataclasses.replace(SpeculativeConfig.parse(NGRAM), disable_by_batch_size=CPU_SPEC_DISABLE_BY_BATCH_SIZE)
    explicit = EngineConfig(model="m", device="cpu", speculative_config={**NGRAM, "disable_by_batch_size": 32})
    assert resolve_config(explicit, 2048).speculative.disable_by_batch_size == 32


def test_draft_with_another_vocabulary_is_refused(tmp_path, random_model_dir):
    other = tmp_path / "other"
    shutil.copytree(random_model_dir("llama"), other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 600
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(STORIES_HF), speculative_config={"model": str(other), "num_speculative_tokens": 2})


# -- proposer and acceptance rules ---------------------------------------------------------
def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert ngram_lookup([1, 2, 3, 4, 5, 1, 2], 9, 1, 3) == [3, 4, 5, 1, 2]     # up to the end
    assert ngram_lookup([1, 2, 1, 3, 1], 3, 1, 3) == [3, 1]                     # the latest match
    assert ngram_lookup([1, 2, 1, 3, 1], 3, 2, 3) == []                         # none of length 2
    assert ngram_lookup([9, 1, 2, 7, 5, 1, 2, 8, 1, 2], 1, 1, 3) == [8]         # longest n first
    assert ngram_lookup([1, 2, 3], 3, 1, 3) == []


def test_accept_greedy():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == ([5, 6, 7], 2)
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7, 8], 3)           # + the bonus
    assert accept_greedy([5, 6], [4]) == ([5], 0)


def test_each_row_is_processed_with_the_drafts_before_it():
    """Row i is penalised (and min_tokens-masked) as if drafts 1..i were already output."""
    from kvserve.sample.rejection import verify
    from kvserve.worker.request_state import SequenceState

    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]] * 4)              # argmax 1, then 2
    pen = SequenceState("a", [0], 1, SamplingParams(temperature=0.0, frequency_penalty=2.0), None, None)
    (res,) = verify(logits, [pen], [[1, 1, 1]], torch.Generator())
    assert res.tokens == [1, 2] and res.num_accepted == 1          # a second 1 is penalised below 2
    early = SequenceState("b", [0], 1, SamplingParams(temperature=0.0, min_tokens=2), None, 1)
    (res,) = verify(logits, [early], [[2, 2, 2]], torch.Generator())
    assert res.tokens == [2, 2, 1] and res.num_accepted == 2       # EOS allowed from the third token


def test_rejection_sampling_keeps_the_target_distribution():
    """Point-mass drafts, a fixed target: the first emitted token ~ p0 whatever the draft, and
    after an accepted first draft the second ~ p1. Chi-square goodness of fit, fixed seeds."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 20000
    probs = torch.softmax(torch.randn(4, V, generator=g) * 1.5, dim=-1)       # [k + 1, V]
    for drafts in ([int(probs[0].argmax()), 1, 2], [int(probs[0].argmin()), 0, 0]):
        gen = torch.Generator().manual_seed(1234)
        first = torch.zeros(V)
        second = torch.zeros(V)
        for _ in range(n):
            tokens, a = rejection_sample(probs, drafts, gen)
            assert tokens[:a] == drafts[:a] and len(tokens) == a + 1
            first[tokens[0]] += 1
            if a >= 1:
                second[tokens[1]] += 1
        for counts, p in ((first, probs[0]), (second, probs[1])):
            expected = counts.sum() * p
            stat = float(((counts - expected) ** 2 / expected).sum())
            assert chi2_pvalue(stat, V - 1) > ALPHA, (drafts, counts, expected)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A random Llama with an 8-token vocabulary (no tokenizer: token ids in, token ids out)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.4, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_vocab")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    return str(out)


def test_sampled_distribution_is_unchanged_on_a_model(tiny_vocab_model):
    """Many seeded continuations on a tiny-vocabulary model, speculation on (n-gram: almost
    every step drafts, and most drafts are rejected) and off: the distributions of output
    tokens 2 and 3 (the ones verification chooses) agree (two-sample chi-square at ALPHA)."""
    prompt = [0, 3, 4, 5, 3, 4, 5, 3, 4]
    n = 1500

    def run(spec):
        llm = LLM(tiny_vocab_model, max_num_seqs=256, max_num_batched_tokens=4096, speculative_config=spec)
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        toks = torch.tensor([o.outputs[0].token_ids for o in outs])                # [n, 3]
        return toks, llm.engine.stats()

    on, stats = run({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                     "disable_by_batch_size": 1024})          # 256 at once: speculate anyway
    off, _ = run(None)
    assert stats.spec_decode_num_drafts > n // 2
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for pos in (1, 2):
        a = torch.bincount(on[:, pos], minlength=8).double()
        b = torch.bincount(off[:, pos], minlength=8).double()
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        total = a + b
        ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
        stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
        assert chi2_pvalue(stat, int(keep.sum()) - 1) > ALPHA, (pos, a, b)


# -- the engine ----------------------------------------------------------------------------
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play with her ball. "
          "One day, Lily")


def _outputs(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in llm.generate(prompts, params)]


def test_stops_inside_an_accepted_run():
    """Stop tokens, stop strings, max_tokens and max_model_len that fall inside a run of
    accepted drafts cut it exactly where speculation off stops (the self draft accepts all)."""
    base = LLM(str(STORIES_C), block_size=4, max_model_len=96)
    spec = LLM(str(STORIES_C), block_size=4, max_model_len=96, speculative_config=SELF)
    free = base.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    cases = [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 2, 3, 5, 8, 13)]
    cases += [SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[t]) for t in free.token_ids[3:30:5]]
    words = free.text.split()
    cases += [SamplingParams(temperature=0.0, max_tokens=60, stop=[w], include_stop_str_in_output=inc)
              for w in words[2:12:3] for inc in (False, True)]
    cases += [SamplingParams(temperature=0.0, max_tokens=200)]                # max_model_len
    want = _outputs(base, [PROMPT] * len(cases), cases)
    got = _outputs(spec, [PROMPT] * len(cases), cases)
    assert got == want
    s = spec.engine.stats()
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens > 0
    spec.engine.check_integrity()
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.pool.num_blocks


def test_logprobs_of_accepted_tokens_are_the_targets():
    base = LLM(str(STORIES_C), block_size=2)
    spec = LLM(str(STORIES_C), block_size=2, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=50, logprobs=3)
    prompt = "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom"
    (a,), (b,) = base.generate(prompt, params), spec.generate(prompt, params)
    x, y = a.outputs[0], b.outputs[0]
    assert x.token_ids == y.token_ids
    assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
    for ex, ey in zip(x.logprobs, y.logprobs, strict=True):
        assert ex.keys() == ey.keys()
        for t in ex:
            assert abs(ex[t].logprob - ey[t].logprob) < 1e-4 and ex[t].rank == ey[t].rank
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0


def test_penalties_and_min_tokens_see_the_drafts_before_them():
    base = LLM(str(STORIES_C))
    spec = LLM(str(STORIES_C), speculative_config=SELF)
    cases = [SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.5, presence_penalty=0.3),
             SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, stop_token_ids=[13])]
    assert _outputs(spec, [PROMPT] * 3, cases) == _outputs(base, [PROMPT] * 3, cases)


def test_seeded_sampling_is_reproducible_with_speculation():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=7)
    runs = [LLM(str(STORIES_C), speculative_config=NGRAM).generate(PROMPT, params)[0].outputs[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 40


def test_disable_by_batch_size():
    cfg = dict(NGRAM, disable_by_batch_size=2)
    llm = LLM(str(STORIES_C), speculative_config=cfg)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate([PROMPT] * 3, params)                      # three running: never speculates
    assert llm.engine.stats().spec_decode_num_drafts == 0
    llm.generate([PROMPT] * 2, params)
    assert llm.engine.stats().spec_decode_num_drafts > 0


def test_counters_reach_the_metrics():
    from kvserve.server.metrics import ServerMetrics

    llm = LLM(str(STORIES_C), speculative_config=NGRAM)
    llm.generate("Tom had a red ball. Tom had a red ball. Tom", SamplingParams(temperature=0.0, max_tokens=30))
    s = llm.engine.stats()
    assert s.spec_decode_num_draft_tokens >= s.spec_decode_num_accepted_tokens > 0
    assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    m = ServerMetrics("m")
    m.update_stats(s)
    text = m.render().decode()
    assert f'kvserve:spec_decode_num_drafts_total{{model_name="m"}} {float(s.spec_decode_num_drafts)}' in text
    assert f'kvserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(s.spec_decode_num_accepted_tokens)}' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text


def test_draft_model_cache_rolls_back(random_model_dir):
    """The draft model's own paged cache rewinds to what the target verified: every proposal
    equals the draft model's greedy continuation computed afresh from the sequence's tokens
    (a random draft is rejected at once, so most steps roll back k - 1 of its positions)."""
    draft = str(random_model_dir("llama"))
    llm = LLM(str(STORIES_C), block_size=2, speculative_config={"model": draft, "num_speculative_tokens": 3,
                                                                "max_backoff_steps": 0})
    proposer = llm.engine.core.spec.proposer
    seen = []
    propose = proposer.propose

    def recording(requests, num_drafts):
        out = propose(requests, num_drafts)
        seen.extend((list(r.token_ids), d) for r, d in zip(requests, out))
        return out

    proposer.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([PROMPT, "Tom had a red ball. He"], params)
    assert proposer.kv.num_free_blocks == proposer.kv.pool.num_blocks and not proposer.seqs
    fresh = LLM(draft, block_size=2)
    for tokens, drafts in seen[1::4]:
        want = fresh.generate({"prompt_token_ids": tokens}, SamplingParams(temperature=0.0, max_tokens=len(drafts),
                                                                         ignore_eos=True))
        assert drafts == want[0].outputs[0].token_ids
    assert len(seen) > 10


def test_a_step_streams_several_tokens_and_aborts_free_everything():
    """Per step, a speculating request's output grows by its whole accepted run (a streamed
    chunk of several tokens); an abort in the middle frees the target's and the draft's KV."""
    llm = LLM(str(STORIES_C), block_size=2, speculative_config=SELF)
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    eng.add_request("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    growth, last = [], 0
    for _ in range(4):
        for out in eng.step():
            if out.request_id == "a":
                growth.append(len(out.outputs[0].token_ids) - last)
                last = len(out.outputs[0].token_ids)
        eng.check_integrity()
    assert max(growth) == 1 + SELF["num_speculative_tokens"]
    eng.abort_request("a")
    eng.check_integrity()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert eng.core.spec.proposer.kv.num_free_blocks == eng.core.spec.proposer.kv.pool.num_blocks


def test_a_draft_that_is_always_rejected_backs_off(random_model_dir):
    """A sequence whose drafts are all rejected sits out 1, 2, 4, ... steps (at most
    max_backoff_steps): a draft that never agrees costs few verification rows, and the tokens
    are the same as with no back-off and with no speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    off = LLM(str(STORIES_C)).generate(PROMPT, params)[0].outputs[0].token_ids
    drafts = {}
    for backoff in (0, 16):
        llm = LLM(str(STORIES_C), speculative_config={"model": str(random_model_dir("llama")), "num_speculative_tokens": 3,
                                                      "max_backoff_steps": backoff})
        assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == off
        drafts[backoff] = llm.engine.stats().spec_decode_num_drafts
    assert drafts[0] >= 40 and drafts[16] <= 8       # 1 + 1 + 2 + 4 + 8 + 16 steps sat out by 48
