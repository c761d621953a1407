"""Bounds on the work one HTTP request can cause, checked before the work is done.

- The served `max_model_len` is the core's (`CoreLimits.max_model_len`, engine/engine_core.py):
  what the KV pool can hold when that is less than the model's context (`--num-kv-blocks 24
  --block-size 16` is 384 tokens), with a warning, so that `/v1/models` never advertises a
  context that no request could use and a request asking for more is refused with 400 up front
  instead of stopping short with `finish_reason: "length"`. (vLLM refuses to start instead; a
  small pool is a legitimate setting -- tests, small devices -- so kvserve serves what fits and
  says so, the same number in the server, the frontend's checks and the scheduler.)
- At most `max_prompts_per_request` prompts in one `/v1/completions` body (vLLM has no such
  limit; `--max-prompts-per-request`, default 1024), and never more than `--max-waiting`, which
  such a batch could never fit under (400, not a 503 that retrying cannot cure).
- List fields are counted before pydantic looks at their items (`check_list_lengths`): a
  4-million-entry `stop_token_ids` costs a `len()`, not a validation pass.
- A token-id prompt is held to the frontend's context rule before pydantic reads it. Text is
  bounded and tokenized by the frontend (frontend/tokenization.py: refused by its UTF-8 length
  before it is tokenized, tokenized off the event loop); the server turns the frontend's
  `ContextLengthError` into OpenAI's 400 (`context_error`) and formats nothing else about it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.core_io import CoreLimits
from kvserve.frontend.processor import ContextLengthError, context_max_tokens
from kvserve.server.openai.protocol import LIST_FIELD_LIMITS, APIError

DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
ADD_CHUNK = 64                  # engine requests queued per turn of the event loop


def context_error(e: ContextLengthError) -> APIError:
    """The frontend's refusal of a request that does not fit the served context (its one rule,
    frontend/processor.py), as OpenAI's 400."""
    return APIError(str(e), param=e.param, code="context_length_exceeded")


@dataclass
class ServerLimits:
    core: CoreLimits                # the served context and pool (the frontend checks against them)
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_waiting: int | None = None

    def __post_init__(self):
        if self.max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}.")

    def check_list_lengths(self, obj: dict) -> None:
        """Cheap checks on the raw JSON object, before pydantic validates any list item."""
        for name, limit in LIST_FIELD_LIMITS.items():
            v = obj.get(name)
            if isinstance(v, (list, dict)) and len(v) > limit:
                raise APIError(f"{name}: at most {limit} items, got {len(v)}", param=name)
        prompt = obj.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return
        if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            lists = [prompt]                        # one prompt of token ids
        else:
            self.check_num_prompts(len(prompt))
            lists = [p for p in prompt if isinstance(p, list)]
        for ids in lists:           # the frontend's context rule on the prompt alone
            try:
                context_max_tokens(self.core, len(ids), None)
            except ContextLengthError as e:
                raise context_error(e) from None

    def check_num_prompts(self, n: int) -> None:
        if n > self.max_prompts_per_request:
            raise APIError(f"prompt: at most {self.max_prompts_per_request} prompts per request "
                           f"(--max-prompts-per-request), got {n}", param="prompt",
                           code="too_many_prompts")
        if self.max_waiting is not None and n > self.max_waiting:
            raise APIError(f"prompt: {n} prompts can never fit in the waiting queue of "
                           f"{self.max_waiting} (--max-waiting): send fewer per request", param="prompt",
                           code="too_many_prompts")
