"""The `SamplingParams` of one HTTP request: its sampling fields, the max_tokens the context
window allows, and its output constraint as `StructuredOutputsParams` (server/openai/structured_fields.py,
or a forced tool call's schema, server/openai/tool_choice.py). A value the params refuse is a 400."""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.sample.params import SamplingParams
from kvserve.server.openai.protocol import INVALID_STRUCTURED_OUTPUT, PRIORITY_CODE, SAMPLING_RULE_CODE, APIError


# generation_config.json's keys that become a request's defaults (vLLM's `--generation-config`)
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(mode: str, model: str) -> dict:
    """The sampling defaults of `--generation-config` (vLLM's): "vllm" none (kvserve's and the
    OpenAI API's own); "auto" those of the model's generation_config.json, when it has one; a
    directory, those of its generation_config.json (which must exist). Only the sampling keys
    above count; a request's own value always wins (`sampling_params`)."""
    if mode == "vllm" or (mode == "auto" and not model):     # (no --model: the default, a .gguf file)
        return {}
    folder = Path(model) if mode == "auto" else Path(mode)
    path = folder / "generation_config.json"
    if not path.is_file():
        if mode == "auto":
            return {}                   # a .gguf file, or a directory without one
        raise ValueError(f"--generation-config {mode}: no generation_config.json in that directory")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"--generation-config: {path} is not JSON ({e})") from None
    return {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULT_KEYS.items() if raw.get(theirs) is not None}


def check_priority(state, req) -> None:
    """A request's `priority` only orders requests under `--scheduling-policy priority`; on any
    other server it would be ignored, so it is refused (vLLM's rule)."""
    priority = getattr(req, "priority", 0) or 0
    policy = state.engine.config.scheduler.scheduling_policy
    if priority != 0 and policy != "priority":
        raise APIError(f"priority is only honoured with --scheduling-policy priority; this server "
                       f"schedules by {policy!r}: leave priority out or 0", param="priority", code=PRIORITY_CODE)


def structured_outputs(constraint: dict | None):
    """`StructuredOutputsParams(**constraint)`, or None without one."""
    if constraint is None:
        return None
    from kvserve.sample.params import StructuredOutputsParams

    try:
        return StructuredOutputsParams(**constraint)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), code=INVALID_STRUCTURED_OUTPUT) from None


def sampling_params(req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                    constraint: dict | None = None, keep_special_tokens: bool = False,
                    defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the server's `generation_defaults`, for the sampling fields the request left out."""
    kw = req.sampling_kwargs()
    for name, value in (defaults or {}).items():     # (beams rank raw logprobs: no sampling defaults)
        if name != "max_tokens" and name not in kw and not kw.get("use_beam_search"):
            kw[name] = value
    kw["max_tokens"] = max_tokens
    kw["min_tokens"] = min(kw["min_tokens"], max_tokens)    # the one token echo scoring discards
    kw["logprobs"] = logprobs
    kw["prompt_logprobs"] = prompt_logprobs
    if req.include_stop_str_in_output:
        kw["include_stop_str_in_output"] = True
    if keep_special_tokens:
        kw["skip_special_tokens"] = False       # a tool parser's markers may be special tokens
    structured = structured_outputs(constraint)
    if structured is not None:
        kw["structured_outputs"] = structured
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        fields = sorted(type(req).model_fields, key=len, reverse=True)
        raise APIError(str(e), param=next((f for f in fields if str(e).startswith(f)), None),
                       code=SAMPLING_RULE_CODE) from None
