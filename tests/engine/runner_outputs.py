"""Build the ModelRunnerOutput a scheduler test means from plain values."""
from kvserve.sample.params import Sampled
from kvserve.worker.output import ModelRunnerOutput


def runner_output(samples: dict, candidates: dict | None = None) -> ModelRunnerOutput:
    """samples: sequence id -> a token id, a verified speculative run (a list of ids), or an
    exception (that sequence fails); candidates: beam id -> (token ids, logprobs)."""
    out = ModelRunnerOutput(beam_candidates=dict(candidates or {}))
    for rid, v in samples.items():
        if isinstance(v, BaseException):
            out.fail(rid, v)
        else:
            out.sampled[rid] = [Sampled(t) for t in (v if isinstance(v, list) else [v])]
    return out
