"""LLMEngine: the in-process engine, vLLM's shape: Processor -> EngineCore -> OutputProcessor.

`add_request` tokenizes and checks (frontend/processor.py) and hands token ids to the core;
`step` runs one core step (engine/engine_core.py: token deltas out) and turns its deltas into
RequestOutputs (frontend/output_processor.py), aborting in the core every sequence whose stop
string it found. `LLM` runs on it; the server uses the same three pieces with the core in a
thread or a process of its own (server/core_client.py).
"""
from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.frontend.output_processor import OutputProcessor
from kvserve.frontend.processor import Processor
from kvserve.outputs import RequestOutput
from kvserve.sample.params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, output_kind: str = "cumulative"):
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.processor = Processor(self.tokenizer, self.core.limits)
        self.output = OutputProcessor(self.tokenizer)
        self.output_kind = output_kind

    # The core's parts, for tools and tests that look inside (read them, never write them).
    config = property(lambda self: self.core.config)
    model = property(lambda self: self.core.model)
    model_config = property(lambda self: self.core.model_config)
    kv = property(lambda self: self.core.kv)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    requests = property(lambda self: self.core.requests)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError, changing nothing, on bad input.
        `cache_salt` (or a prompt dict's "cache_salt") scopes prefix-cache sharing: only
        requests with the same salt can hit each other's blocks."""
        if request_id in self.output.requests or request_id in self.core.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine.")
        req, text = self.processor.process(request_id, prompt, params, arrival_time, prompt_text, cache_salt)
        self.output.add_request(request_id, text, req.prompt_token_ids, req.params, req.arrival_time,
                                self.output_kind)
        try:
            self.core.add_request(req)
        except BaseException:
            self.output.abort(request_id)
            raise

    def step(self) -> list[RequestOutput]:
        outputs, stops, _ = self.output.process(self.core.step())
        for rid, index in stops:
            self.core.abort_sequence(rid, index)
        return outputs

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests by user id: every sequence is finished and its blocks freed."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.output.abort(rid)
        self.core.abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output.has_unfinished() or self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output.requests)

    def stats(self):
        return self.core.stats()

    def check_integrity(self) -> None:
        """The core's invariants (engine/engine_core.py), and no request lost between the two
        halves: every request the core holds, the frontend is still waiting for."""
        self.core.check_integrity()
        lost = set(self.core.groups) - set(self.output.requests)
        assert not lost, f"requests {sorted(lost)} are in the core but not in the frontend"

    def shutdown(self) -> None:
        self.core.shutdown()
