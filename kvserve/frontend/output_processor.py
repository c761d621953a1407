"""OutputProcessor: the engine core's token deltas -> text and RequestOutputs (the frontend).

The core sends, per step, only each sequence's new token ids and logprob values
(engine/core_io.py). Here, per sequence and in O(new tokens) a step: incremental
detokenization (frontend/detokenizer.py), stop strings (after min_tokens; the text is cut at
the stop, or kept with include_stop_str_in_output, and the tokens after the one that completed
it are discarded -- the core may have made a token or two more before its abort arrives),
held-back text that might start a stop string, logprob tables, prompt logprobs and metrics.

`output_kind` (vLLM's RequestOutputKind) says what a step emits for a request:
- "cumulative" (`LLM.generate`, `LLMEngine.step`): the request's RequestOutput, extended in
  place (lists only grow: appends, never copies);
- "delta" (the server's streams): a fresh RequestOutput holding only what this step added
  (text, token ids, logprobs), the whole prompt logprobs once, on the first one;
- "final": only the finished output.
A step that adds nothing visible (only prompt-logprob rows) emits nothing. Stop strings found
here come back from `process` as (request id, sample index) for the caller to abort in the core.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvserve.engine.core_io import EngineCoreOutput, Sampled
from kvserve.engine.request import RequestMetrics
from kvserve.frontend.detokenizer import IncrementalDetokenizer, held_back
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sample.params import SamplingParams

OUTPUT_KINDS = ("cumulative", "delta", "final")
logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    detok: IncrementalDetokenizer
    out: CompletionOutput            # cumulative: token ids, logprobs (text is detok's)
    sent_text: int = 0               # delta: characters already emitted
    sent_tokens: int = 0
    sent_logprobs: int = 0
    ended: bool = False              # delta: its finish is out
    visible: int = 0                 # characters of the text the user may see (stop-string hold-back)


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    output: RequestOutput
    kind: str
    seqs: dict[int, _Sequence] = field(default_factory=dict)
    prompt_sent: bool = False        # delta: the prompt logprobs went out (on the first delta)


class OutputProcessor:
    def __init__(self, tokenizer, logprob_text: bool = True):
        """`logprob_text`: fill each Logprob's decoded_token (LLM's outputs); the server reads
        token texts in context itself (server/openai/logprobs.py) and leaves it off."""
        self.tokenizer = tokenizer
        self.logprob_text = logprob_text and tokenizer is not None
        self.requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, output_kind: str = "cumulative") -> None:
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}.")
        out = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                            outputs=[], finished=False, metrics=RequestMetrics(arrival_time),
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        req = self.requests[request_id] = _Request(request_id, params, out, output_kind)
        if not params.use_beam_search:
            for i in range(params.n):
                c = CompletionOutput(index=i, text="", token_ids=[],
                                     cumulative_logprob=0.0 if params.logprobs is not None else None,
                                     logprobs=[] if params.logprobs is not None else None)
                req.seqs[i] = _Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                               params.skip_special_tokens), c)
                out.outputs.append(c)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------
    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[tuple[str, int]], list[RequestOutput]]:
        """Apply a step's deltas. Returns (the outputs to hand on, (request id, sample index) of
        each sequence a stop string ended, to abort in the core, and the whole output of every
        request that finished: what metrics read, whatever the output kind)."""
        emitted, stops, finished = [], [], []
        for co in core_outputs:
            req = self.requests.get(co.request_id)
            if req is None:
                continue                     # finished here or aborted meanwhile
            try:
                changed = self._apply(req, co, stops)
            except Exception as e:  # noqa: BLE001 -- one request's detokenizer bug fails it alone
                logger.exception("output processing failed for request %s", co.request_id)
                changed = self._fail(req, f"output processing failed: {type(e).__name__}: {e}", stops)
            out = req.output
            if all(c.finish_reason is not None for c in out.outputs) and out.outputs:
                out.finished = True
            if out.finished:
                out.metrics.finished_time = co.timestamp
                del self.requests[co.request_id]
                finished.append(out)
            if out.finished or (changed and req.kind != "final"):
                emitted.append(self._delta(req) if req.kind == "delta" else self._whole(req))
        return emitted, stops, finished

    def _apply(self, req: _Request, co: EngineCoreOutput, stops: list) -> bool:
        out, m = req.output, req.output.metrics
        out.num_cached_tokens = co.num_cached_tokens
        if m.first_scheduled_time is None:
            m.first_scheduled_time = co.first_scheduled_time
        if co.new_prompt_logprobs:
            out.prompt_logprobs += [self._table(s) for s in co.new_prompt_logprobs]
        if co.beams is not None or (co.finished and req.params.use_beam_search):
            self._beams(req, co)
            return True
        changed = False
        for d in co.seqs:
            seq = req.seqs[d.index]
            c = seq.out
            if c.finish_reason is not None:
                continue                     # tokens made after a stop string: discarded
            if d.index == 0 and d.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = co.timestamp
                m.last_token_time = co.timestamp
                m.token_times += [co.timestamp] * len(d.new_token_ids)
            for i, t in enumerate(d.new_token_ids):
                c.token_ids.append(t)
                if c.logprobs is not None:
                    c.logprobs.append(self._table(d.new_logprobs[i]))
                    c.cumulative_logprob += d.new_logprobs[i].logprob
                if self._stop_string(req.params, seq, t):
                    stops.append((req.request_id, d.index))
                    break
            else:
                if d.finish_reason is not None:      # ended in the core: nothing is held back
                    c.finish_reason, c.stop_reason, c.error = d.finish_reason, d.stop_reason, d.error
                    c.error_code = d.error_code
                    seq.visible = len(seq.detok.text)
            changed = True
        return changed

    def _fail(self, req: _Request, why: str, stops: list) -> bool:
        for i, seq in req.seqs.items():
            if seq.out.finish_reason is None:
                seq.out.finish_reason, seq.out.error = "error", why
                stops.append((req.request_id, i))
        return True

    def _stop_string(self, p: SamplingParams, seq: _Sequence, token_id: int) -> bool:
        """Detokenize one token; True (and the sequence finished) when it completes a stop string."""
        d = seq.detok
        old_len = len(d.text)
        d.add(token_id)
        c = seq.out
        if p.stop_strings and len(c.token_ids) >= p.min_tokens:
            for s in p.stop_strings:
                at = d.text.find(s, max(0, old_len - len(s) + 1))
                if at >= 0:
                    d.text = d.text[:at + len(s)] if p.include_stop_str_in_output else d.text[:at]
                    c.finish_reason, c.stop_reason = "stop", s
                    seq.visible = len(d.text)
                    return True
        # What the user may see now: text that might start a stop string is held back.
        seq.visible = len(d.text) - (held_back(d.text, p.stop_strings) if p.stop_strings else 0)
        return False

    def _beams(self, req: _Request, co: EngineCoreOutput) -> None:
        out, tok = req.output, self.tokenizer
        for i, h in enumerate(co.beams or ()):
            text = tok.decode(h.token_ids) if tok is not None else ""
            out.outputs.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
                logprobs=[{t: Logprob(lp)} for t, lp in zip(h.token_ids, h.logprobs)],
                finish_reason=h.finish_reason, stop_reason=h.stop_reason))
        if not out.outputs:                  # failed before any hypothesis: say why
            out.outputs.append(CompletionOutput(index=0, text="", token_ids=[], finish_reason="error",
                                                error=co.error))
        out.finished = co.finished
        if out.metrics.first_token_time is None:
            out.metrics.first_token_time = out.metrics.last_token_time = co.timestamp

    def _table(self, s: Sampled) -> dict[int, Logprob]:
        """One position's logprobs as vLLM returns them: the token's own, then the top-k."""
        piece = self.tokenizer.token_to_text if self.logprob_text else (lambda t: None)
        entry = {s.token_id: Logprob(s.logprob, s.rank, piece(s.token_id))}
        for rank, (tid, lp) in enumerate(s.top or (), start=1):
            entry.setdefault(tid, Logprob(lp, rank, piece(tid)))
        return entry

    # -- what a step emits -------------------------------------------------------------------
    def _whole(self, req: _Request) -> RequestOutput:
        """The cumulative output, its texts brought up to date (no copy when nothing is held)."""
        for seq in req.seqs.values():
            seq.out.text = seq.detok.text[:seq.visible]
        return req.output

    def _delta(self, req: _Request) -> RequestOutput:
        out = req.output
        comps = []
        for seq in req.seqs.values():
            c = seq.out
            if seq.ended:
                continue
            new_text, new_ids = seq.detok.text[seq.sent_text:seq.visible], c.token_ids[seq.sent_tokens:]
            if not new_text and not new_ids and c.finish_reason is None:
                continue
            lps = c.logprobs[seq.sent_logprobs:] if c.logprobs is not None else None
            comps.append(CompletionOutput(index=c.index, text=new_text, token_ids=new_ids,
                                          cumulative_logprob=c.cumulative_logprob, logprobs=lps,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                          error=c.error, error_code=c.error_code))
            seq.sent_text, seq.sent_tokens = seq.visible, len(c.token_ids)
            seq.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            seq.ended = c.finish_reason is not None
        if not req.seqs:                     # beam search: the final output whole
            comps = out.outputs
        plp = None
        if out.prompt_logprobs is not None and not req.prompt_sent:
            plp, req.prompt_sent = out.prompt_logprobs, True
        return RequestOutput(request_id=out.request_id, prompt=out.prompt,
                             prompt_token_ids=out.prompt_token_ids, outputs=comps,
                             finished=out.finished, metrics=out.metrics,
                             num_cached_tokens=out.num_cached_tokens, prompt_logprobs=plp)
