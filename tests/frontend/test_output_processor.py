"""OutputProcessor (frontend/output_processor.py): the engine core's token deltas -> text and
RequestOutputs, with the real stories260K tokenizer.

For random token streams (n samples, several tokens a step, byte-fallback pieces, stop strings
with include_stop_str_in_output and min_tokens, logprobs, prompt logprobs arriving over several
prefill steps, a core that keeps making tokens a few steps after a stop string), the three
output kinds agree: the "delta" outputs joined give the "cumulative" output at the end, which is
the one "final" output. Each step's tokenizer work is bounded by its tokens, not the stream's
length.
"""
from __future__ import annotations

import pickle
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.core_io import BeamResult, EngineCoreOutput, Sampled, SequenceDelta
from kvserve.frontend.detokenizer import IncrementalDetokenizer
from kvserve.frontend.output_processor import OutputProcessor
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.sample.params import SamplingParams
from tests.conftest import STORIES_HF

TOK = HFTokenizer(STORIES_HF)
KINDS = ("cumulative", "delta", "final")


def sampled(tid: int, rng: random.Random, k: int | None) -> Sampled:
    top = [(rng.randrange(3, 512), -rng.random() * 9) for _ in range(k or 0)]
    return Sampled(tid, -rng.random() * 9, rng.randint(1, 50), top)


def snapshot(out) -> tuple:
    return (out.request_id, out.finished, out.num_cached_tokens, out.prompt_logprobs,
            [(c.index, c.text, list(c.token_ids), c.logprobs, c.cumulative_logprob, c.finish_reason,
              c.stop_reason) for c in out.outputs])


