"""LLMEngine: the step loop that ties the pieces of DESIGN.md's picture together.

    add_request -> Scheduler.schedule -> (block copies, swaps) -> ModelRunner.execute -> Sampler
    -> OutputProcessor

One `step()` is the same pipeline on every path, the empty step included: schedule under the
token budget -> run the block moves the KV cache manager queued (swap out, swap in, copy on
write; checked) -> one packed forward pass -> sample one token (or beam candidates) for every
sequence whose known tokens are all computed -> `Scheduler.update_from_output`, the one owner
of post-step transitions (appends, stops, forks, beam steps, the stall watchdog) -> a
RequestOutput for every request that changed; finished requests are retired at once.

Failures stay with their request: a sampler error is retried row by row and fails only the
row that raises; an output-processing error fails its request. Only a failing forward pass
(shared by everyone) propagates.

Sharing (issue 3): `SamplingParams(n > 1)` prefills the prompt once; when its first sample's
prompt is done, the other samples fork its block table and every sample draws its first token
from the same logits, with its own generator (seed + i), exactly as n separate requests would.
Beam search (`use_beam_search`) runs the beams as forked sequences (engine/beam_search.py).
Prompt logprobs (`prompt_logprobs`): the runner also returns the rows of the prompt positions a
request still needs, and the engine turns them into entries on the group's head
(engine/prompt_logprobs.py). Speculative decoding (`speculative_config`): kvserve/spec_decode/decoder.py.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.executor import TPDriverRunner, TPWorkers, build_rank_model
from kvserve.engine import prompt_logprobs
from kvserve.engine.kv_sizing import num_kv_blocks
from kvserve.worker.model_runner import ModelRunner, make_attention_backend
from kvserve.engine.output import OutputProcessor
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.fairness import PROMPT_FIELDS, make_policy, prompt_fields
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.stats import EngineStats, collect_stats
from kvserve.kv.connector import TieredConnector
from kvserve.kv.manager import KVCacheManager, cdiv
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model_dir
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput, logprob_entry
from kvserve.sample.params import SamplingParams
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.decoder import SpecDecoder

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        # A GGUF file's tensors load in their own types unless quantization="dequant" asks for
        # the model dtype (int8 / int4 then requantize, matrix by matrix: fusion.linear_weight).
        model_cfg, weights, self.tokenizer = load_model_dir(
            config.model, native=config.quantization != "dequant", dtype=config.torch_dtype,
            device=self.device)
        self.model_config = model_cfg
        if config.dtype == "auto":
            config.dtype = "float32"
        max_len = config.max_model_len or model_cfg.max_position_embeddings
        if max_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"max_position_embeddings {model_cfg.max_position_embeddings}.")
        config.max_model_len = max_len
        tp = config.tensor_parallel_size
        if tp > 1:      # this process is rank 0 of tp (kvserve/distributed/): its slice, then the workers
            self.model = build_rank_model(config, model_cfg, weights, 0, tp, self.device)
            self.tp_workers = TPWorkers(config, tp, config.distributed_executor_backend)
        else:
            attn = make_attention_backend(model_cfg, config.block_size, config.kv_cache_dtype)
            self.model = LlamaModel(model_cfg, weights, attn, self.device, config.torch_dtype,
                                    config.quantization, config.quantization_group_size,
                                    quantize_activations=config.quantize_activations)
        del weights
        num_blocks = num_kv_blocks(config, self.model.cfg, model_cfg, self.device)
        per_block = ModelRunner.kv_bytes_per_block(self.model.cfg, config.block_size, config.torch_dtype,
                                                   config.kv_cache_dtype)     # this rank's KV heads
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %d bytes/token",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    config.kv_cache_dtype, per_block // config.block_size)
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = min(config.swap_space // per_block, 4 * num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_cache=config.prefix_cache_kind,
                                 cache_namespace=f"{config.model}|{config.dtype}|{config.kv_cache_dtype}",
                                 num_cpu_blocks=num_cpu_blocks, kv_connector=TieredConnector.from_config(config))
        self.runner = (TPDriverRunner(self.model, num_blocks, config.block_size, self.tp_workers) if tp > 1
                       else ModelRunner(self.model, num_blocks, config.block_size))
        self.runner.init_swap_space(num_cpu_blocks)
        if self.kv.connector is not None:            # KV tiers: saves/loads run in the runner
            self.kv.connector.attach_runner(self.runner)
        self.sampler = Sampler(model_cfg.vocab_size, self.device, config.seed)
        self.output = OutputProcessor(self.tokenizer, max_len)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = model_cfg.eos_token_id[0] if isinstance(model_cfg.eos_token_id, list) else model_cfg.eos_token_id
        self.eos_token_id = eos
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   watermark_blocks=int(config.watermark * num_blocks),
                                   preemption_mode=config.preemption_mode,
                                   cache_aware=config.use_cache_aware_scheduling,
                                   max_wait_steps=config.max_wait_steps,
                                   preemption_warn_threshold=config.preemption_warn_threshold,
                                   stop_checker=self.output.process_token,
                                   eos_token_id=eos, max_model_len=max_len,
                                   **SpecDecoder.scheduler_kwargs(config.speculative))
        self.scheduler.policy = make_policy(config.scheduling_policy)     # engine/fairness.py
        self.spec = SpecDecoder(config.speculative, self) if config.speculative is not None else None
        self.groups: dict[str, list[Request]] = {}      # user request id -> its sequences
        self.prompts: dict[str, str | None] = {}
        self._arrivals = itertools.count()
        self._stats = EngineStats(0, 0, 0.0, num_blocks, num_blocks, 0, 0, 0,
                                  kv_cache_dtype=config.kv_cache_dtype,
                                  kv_bytes_per_token=per_block // config.block_size,
                                  num_kv_tokens=num_blocks * config.block_size)
        # For tools that need whole distributions (`kvserve perplexity --kl-divergence`): called
        # as hook(request, first position, raw logits [r, V]) for every prompt-logprob chunk.
        self.prompt_logprobs_hook = None

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError, changing nothing, on bad input.
        `cache_salt` (or a prompt dict's "cache_salt") scopes prefix-cache sharing: only
        requests with the same salt can hit each other's blocks."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams.")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the engine.")
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string.")
        prompt_text, token_ids = self._tokenize(prompt, prompt_text)
        self._validate(token_ids, params)
        fair = prompt_fields(prompt)       # priority, tenant, tenant_weight (engine/fairness.py)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seq = next(self._arrivals)

        def new_seq(seq_id: str, index: int = 0, seed: int | None = None) -> Request:
            return Request(seq_id, token_ids, params, arrival, eos_token_id=self.eos_token_id,
                           parent_id=request_id, index=index, seed=seed, cache_salt=cache_salt,
                           arrival_seq=seq, **fair)

        self.prompts[request_id] = prompt_text
        if params.use_beam_search:
            head = new_seq(f"{request_id}#beam0")
            prompt_logprobs.start(head)
            group = BeamGroup(request_id, params.beam_width, params.n, params.length_penalty, head, [head])
            self.groups[request_id] = group.live
            self.scheduler.add_beam_group(group)
            return
        seqs = [new_seq(request_id if params.n == 1 else f"{request_id}#{i}", i,
                        None if params.seed is None else params.seed + i) for i in range(params.n)]
        self.groups[request_id] = seqs
        prompt_logprobs.start(seqs[0])
        for r in seqs:
            self.output.start(r)
        if self.config.share_blocks:
            self.scheduler.add_samples(seqs)
        else:
            for r in seqs:
                self.scheduler.add(r)

    def _validate(self, token_ids: list, params: SamplingParams) -> None:
        n_prompt, max_len = len(token_ids), self.config.max_model_len
        if n_prompt == 0:
            raise ValueError("the prompt is empty: give at least one token.")
        if n_prompt >= max_len:
            raise ValueError(f"the prompt has {n_prompt} tokens, but max_model_len is {max_len}: "
                             "shorten the prompt or raise max_model_len.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab}).")
        if hasattr(params, "verify_for_model"):
            params.verify_for_model(vocab)
        seats = params.beam_width if params.use_beam_search else params.n
        if seats > self.config.max_num_seqs:
            what = "beam_width" if params.use_beam_search else "n"
            raise ValueError(f"{what}={seats} needs {seats} sequences at once but max_num_seqs is "
                             f"{self.config.max_num_seqs}: lower {what} or raise max_num_seqs.")
        num_blocks, bs = self.kv.pool.num_blocks, self.config.block_size
        need = cdiv(n_prompt + 1, bs)
        if need > num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the whole pool has "
                             f"{num_blocks}: raise kv_cache_memory / num_kv_blocks.")
        if params.use_beam_search:
            max_new = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
            need = params.beam_width * cdiv(min(n_prompt + max_new, max_len), bs)
            room = num_blocks - self.scheduler.watermark_blocks
            if need > room:
                raise ValueError(f"beam search with beam_width={params.beam_width} may need {need} KV "
                                 f"blocks but the pool has {room}: lower beam_width or max_tokens, "
                                 "or raise kv_cache_memory / num_kv_blocks.")

    def _tokenize(self, prompt, prompt_text):
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", *PROMPT_FIELDS}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}: a prompt dict has "
                                 "'prompt' or 'prompt_token_ids', and optionally 'cache_salt'.")
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
            for r in list(self.groups.get(rid, ())):
                if not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            self._retire_group(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    @property
    def requests(self) -> dict[str, Request]:
        """Every sequence of every unfinished request, by sequence id."""
        return {r.request_id: r for seqs in self.groups.values() for r in seqs}

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self.spec.propose(self.scheduler) if self.spec else None)
        ops = self.kv.take_pending()                 # checked: no read after a write
        if ops:
            self.runner.apply_kv_ops(ops)
        samples, candidates = {}, {}
        if sched.scheduled:
            batch = [(req, n, self.kv.block_ids(req.request_id)) for req, n in sched.scheduled]
            bs = self.config.block_size
            for req, n, ids in batch:      # the hand-off's invariant: every token has a slot
                assert len(ids) * bs >= req.num_computed_tokens + n, f"{req} scheduled without slots"
            wanted = prompt_logprobs.wanted_rows(sched.scheduled)
            logits, samplers, prompt_rows = self.runner.execute(batch, wanted, sched.draft_tokens)
            logits, samplers, runs = (self.spec.verify(logits, samplers, sched.draft_tokens, self.sampler.generator,
                                                       self._piece) if sched.draft_tokens else (logits, samplers, {}))
            samples, candidates = self._sample(logits, samplers)
            samples.update(runs)
            self._record_prompt_logprobs(prompt_rows, samples)
        touched = self.scheduler.update_from_output(sched, samples, candidates)
        if self.config.kv_role == "prefill":     # the prompt's KV is in the shared store before its answer
            self.kv.connector.flush(self.runner)
        if self.spec is not None:
            self.spec.after_step(self.scheduler)
        outputs = [self._make_output(rid) for rid in touched if rid in self.groups]
        for out in outputs:
            if out.finished:
                self._retire_group(out.request_id)
        self._stats.num_steps += 1
        self._stats.step_time_total += time.perf_counter() - t0
        return outputs

    def _sample(self, logits: torch.Tensor, samplers: list[Request]) -> tuple[dict, dict]:
        """One token per sampling sequence (samples waiting to fork draw from their first
        sample's row with their own generators), or a beam's top candidates. Returns
        ({sequence id: token id or the exception that failed it}, {beam id: candidates})."""
        rows, reqs, candidates = [], [], {}
        for i, req in enumerate(samplers):
            if req.params.use_beam_search:
                candidates[req.request_id] = self._beam_candidates(logits[i], req.params.beam_width)
                continue
            for r in [req] + self.scheduler.fork_waiters.get(req.request_id, []):
                rows.append(i)
                reqs.append(r)
        samples: dict = {}
        if not reqs:
            return samples, candidates
        same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
        try:
            results = self.sampler(logits if same else logits[rows], reqs)
        except Exception:   # noqa: BLE001 -- find the row that fails; the others go on
            logger.exception("sampling failed; retrying row by row")
            results = []
            for row, r in zip(rows, reqs):
                try:
                    results += self.sampler(logits[row:row + 1], [r])
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        for r, res in zip(reqs, results):
            if isinstance(res, BaseException):
                samples[r.request_id] = res
                continue
            if r.logprobs is not None:
                r.logprobs.append(logprob_entry(res.token_id, res.logprob, res.rank, res.top, self._piece))
                r.cumulative_logprob += res.logprob
            samples[r.request_id] = res.token_id
        return samples, candidates

    def _record_prompt_logprobs(self, rows: list, samples: dict) -> None:
        """Turn prompt rows into prompt logprob entries (`prompt_logprobs_hook`, when set, sees
        the raw rows first). A failure fails its request alone, as a sampling error does."""
        for req, first, logits in rows:
            try:
                if self.prompt_logprobs_hook is not None:
                    self.prompt_logprobs_hook(req, first, logits)
                prompt_logprobs.record(req, first, logits, self._piece)
            except Exception as e:  # noqa: BLE001
                logger.exception("prompt logprobs failed for request %s", req.request_id)
                samples[req.request_id] = e

    @staticmethod
    def _beam_candidates(row: torch.Tensor, width: int) -> tuple[list[int], list[float]]:
        lp = torch.log_softmax(row.float(), dim=-1)
        top_lp, top_ids = lp.topk(min(2 * width, lp.shape[-1]))
        return top_ids.tolist(), top_lp.tolist()

    # -- outputs -----------------------------------------------------------------------------
    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.token_to_text(token_id) if self.tokenizer is not None else None

    def _make_output(self, request_id: str) -> RequestOutput:
        group = self.scheduler.beam_groups.get(request_id)
        if group is not None:
            return self._make_beam_output(group)
        seqs = self.groups[request_id]
        completions = []
        for r in seqs:
            completions.append(CompletionOutput(
                index=r.index, text=self.output.text(r), token_ids=r.output_token_ids,
                cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                logprobs=list(r.logprobs) if r.logprobs is not None else None,
                finish_reason=r.status.value if r.is_finished else None,
                stop_reason=r.stop_reason, error=r.error))
        head = seqs[0]
        return RequestOutput(request_id=request_id, prompt=self.prompts[request_id],
                             prompt_token_ids=head.prompt_token_ids, outputs=completions,
                             finished=all(r.is_finished for r in seqs), metrics=head.metrics,
                             num_cached_tokens=head.num_cached_tokens or 0,
                             prompt_logprobs=prompt_logprobs.snapshot(head))

    def _make_beam_output(self, group: BeamGroup) -> RequestOutput:
        completions = []
        for i, h in enumerate(group.best(group.n) if group.finished else []):
            text = self.tokenizer.decode(h.token_ids) if self.tokenizer is not None else ""
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
                logprobs=[{t: Logprob(lp)} for t, lp in zip(h.token_ids, h.logprobs)],
                finish_reason=h.finish_reason, stop_reason=h.stop_reason))
        head = group.head
        if group.finished and not completions:    # failed before any hypothesis: say why
            completions.append(CompletionOutput(index=0, text="", token_ids=[],
                                                finish_reason=head.status.value, error=head.error))
        return RequestOutput(request_id=group.request_id, prompt=self.prompts[group.request_id],
                             prompt_token_ids=head.prompt_token_ids, outputs=completions,
                             finished=group.finished, metrics=head.metrics,
                             num_cached_tokens=head.num_cached_tokens or 0,
                             prompt_logprobs=prompt_logprobs.snapshot(head))

    def _retire_group(self, request_id: str) -> None:
        for r in self.groups.pop(request_id, ()):
            self.output.drop(r)
        self.prompts.pop(request_id, None)
        self.scheduler.beam_groups.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if getattr(self, "tp_workers", None) is not None:
            self.tp_workers.close()
        if getattr(self, "kv", None) is not None and self.kv.connector is not None:
            self.kv.connector.close(self.runner)     # pending saves, then the disk writer

    def stats(self) -> EngineStats:
        return collect_stats(self)

    def check_integrity(self) -> None:
        """No leaked block, no lost request: pool and refcounts, the scheduler's queues against
        the statuses and the KV manager's tables, and every registered request unfinished."""
        self.kv.check_integrity()
        self.scheduler.check_integrity()
        if self.spec is not None:
            self.spec.check_integrity(self.scheduler)
        for rid, seqs in self.groups.items():
            assert any(not r.is_finished for r in seqs), f"request {rid} finished but is still registered"
