"""LLMEngine: the step loop that ties the pieces of DESIGN.md's picture together.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Sampler -> OutputProcessor

One `step()` schedules under the token budget, runs one packed forward pass, samples one token
for every sequence whose prompt is complete, appends it, retires finished requests (freeing
their blocks at once) and returns a RequestOutput for every request that advanced.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner, make_attention_backend
from kvserve.engine.output import OutputProcessor
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model_dir
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sample.params import SamplingParams
from kvserve.sample.sampler import Sampler

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_steps: int = 0
    forward_time_total: float = 0.0
    step_time_total: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        model_cfg, weights, self.tokenizer = load_model_dir(config.model)
        self.model_config = model_cfg
        if config.dtype == "auto":
            config.dtype = "float32"
        max_len = config.max_model_len or model_cfg.max_position_embeddings
        if max_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"max_position_embeddings {model_cfg.max_position_embeddings}.")
        config.max_model_len = max_len
        attn = make_attention_backend(model_cfg, config.block_size)
        self.model = LlamaModel(model_cfg, weights, attn, self.device, config.torch_dtype)
        del weights
        num_blocks = self._num_kv_blocks()
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   watermark_blocks=int(config.watermark * num_blocks))
        self.sampler = Sampler(model_cfg.vocab_size, self.device, config.seed)
        self.output = OutputProcessor(self.tokenizer, max_len)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = model_cfg.eos_token_id[0] if isinstance(model_cfg.eos_token_id, list) else model_cfg.eos_token_id
        self.eos_token_id = eos
        self.requests: dict[str, Request] = {}          # sequence id -> Request
        self.groups: dict[str, list[Request]] = {}      # user request id -> its sequences (n)
        self.prompts: dict[str, str | None] = {}
        self._counter = itertools.count()
        self._stats = EngineStats(0, 0, 0.0, num_blocks, num_blocks, 0, 0, 0)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, cfg.block_size, cfg.torch_dtype)
        budget = cfg.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.9)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        # Never more than every seat filled to max_model_len needs.
        cap = cfg.max_num_seqs * cdiv(cfg.max_model_len, cfg.block_size) + 1
        n = min(budget // per_block, cap)
        if n < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {per_block} bytes.")
        return int(n)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError, changing nothing, on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams.")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine.")
        prompt_text, token_ids = self._tokenize(prompt, prompt_text)
        n_prompt = len(token_ids)
        max_len = self.config.max_model_len
        if n_prompt == 0:
            raise ValueError("the prompt is empty: give at least one token.")
        if n_prompt >= max_len:
            raise ValueError(f"the prompt has {n_prompt} tokens, but max_model_len is {max_len}: "
                             "shorten the prompt or raise max_model_len.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab}).")
        need = cdiv(n_prompt + 1, self.config.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the whole pool has "
                             f"{self.kv.pool.num_blocks}: raise kv_cache_memory / num_kv_blocks.")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            seqs.append(Request(seq_id, token_ids, params, arrival, eos_token_id=self.eos_token_id,
                                parent_id=request_id, index=i, seed=seed))
        self.groups[request_id] = seqs
        self.prompts[request_id] = prompt_text
        for r in seqs:
            self.requests[r.request_id] = r
            self.output.start(r)
            self.scheduler.add(r)

    def _tokenize(self, prompt, prompt_text):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompt_token_ids.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return prompt_text, list(prompt)
        raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}.")

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests by user id: every sequence is finished and its blocks freed."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for r in self.groups.get(rid, ()):
                if not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            self._retire_group(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs = self._retire_unfittable(sched.preempted)
        if sched.is_empty:
            return outputs
        batch = [(req, n, self.kv.block_ids(req.request_id)) for req, n in sched.scheduled]
        t1 = time.perf_counter()
        logits, samplers = self.runner.execute(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.scheduler.update_after_step(sched)
        results = self.sampler(logits, samplers) if samplers else []
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req, n in sched.scheduled:
            if req.num_computed_tokens == req.num_prompt_tokens and req.num_output_tokens == 0:
                self._stats.prompt_tokens_total += req.num_prompt_tokens
        for req, res in zip(samplers, results):
            req.token_ids.append(res.token_id)
            self._stats.generation_tokens_total += 1
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.token_times.append(now)
            if req.logprobs is not None:
                entry = {res.token_id: Logprob(res.logprob, res.rank, self._piece(res.token_id))}
                for rank, (tid, lp) in enumerate(res.top or (), start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
                req.logprobs.append(entry)
                req.cumulative_logprob += res.logprob
            status = self.output.process_token(req, res.token_id)
            if status is not None:
                self.scheduler.finish(req, status)
                m.finished_time = now
            touched[req.parent_id] = None
        outputs += [self._make_output(rid) for rid in touched]
        for out in outputs:
            if out.finished:
                self._retire_group(out.request_id)
        self._stats.num_steps += 1
        self._stats.forward_time_total += t2 - t1
        self._stats.step_time_total += time.perf_counter() - t0
        return outputs

    def _retire_unfittable(self, preempted: list[Request]) -> list[RequestOutput]:
        """A sequence preempted because it alone outgrew the whole pool can never run again:
        finish it with "length" instead of preempting it forever."""
        capacity = self.kv.pool.num_blocks * self.config.block_size
        outs = []
        for req in preempted:
            if req.num_tokens + 1 > capacity and not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                req.metrics.finished_time = time.monotonic()
                if all(r.is_finished for r in self.groups[req.parent_id]):
                    outs.append(self._make_output(req.parent_id))
        return outs

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.token_to_text(token_id) if self.tokenizer is not None else None

    def _make_output(self, request_id: str) -> RequestOutput:
        seqs = self.groups[request_id]
        completions = []
        for r in seqs:
            completions.append(CompletionOutput(
                index=r.index, text=self.output.text(r), token_ids=r.output_token_ids,
                cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                logprobs=list(r.logprobs) if r.logprobs is not None else None,
                finish_reason=r.status.value if r.is_finished else None,
                stop_reason=r.stop_reason))
        head = seqs[0]
        return RequestOutput(request_id=request_id, prompt=self.prompts[request_id],
                             prompt_token_ids=head.prompt_token_ids, outputs=completions,
                             finished=all(r.is_finished for r in seqs), metrics=head.metrics,
                             num_cached_tokens=head.num_cached_tokens)

    def _retire_group(self, request_id: str) -> None:
        for r in self.groups.pop(request_id, ()):
            self.requests.pop(r.request_id, None)
            self.output.drop(r)
        self.prompts.pop(request_id, None)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.kv.pool.usage()
        s.num_free_blocks = self.kv.num_free_blocks
        s.num_total_blocks = self.kv.pool.num_blocks
        s.num_preemptions_total = self.scheduler.num_preemptions
        return EngineStats(**vars(s))

    def check_integrity(self) -> None:
        """No leaked block: pool integrity and refcounts == block tables holding each block."""
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running}
        assert set(self.kv.block_tables) <= live | {r.request_id for r in self.scheduler.waiting}, \
            "a finished request still holds blocks"
