"""An embed server's engine core (`kvserve serve --task embed`), so that the server's usual
plumbing (server/app.py's build_app: auth, errors, /health, /v1/models, /metrics, limits) serves
an embedding model instead of a generating engine.

`EmbeddingCore` is what `CoreClient.in_thread` and the core loop (engine/core_loop.py) need of an
EngineCore -- config, tokenizer, limits, stats -- with no generation: it never has work and
refuses a request that reaches it. Its stats are the batcher's (batcher.py): prompts waiting and
running, prompt tokens, forward passes. server/openai/embeddings.py's EmbeddingClient is its CoreClient.
"""
from __future__ import annotations

import dataclasses

from kvserve.config.resolved import resolve_config
from kvserve.engine.core_io import CoreLimits
from kvserve.engine.stats import EngineStats

NOT_GENERATING = ("this server serves embeddings (kvserve serve --task embed): it does not generate "
                  "text; POST /v1/embeddings, or start a server with --task generate")


class EmbeddingCore:
    def __init__(self, model, config):
        # the resolved Config, as an EngineCore holds it (config/resolved.py)
        self.config = resolve_config(dataclasses.replace(config, max_model_len=model.max_model_len,
                                                         dtype=str(model.dtype).removeprefix("torch.")),
                                     model.max_model_len)
        self.tokenizer = model.tokenizer
        self.limits = CoreLimits(model.vocab_size, model.max_model_len, config.max_num_seqs, 0,
                                 config.block_size, 0, getattr(model.tokenizer, "eos_token_id", None))
        self._stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)    # no KV pool; the batcher counts

    def stats(self) -> EngineStats:
        return self._stats

    def has_unfinished_requests(self) -> bool:
        return False

    def add_request(self, request) -> None:
        raise ValueError(NOT_GENERATING)

    def abort_request(self, request_id) -> None:
        pass

    def abort_sequence(self, request_id: str, index: int) -> None:
        pass

    def shutdown(self) -> None:
        pass