def drive(prompt, params, plans, per_step, lag, seed=0, kinds=KINDS, tokenizer=TOK):
    """Feed one request's core deltas to a processor of each kind, as a core would send them:
    `per_step[s][i]` new tokens of sample i at step s (from plans[i]); prompt logprobs over the
    first one or two (prefill) steps; a sample whose stop string the frontend reported is aborted `lag` steps later
    (its tokens meanwhile are the ones to discard). Returns what each kind emitted (copies, as
    they were when emitted), the stops, and each stopped sample's token count at its stop."""
    rng = random.Random(seed)
    procs = {k: OutputProcessor(tokenizer) for k in kinds}
    for k, p in procs.items():
        p.add_request("r", None, prompt, params, 0.0, k)
    prompt_rows = ([sampled(t, rng, params.prompt_logprobs) for t in prompt[1:]]
                   if params.prompt_logprobs is not None else [])
    # prompt logprob rows in one or two prefill chunks; the first tokens come with the last one
    prefill = [c for c in (prompt_rows[:len(prompt_rows) // 2], prompt_rows[len(prompt_rows) // 2:]) if c]
    made = [0] * len(plans)
    ended = [False] * len(plans)
    abort_at: dict[int, int] = {}
    emitted = {k: [] for k in kinds}
    stops, at_stop = [], {}
    step = 0
    while not all(ended):
        deltas = []
        for i, plan in enumerate(plans):
            if ended[i]:
                continue
            if abort_at.get(i) == step:
                deltas.append(SequenceDelta(i, finish_reason="abort"))
                ended[i] = True
                continue
            k = 0 if step < len(prefill) - 1 else per_step[step % len(per_step)][i]
            new = plan[made[i]:made[i] + k]
            made[i] += len(new)
            if not new and made[i] < len(plan):
                continue                                # not scheduled this step
            d = SequenceDelta(i, new, [sampled(t, rng, params.logprobs) for t in new]
                              if params.logprobs is not None else None)
            if made[i] == len(plan):
                d.finish_reason, ended[i] = "length", True
            deltas.append(d)
        rows = prefill[step] if step < len(prefill) else None
        co = EngineCoreOutput("r", deltas, all(ended), float(step), num_cached_tokens=3,
                              new_prompt_logprobs=rows or None)
        wire = pickle.dumps(co)                         # each processor gets its own copy
        step_stops = []
        for k, p in procs.items():
            outs, found, _ = p.process([pickle.loads(wire)])
            emitted[k].append([pickle.loads(pickle.dumps(o)) for o in outs])
            step_stops.append(found)
        assert all(s == step_stops[0] for s in step_stops), step_stops
        for rid, i in step_stops[0]:
            stops.append(i)
            abort_at[i] = step + 1 + lag
            if "cumulative" in procs:
                at_stop[i] = len(emitted["cumulative"][-1][0].outputs[i].token_ids)
        step += 1
        assert step < 10_000
    return emitted, stops, at_stop, procs


def rebuild(deltas: list) -> dict:
    """The "delta" outputs of one request joined into one cumulative view, checking that a
    sample sends nothing after its finish and prompt logprobs come once, first."""
    seqs, prompt_lp, finished = {}, None, False
    for k, o in enumerate(deltas):
        assert not finished, "an output after the finished one"
        finished = o.finished
        assert o.prompt_logprobs is None or k == 0
        prompt_lp = prompt_lp if k else o.prompt_logprobs
        for c in o.outputs:
            s = seqs.setdefault(c.index, {"text": "", "ids": [], "lps": None, "end": None})
            assert s["end"] is None, f"sample {c.index} sent a delta after its finish"
            s["text"] += c.text
            s["ids"] += c.token_ids
            if c.logprobs is not None:
                s["lps"] = (s["lps"] or []) + c.logprobs
            s["cum"], s["end"] = c.cumulative_logprob, c.finish_reason
            s["stop"] = c.stop_reason
    return {"finished": finished, "prompt_logprobs": prompt_lp, "seqs": seqs}


def check_kinds_agree(emitted):
    def steps(kind):
        return [k for k, outs in enumerate(emitted[kind]) if outs]

    final = [o for outs in emitted["final"] for o in outs]
    last = emitted["cumulative"][steps("cumulative")[-1]][0]
    assert len(final) == 1 and final[0].finished and last.finished
    assert steps("final") == steps("cumulative")[-1:]       # at the step the request finished
    for outs in emitted["cumulative"]:                      # its text never taken back
        for c in (c for o in outs for c in o.outputs):
            assert last.outputs[c.index].text.startswith(c.text)
    assert snapshot(final[0]) == snapshot(last)
    deltas = [o for outs in emitted["delta"] for o in outs]
    assert steps("delta") == steps("cumulative")           # only the steps that changed something
    joined = rebuild(deltas)
    assert joined["finished"] and joined["prompt_logprobs"] == last.prompt_logprobs
    for c in last.outputs:
        s = joined["seqs"][c.index]
        assert (s["text"], s["ids"], s["lps"], s["cum"], s["end"], s["stop"]) == \
            (c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
    return last


# a pool of pieces: merges, short words, newlines, a two-byte character in byte-fallback tokens
PIECES = [[403], [407], [261], [378], [432], [383], [286], [298], [315], [421], [426], [13],
          [198, 172], [198], [172], [2], [259], [300], [511]]
STOPS = ["e", " a", "th", "\n", "é", "zzz"]


@st.composite
def streams(draw):
    n = draw(st.integers(1, 3))
    stop = draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True))
    params = SamplingParams(n=n, max_tokens=None, stop=stop or None,
                            include_stop_str_in_output=draw(st.booleans()),
                            min_tokens=draw(st.integers(0, 4)),
                            logprobs=draw(st.sampled_from([None, 0, 2])),
                            prompt_logprobs=draw(st.sampled_from([None, 0, 1])))
    prompt = [1] + draw(st.lists(st.integers(3, 511), min_size=0, max_size=7))
    plans = [[t for p in draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=14)) for t in p]
             for _ in range(n)]
    per_step = draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=1, max_size=4))
    for i in range(n):                                  # every sample moves at some step
        if not any(row[i] for row in per_step):
            per_step[0][i] = 1
    return prompt, params, plans, per_step, draw(st.integers(0, 2)), draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_delta_outputs_join_to_the_cumulative_and_the_final_output(case):
    prompt, params, plans, per_step, lag, seed = case
    emitted, stops, at_stop, procs = drive(prompt, params, plans, per_step, lag, seed)
    last = check_kinds_agree(emitted)
    assert all(not p.requests for p in procs.values())        # each request forgotten once finished
    for c in last.outputs:
        plan = plans[c.index]
        assert c.token_ids == plan[:len(c.token_ids)]
        ref = IncrementalDetokenizer(TOK, prompt, True)    # the text without stop strings
        for t in c.token_ids:
            ref.add(t)
        if c.index in at_stop:                                 # a stop string ended it: what the
            assert c.finish_reason == "stop" and c.stop_reason in params.stop_strings
            assert len(c.token_ids) == at_stop[c.index]        # core made after it is discarded
            assert len(c.token_ids) >= params.min_tokens
            s = c.stop_reason
            assert ref.text.startswith(c.text)
            if params.include_stop_str_in_output:
                assert c.text.endswith(s)
            elif len(params.stop_strings) == 1 and params.min_tokens == 0:
                assert s not in c.text
        else:
            assert c.finish_reason == "length" and c.token_ids == plan
            assert c.text == ref.text                         # nothing left held back
        if c.logprobs is not None:
            assert [next(iter(t)) for t in c.logprobs] == c.token_ids
            assert all(lp.decoded_token == TOK.token_to_text(t) for t in c.logprobs for t, lp in t.items())


