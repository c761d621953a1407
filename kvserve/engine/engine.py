"""LLMEngine: the step loop that ties the pieces of DESIGN.md's picture together.

    add_request -> Scheduler.schedule -> (block copies, swaps) -> ModelRunner.execute -> Sampler
    -> OutputProcessor

One `step()` schedules under the token budget, runs the block moves the KV cache manager queued
(swap out, swap in, copy on write), runs one packed forward pass, samples one token for every
sequence whose prompt is complete, appends it, retires finished requests (freeing their blocks
at once) and returns a RequestOutput for every request that advanced.

Sharing (issue 3): `SamplingParams(n > 1)` prefills the prompt once; when its first sample's
prompt is done, the other samples fork its block table and every sample draws its first token
from the same logits, with its own generator (seed + i), exactly as n separate requests would.
Beam search (`use_beam_search`) runs the beams as forked sequences (engine/beam_search.py).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner, make_attention_backend
from kvserve.engine.output import OutputProcessor
from kvserve.engine.beam_search import BeamGroup, BeamHyp, beam_score
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
    prefix_cache_queries_total: int = 0    # tokens looked up at admission
    prefix_cache_hits_total: int = 0       # of which served from the cache
    prefix_cache_eligible_total: int = 0   # of which could hit at all (block-size floor, last-token cap)
    num_cached_blocks: int = 0             # blocks labelled in the prefix cache (in use or free)
    num_used_blocks: int = 0               # blocks held by at least one sequence
    num_evictions_total: int = 0           # cached blocks reused for new contents
    num_cow_copies_total: int = 0          # shared blocks copied because a sequence wrote into them
    num_partial_block_copies_total: int = 0  # radix hits on a partial block (copied)
    num_logical_blocks: int = 0            # blocks in all block tables: what no sharing would use
    num_swapped: int = 0                   # sequences in the CPU swap space
    num_swap_preemptions_total: int = 0
    num_swap_out_blocks_total: int = 0
    num_swap_in_blocks_total: int = 0
    num_repeatedly_preempted_total: int = 0  # sequences preempted preemption_warn_threshold times
    max_preemptions_per_request: int = 0
    num_steps: int = 0
    forward_time_total: float = 0.0        # seconds inside the model's forward pass
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
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            per_block = ModelRunner.kv_bytes_per_block(model_cfg, config.block_size, config.torch_dtype)
            num_cpu_blocks = min(config.swap_space // per_block, 4 * num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_cache=config.prefix_cache_kind,
                                 cache_namespace=f"{config.model}|{config.dtype}",
                                 num_cpu_blocks=num_cpu_blocks)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        self.runner.init_swap_space(num_cpu_blocks)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   watermark_blocks=int(config.watermark * num_blocks),
                                   preemption_mode=config.preemption_mode,
                                   cache_aware=config.use_cache_aware_scheduling,
                                   max_wait_steps=config.max_wait_steps,
                                   preemption_warn_threshold=config.preemption_warn_threshold)
        self.sampler = Sampler(model_cfg.vocab_size, self.device, config.seed)
        self.output = OutputProcessor(self.tokenizer, max_len)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = model_cfg.eos_token_id[0] if isinstance(model_cfg.eos_token_id, list) else model_cfg.eos_token_id
        self.eos_token_id = eos
        self.requests: dict[str, Request] = {}          # sequence id -> Request
        self.groups: dict[str, list[Request]] = {}      # user request id -> its sequences (n)
        self.prompts: dict[str, str | None] = {}
        self.beam_groups: dict[str, BeamGroup] = {}
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
        if params.use_beam_search:
            bs = self.config.block_size
            max_new = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
            need = params.beam_width * cdiv(min(n_prompt + max_new, max_len), bs)
            room = self.kv.pool.num_blocks - self.scheduler.watermark_blocks
            if need > room:
                raise ValueError(f"beam search with beam_width={params.beam_width} may need {need} KV "
                                 f"blocks but the pool has {room}: lower beam_width or max_tokens, "
                                 "or raise kv_cache_memory / num_kv_blocks.")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.use_beam_search:
            head = Request(f"{request_id}#beam{next(self._counter)}", token_ids, params, arrival,
                           eos_token_id=self.eos_token_id, parent_id=request_id, cache_salt=cache_salt)
            head.extra_seats = params.beam_width - 1
            group = BeamGroup(request_id, params.beam_width, params.n, params.length_penalty, head, [head])
            self.beam_groups[request_id] = group
            self.groups[request_id] = group.live
            self.prompts[request_id] = prompt_text
            self.requests[head.request_id] = head
            self.scheduler.add(head)
            return
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            seqs.append(Request(seq_id, token_ids, params, arrival, eos_token_id=self.eos_token_id,
                                parent_id=request_id, index=i, seed=seed, cache_salt=cache_salt))
        self.groups[request_id] = seqs
        self.prompts[request_id] = prompt_text
        share = self.config.share_blocks and len(seqs) > 1
        for r in seqs:
            self.requests[r.request_id] = r
            self.output.start(r)
            if share and r is not seqs[0]:
                r.fork_parent = seqs[0]          # forks the first sample's blocks after its prefill
                seqs[0].pending_forks.append(r)
            else:
                self.scheduler.add(r)
        if share:
            seqs[0].extra_seats = len(seqs) - 1

    def _tokenize(self, prompt, prompt_text):
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
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

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        ops = self.kv.take_pending()
        if ops:
            self.runner.apply_kv_ops(ops)
        outputs = self._retire_unfittable(sched.preempted)
        if sched.is_empty:
            return outputs
        batch = [(req, n, self.kv.block_ids(req.request_id)) for req, n in sched.scheduled]
        logits, samplers = self.runner.execute(batch)
        self.scheduler.update_after_step(sched)
        # Rows to sample: one per sequence, plus one per sample forked off a finished prefill
        # (they draw from the same logits with their own generators); beams propose candidates.
        rows, sample_reqs, beams = [], [], {}
        for i, req in enumerate(samplers):
            group = self.beam_groups.get(req.parent_id)
            if group is not None:
                req.beam_candidates = self._beam_candidates(logits[i], group.width)
                beams[req.parent_id] = group
                continue
            rows.append(i)
            sample_reqs.append(req)
            for child in req.pending_forks:
                self.scheduler.fork(req, child)
                rows.append(i)
                sample_reqs.append(child)
            req.pending_forks = []
            req.extra_seats = 0
        results = []
        if sample_reqs:
            same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            results = self.sampler(logits if same else logits[rows], sample_reqs)
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req, n in sched.scheduled:
            if req.num_computed_tokens == req.num_prompt_tokens and req.num_output_tokens == 0:
                self._stats.prompt_tokens_total += req.num_prompt_tokens
        for req, res in zip(sample_reqs, results):
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
        for rid, group in beams.items():
            if group.ready():
                self._beam_step(group, now)
                if group.finished:
                    touched[rid] = None
        outputs += [self._make_output(rid) for rid in touched]
        for out in outputs:
            if out.finished:
                self._retire_group(out.request_id)
        self._stats.num_steps += 1
        self._stats.step_time_total += time.perf_counter() - t0
        return outputs

    # -- beam search -------------------------------------------------------------------------
    @staticmethod
    def _beam_candidates(row: torch.Tensor, width: int) -> tuple[list[int], list[float]]:
        lp = torch.log_softmax(row.float(), dim=-1)
        top_lp, top_ids = lp.topk(min(2 * width, lp.shape[-1]))
        return top_ids.tolist(), top_lp.tolist()

    def _beam_step(self, group: BeamGroup, now: float) -> None:
        """Every live beam proposed its candidates: keep the best `width`, fork or prune."""
        live = group.live
        p = live[0].params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos and self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        lp_pen, max_len = group.length_penalty, self.config.max_model_len
        cands = []
        for bi, beam in enumerate(live):
            ids, lps = beam.beam_candidates
            hist = group.beam_logprobs.get(beam.request_id, [])
            for tid, lp in zip(ids, lps):
                cum = beam.cumulative_logprob + lp
                seq_len = beam.num_tokens + 1
                if tid in stops:
                    group.completed.append(BeamHyp(
                        beam.output_token_ids + [tid], hist + [lp], cum,
                        beam_score(seq_len, cum, tid == self.eos_token_id, lp_pen), "stop",
                        None if tid == self.eos_token_id else tid))
                else:
                    cands.append((beam_score(seq_len, cum, False, lp_pen), bi, tid, lp, cum))
        cands.sort(key=lambda c: -c[0])          # stable: beam order, then token rank
        cont = []
        for score, bi, tid, lp, cum in cands[:group.width]:
            beam = live[bi]
            n_out = beam.num_output_tokens + 1
            if (p.max_tokens is not None and n_out >= p.max_tokens) or beam.num_tokens + 1 >= max_len:
                hist = group.beam_logprobs.get(beam.request_id, [])
                group.completed.append(BeamHyp(beam.output_token_ids + [tid], hist + [lp], cum, score, "length"))
            else:
                cont.append((bi, tid, lp, cum))
        # Forks first (from the parents' unmodified state), then the survivors append.
        claimed: set[int] = set()
        targets = []
        for bi, tid, lp, cum in cont:
            parent = live[bi]
            if bi not in claimed:
                claimed.add(bi)
                targets.append((parent, tid, lp, cum))
                continue
            child = Request(f"{group.request_id}#beam{next(self._counter)}", parent.prompt_token_ids,
                            parent.params, parent.arrival_time, eos_token_id=self.eos_token_id,
                            parent_id=group.request_id, cache_salt=parent.cache_salt)
            child.token_ids = list(parent.token_ids)
            child.cumulative_logprob = parent.cumulative_logprob
            child.metrics.first_token_time = parent.metrics.first_token_time
            group.beam_logprobs[child.request_id] = list(group.beam_logprobs.get(parent.request_id, []))
            self.requests[child.request_id] = child
            self.scheduler.fork(parent, child)
            targets.append((child, tid, lp, cum))
        for bi, beam in enumerate(live):
            if bi not in claimed:                 # pruned: no survivor
                self.scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(beam.request_id, None)
                group.beam_logprobs.pop(beam.request_id, None)
        new_live = []
        for req, tid, lp, cum in targets:
            req.token_ids.append(tid)
            req.cumulative_logprob = cum
            req.beam_candidates = None
            req.extra_seats = 0
            group.beam_logprobs.setdefault(req.request_id, []).append(lp)
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.token_times.append(now)
            self._stats.generation_tokens_total += 1
            new_live.append(req)
        live[:] = new_live
        if group.finished:
            group.head.metrics.finished_time = now

    def _make_beam_output(self, request_id: str) -> RequestOutput:
        group = self.beam_groups[request_id]
        completions = []
        for i, h in enumerate(group.best(group.n) if group.finished else []):
            text = self.tokenizer.decode(h.token_ids) if self.tokenizer is not None else ""
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
                logprobs=[{t: Logprob(lp)} for t, lp in zip(h.token_ids, h.logprobs)],
                finish_reason=h.finish_reason, stop_reason=h.stop_reason))
        head = group.head
        return RequestOutput(request_id=request_id, prompt=self.prompts[request_id],
                             prompt_token_ids=head.prompt_token_ids, outputs=completions,
                             finished=group.finished, metrics=head.metrics,
                             num_cached_tokens=head.num_cached_tokens)

    def _retire_unfittable(self, preempted: list[Request]) -> list[RequestOutput]:
        """A sequence preempted because it alone outgrew the whole pool can never run again:
        finish it with "length" instead of preempting it forever."""
        capacity = self.kv.pool.num_blocks * self.config.block_size
        outs = []
        for req in preempted:
            if req.num_tokens + 1 > capacity and not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                req.metrics.finished_time = time.monotonic()
                if req.parent_id in self.beam_groups:
                    continue      # cannot happen: add_request sizes the pool for the beams
                if all(r.is_finished for r in self.groups[req.parent_id]):
                    outs.append(self._make_output(req.parent_id))
        return outs

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.token_to_text(token_id) if self.tokenizer is not None else None

    def _make_output(self, request_id: str) -> RequestOutput:
        if request_id in self.beam_groups:
            return self._make_beam_output(request_id)
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
        self.beam_groups.pop(request_id, None)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_cache_usage = self.kv.pool.usage()
        s.num_free_blocks = self.kv.num_free_blocks
        s.num_total_blocks = self.kv.pool.num_blocks
        s.num_preemptions_total = self.scheduler.num_preemptions
        s.forward_time_total = self.runner.forward_time_total   # inside the model's forward
        kv, sched = self.kv, self.scheduler
        s.prefix_cache_queries_total = kv.stats.prefix_cache_queries
        s.prefix_cache_hits_total = kv.stats.prefix_cache_hits
        s.prefix_cache_eligible_total = kv.stats.prefix_cache_eligible
        s.num_cached_blocks = kv.num_cached_blocks
        s.num_used_blocks = kv.pool.num_used_blocks
        s.num_evictions_total = kv.pool.num_evictions
        s.num_cow_copies_total = kv.stats.cow_copies
        s.num_partial_block_copies_total = kv.stats.partial_copies
        s.num_logical_blocks = sum(len(t) for t in kv.block_tables.values())
        s.num_swapped = sched.num_swapped
        s.num_swap_preemptions_total = sched.num_swap_preemptions
        s.num_swap_out_blocks_total = kv.stats.swap_out_blocks
        s.num_swap_in_blocks_total = kv.stats.swap_in_blocks
        s.num_repeatedly_preempted_total = sched.num_repeatedly_preempted
        s.max_preemptions_per_request = sched.max_preemptions_per_request
        return EngineStats(**vars(s))

    def check_integrity(self) -> None:
        """No leaked block: pool integrity and refcounts == block tables holding each block."""
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running}
        assert set(self.kv.block_tables) <= live | {r.request_id for r in self.scheduler.waiting}, \
            "a finished request still holds blocks"
        swapped = {r.request_id for g in self.scheduler.swapped for r in g}
        assert set(self.kv.swapped_tables) == swapped, "swap space out of sync with swapped requests"
