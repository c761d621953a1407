"""The engine core sends each step's outputs as deltas (server/engine_core.py `DeltaEncoder`) and
the API process rebuilds the cumulative outputs from them (server/engine_client.py `_Stream`):
for any sequence of cumulative outputs -- growing, several sequences, logprobs or not, a
finished beam search replacing its empty outputs -- the rebuilt output equals the original at
every step, and each step sends only what is new."""
from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.server.engine_client import _Stream
from kvserve.server.engine_core import DeltaEncoder


def snapshot(out: RequestOutput) -> tuple:
    return (out.finished, out.num_cached_tokens, out.prompt_logprobs,
            [(c.index, list(c.token_ids), c.text, None if c.logprobs is None else list(c.logprobs),
              c.cumulative_logprob, c.finish_reason, c.stop_reason) for c in out.outputs])


@st.composite
def histories(draw):
    """Cumulative outputs of one request, step by step."""
    n = draw(st.integers(1, 3))
    with_lp = draw(st.booleans())
    steps = draw(st.integers(1, 12))
    toks = [[] for _ in range(n)]
    texts = ["" for _ in range(n)]
    lps = [[] for _ in range(n)]
    history = []
    for s in range(steps):
        comps = []
        for i in range(n):
            k = draw(st.integers(0, 3))                 # several tokens a step (speculation)
            new = draw(st.lists(st.integers(0, 500), min_size=k, max_size=k))
            toks[i] += new
            texts[i] += draw(st.text(max_size=4)) if k else ""
            lps[i] += [{t: Logprob(-0.5, 1, "x")} for t in new]
            done = s == steps - 1
            comps.append(CompletionOutput(index=i, text=texts[i], token_ids=list(toks[i]),
                                          cumulative_logprob=-1.0 * len(toks[i]) if with_lp else None,
                                          logprobs=list(lps[i]) if with_lp else None,
                                          finish_reason="length" if done else None))
        history.append(RequestOutput("r", None, [1, 2], comps, finished=s == steps - 1,
                                     num_cached_tokens=s, prompt_logprobs=[None] if s else None))
    if draw(st.booleans()):       # a beam search: empty until finished, then whole new beams
        beams = [CompletionOutput(index=i, text=f"beam {i}", token_ids=[7] * (i + 3), finish_reason="stop")
                 for i in range(2)]
        history = [RequestOutput("r", None, [1, 2], [], finished=False) for _ in range(2)] + \
                  [RequestOutput("r", None, [1, 2], beams, finished=True)]
    return history


@settings(max_examples=150, deadline=None)
@given(histories())
def test_deltas_rebuild_every_cumulative_output(history):
    enc = DeltaEncoder()
    stream = _Stream(None, 1, RequestOutput("r", None, [1, 2], [], finished=False))
    sent_tokens = 0
    for out in history:
        delta = pickle.loads(pickle.dumps(enc.encode(out)))     # as it crosses the pipe
        sent_tokens += sum(len(c[2]) for c in delta[5])
        rebuilt = stream.apply(delta)
        assert snapshot(rebuilt) == snapshot(out)
    # every token crossed once (beams: the finished beams once)
    assert sent_tokens == sum(len(c.token_ids) for c in history[-1].outputs)
    assert enc._sent == {} and enc._prompt_lp_sent == {}     # forgotten once finished