def test_stop_strings_after_min_tokens_cut_or_kept():
    ids = TOK.encode("Once upon a time, there was a girl.", add_special_tokens=False)

    def text(plan=ids, **kw):
        emitted, stops, _, _ = drive([1], SamplingParams(max_tokens=None, **kw), [plan], [[1]], lag=2)
        last = check_kinds_agree(emitted)
        return last.outputs[0].text, last.outputs[0].token_ids, stops

    assert text(stop=" a") == ("Once upon", ids[:3], [0])
    assert text(stop=" a", include_stop_str_in_output=True) == ("Once upon a", ids[:3], [0])
    # the first " a" is completed by token 3: before min_tokens=4, so not a stop
    assert text(stop=" a", min_tokens=4) == ("Once upon a time, there was", ids[:8], [0])
    assert text(stop=["girl", "zzz"]) == ("Once upon a time, there was a ", ids[:11], [0])
    assert text(stop="zzz") == ("Once upon a time, there was a girl.", ids, [])
    # " t" might start "th" and is held back while running, but not once the core ends it
    assert text(ids[:3] + [259], stop="th") == ("Once upon a t", ids[:3] + [259], [])


def test_beam_search_results_are_decoded_once_for_every_kind():
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    beams = [BeamResult([403, 407], [-0.5, -0.25], -0.75, "length"),
             BeamResult([403, 286], [-0.5, -1.0], -1.5, "stop", 2)]
    procs = {k: OutputProcessor(TOK) for k in KINDS}
    for k, p in procs.items():
        p.add_request("b", None, [1], params, 0.0, k)
        assert p.process([EngineCoreOutput("b", [], False, 1.0)])[0] == []   # nothing until done
        (out,), _, _ = p.process([EngineCoreOutput("b", [], True, 2.0, beams=pickle.loads(pickle.dumps(beams)))])
        assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == \
            [("Once upon", [403, 407], "length"), ("Once was", [403, 286], "stop")]


class CountingTokenizer:
    """The stories260K tokenizer, counting the work asked of it."""

    def __init__(self, inner):
        self.inner, self.calls, self.ids, self.pieces = inner, 0, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_text(self, t):
        self.pieces += 1
        return self.inner.token_to_text(t)


def test_work_per_step_is_bounded_by_the_step_not_the_stream():
    """2 samples, 1,500 tokens each, one a step, logprobs with 2 alternatives and a stop string
    that never comes: every step asks the tokenizer for the same bounded work, at the start of
    the stream as at its end (the old output path re-decoded and re-sent whole texts)."""
    tok = CountingTokenizer(TOK)
    rng = random.Random(0)
    n, length = 2, 1500
    params = SamplingParams(n=n, max_tokens=None, stop=["zzz"], logprobs=2)
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 403], params, 0.0, "delta")
    per_step = []
    for step in range(length):
        before = (tok.calls, tok.ids, tok.pieces)
        done = step == length - 1
        co = EngineCoreOutput("r", [SequenceDelta(i, [t := rng.randrange(259, 512)], [sampled(t, rng, 2)],
                                                  "length" if done else None) for i in range(n)],
                              done, float(step))
        (out,), _, _ = proc.process([co])
        per_step.append((tok.calls - before[0], tok.ids - before[1], tok.pieces - before[2]))
        assert all(len(c.token_ids) == 1 and len(c.logprobs) == 1 for c in out.outputs)
    calls, ids, pieces = (max(col) for col in zip(*per_step))
    assert calls <= 2 * n                  # two decodes of a short window per new token
    assert ids <= 2 * n * 16               # of a window that does not grow with the stream
    assert pieces <= n * 3                 # one text per logprob entry
    late = per_step[-100:]
    assert max(c for c, _, _ in late) <= calls and max(i for _, i, _ in late) <= ids
