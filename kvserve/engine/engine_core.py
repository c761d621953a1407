"""EngineCore: the step loop of DESIGN.md's picture, on token ids only.

    add_request -> Scheduler.schedule (a StepPlan) -> WorkerView.build (the step as data: a
    SchedulerOutput) -> (block copies, swaps) -> ModelRunner.execute_model (forward, then its
    StepSampler) -> Scheduler.update_from_output -> EngineCoreOutputs (token deltas)

One `step()` is the same pipeline on every path, the empty step included: schedule under the
token budget -> run the block moves the KV cache manager queued (swap out, swap in, copy on
write; checked) -> one packed forward pass -> sample one token (or beam candidates, or verify
drafts) for every sequence whose known tokens are all computed, as a typed ModelRunnerOutput
(worker/sampling.py) -> `Scheduler.update_from_output`, the one writer of requests after a
step (appends, token stops, forks, beam steps, the stall watchdog) -> one EngineCoreOutput per
user request that changed, holding only that step's new tokens (engine/core_io.py); finished
requests are retired at once. The core never sees text: tokenizing, stop strings and
detokenizing are the frontend's (kvserve/frontend/), which aborts a sequence whose stop string
it found (`abort_sequence`).

Failures stay with their request: a sampler error fails only the row that raises. Only a
failing forward pass (shared by everyone) propagates.

Sharing (issue 3): `SamplingParams(n > 1)` prefills the prompt once; when its first sample's
prompt is done, the other samples fork its block table and every sample draws its first token
from the same logits, with its own generator (seed + i), exactly as n separate requests would.
Beam search (`use_beam_search`) runs the beams as forked sequences (engine/beam_search.py).
Speculative decoding (`speculative_config`): kvserve/spec_decode/decoder.py.
Structured outputs (`SamplingParams.structured_outputs`): a constrained request waits in
WAITING_FOR_GRAMMAR while a worker thread compiles its grammar (kvserve/structured/); each step
first queues those whose grammar is ready, each sequence with its own matcher, and fails those
whose compile failed or took longer than `max_grammar_compile_s`.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvserve.config import EngineConfig
from kvserve.distributed.executor import DriverRunner, Workers
from kvserve.distributed.pipeline import PipelineStage
from kvserve.engine.beam_search import BeamGroup
from kvserve.engine.core_io import (BeamResult, CoreLimits, EngineCoreOutput, EngineCoreRequest,
                                    SequenceDelta)
from kvserve.engine.fairness import make_policy
from kvserve.engine.kv_sizing import num_kv_blocks, served_context
from kvserve.engine.remote_kv import check_kv_transfer_side, kv_stream_side, stream_inbox
from kvserve.engine.request import GRAMMAR_ERROR, Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.stats import EngineStats, collect_stats
from kvserve.engine.worker_view import WorkerView
from kvserve.kv.block_io import store_scope
from kvserve.kv.connector import TieredConnector
from kvserve.kv.manager import KVCacheManager
from kvserve.spec_decode.decoder import SpecDecoder
from kvserve.spec_decode.draft import DraftTarget
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.waiting import GrammarWaitList
from kvserve.worker.build import build_model, load_and_resolve
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GRAMMAR_IDLE_WAIT_S = 0.01   # an engine with only grammars to wait for sleeps this long, not spins


class EngineCore:
    def __init__(self, config: EngineConfig):
        # Resolved once against the checkpoint (worker/build.py, config/resolved.py): every part of
        # the engine reads its section of the frozen Config; the caller's config is never written.
        r, loaded = load_and_resolve(config)      # the file is read once
        self.config = r            # the resolved Config: the flat EngineConfig goes no further
        self.device = r.model.device          # a name ("auto" decided): the worker makes the torch device
        tp, pp = r.parallel.tensor_parallel_size, r.parallel.pipeline_parallel_size
        # this process is rank 0 of tp, or stage 0 of pp (kvserve/distributed/): its part, then the workers
        built = build_model(r.model, r.cache.block_size, r.cache.kv_cache_dtype, self.device, tp_size=tp,
                            pp_size=pp, loaded=loaded, expert_parallel=r.parallel.enable_expert_parallel)
        del loaded
        self.model, self.model_config, self.tokenizer = built.model, built.config, built.tokenizer
        if pp > 1:      # (stage 0 holds the most layers: its KV sizes every stage's pool)
            self.model = PipelineStage(self.model, self.model.stage, r.parallel.pipeline_micro_batches)
        model_cfg = built.config
        self.workers = None
        if tp > 1 or pp > 1:
            self.workers = Workers(r, max(tp, pp), r.parallel.distributed_executor_backend)
        num_blocks = num_kv_blocks(r, self.model.cfg, model_cfg, self.device)
        per_block = ModelRunner.kv_bytes_per_block(self.model.cfg, r.cache.block_size, r.model.dtype,
                                                   r.cache.kv_cache_dtype)     # this rank's KV heads
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %d bytes/token",
                    num_blocks, r.cache.block_size, num_blocks * r.cache.block_size,
                    r.cache.kv_cache_dtype, per_block // r.cache.block_size)
        self.max_model_len = served_context(r, num_blocks)   # the frontend's, scheduler's and server's
        num_cpu_blocks = 0
        if r.scheduler.preemption_mode == "swap":
            num_cpu_blocks = min(r.cache.swap_space // per_block, 4 * num_blocks)
        scope = store_scope(r.model.model, r.model.dtype, r.cache.kv_cache_dtype, r.model.quantization,
                            r.model.quantization_group_size, r.cache.block_size)
        inbox = stream_inbox(r.tiers)            # PD decode side: streamed blocks, the top tier
        self.kv = KVCacheManager(num_blocks, r.cache.block_size, prefix_cache=r.cache.prefix_cache_kind,
                                 cache_namespace=f"{r.model.model}|{r.model.dtype}|{r.cache.kv_cache_dtype}",
                                 num_cpu_blocks=num_cpu_blocks, kv_connector=TieredConnector.from_specs(
                                     r.tiers.kv_tiers, r.cache.block_size, r.tiers.kv_tier_reload, scope, inbox))
        self.runner = (DriverRunner(self.model, num_blocks, r.cache.block_size, self.workers) if self.workers
                       else ModelRunner(self.model, num_blocks, r.cache.block_size))
        self.runner.init_swap_space(num_cpu_blocks)
        if self.kv.connector is not None:            # KV tiers: saves/loads run in the runner
            self.kv.connector.attach_runner(self.runner)
        # PD layer-wise KV streaming: the prefill side's StreamOut or the decode side's RemoteKVWaits
        self.kv_stream = kv_stream_side(r, self.runner, self.kv, inbox, scope)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = model_cfg.eos_token_id[0] if isinstance(model_cfg.eos_token_id, list) else model_cfg.eos_token_id
        self.eos_token_id = eos
        self.scheduler = Scheduler(self.kv, r.scheduler.max_num_batched_tokens, r.scheduler.max_num_seqs,
                                   watermark_blocks=int(r.scheduler.watermark * num_blocks),
                                   preemption_mode=r.scheduler.preemption_mode,
                                   cache_aware=r.scheduler.cache_aware_scheduling,
                                   max_wait_steps=r.scheduler.max_wait_steps,
                                   preemption_warn_threshold=r.scheduler.preemption_warn_threshold,
                                   eos_token_id=eos, max_model_len=self.max_model_len,
                                   **SpecDecoder.scheduler_kwargs(r.speculative))
        self.scheduler.policy = make_policy(r.scheduler.scheduling_policy)     # engine/fairness.py
        self.spec = None
        if r.speculative is not None:        # what a draft model needs of the target, not the engine
            self.spec = SpecDecoder(r.speculative, DraftTarget(
                r.model, config.attention_backend, r.cache.block_size, num_blocks, model_cfg.vocab_size,
                self.tokenizer))
        # the worker's sampling stage: logits never leave the runner (execute_model)
        self.runner.init_sampling(model_cfg.vocab_size, r.model.seed, self.spec)
        # Structured outputs: constrained requests wait here (WAITING_FOR_GRAMMAR) while a worker
        # thread compiles their grammar (kvserve/structured/)
        self.grammars = GrammarWaitList(GrammarCompiler(self.tokenizer, model_cfg.vocab_size, eos),
                                        r.structured_outputs.max_grammar_compile_s)
        self.worker_view = WorkerView()                 # what the worker holds (engine/worker_view.py)
        # --async-scheduling: the worker's steps run in turn on one thread of their own; the step
        # started ahead, while the previous one ran: (its plan, its future), or None
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="kvserve-worker")
                        if r.scheduler.async_scheduling else None)
        self._inflight = None
        self.groups: dict[str, list[Request]] = {}      # user request id -> its sequences
        self._finish_sent: dict[str, set[int]] = {}     # user request id -> samples whose end went out
        self._arrivals = itertools.count()
        self._stats = EngineStats(0, 0, 0.0, num_blocks, num_blocks, 0, 0, 0,
                                  kv_cache_dtype=r.cache.kv_cache_dtype,
                                  kv_bytes_per_token=per_block // r.cache.block_size,
                                  num_kv_tokens=num_blocks * r.cache.block_size)

    @property
    def limits(self) -> CoreLimits:
        """What the frontend checks a request against before it is sent (frontend/processor.py)."""
        r = self.config
        return CoreLimits(self.model_config.vocab_size, self.max_model_len, r.scheduler.max_num_seqs,
                          self.kv.pool.num_blocks, r.cache.block_size, self.scheduler.watermark_blocks,
                          self.eos_token_id, r.structured_outputs.max_grammar_compile_s,
                          *((s.role, s.address) if (s := self.kv_stream) is not None else ()))

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend has tokenized and checked (`CoreLimits`)."""
        rid, params = request.request_id, request.params
        if rid in self.groups:
            raise ValueError(f"request id {rid!r} is already in the engine.")
        seq = next(self._arrivals)

        def new_seq(seq_id: str, index: int = 0, seed: int | None = None) -> Request:
            return Request(seq_id, request.prompt_token_ids, params, request.arrival_time,
                           eos_token_id=self.eos_token_id, parent_id=rid, index=index, seed=seed,
                           cache_salt=request.cache_salt, arrival_seq=seq, priority=request.priority,
                           tenant=request.tenant, tenant_weight=request.tenant_weight,
                           group_head=index == 0)

        if params.use_beam_search:
            head = new_seq(f"{rid}#beam0")
            group = BeamGroup(rid, params.beam_width, params.n, params.length_penalty, head, [head])
            self.groups[rid] = group.live
            self.scheduler.add_beam_group(group)
            return
        seqs = [new_seq(rid if params.n == 1 else f"{rid}#{i}", i,
                        None if params.seed is None else params.seed + i) for i in range(params.n)]
        ktp = params.kv_transfer_params
        check_kv_transfer_side(self.kv_stream, ktp)
        self.groups[rid] = seqs
        if ktp is not None and self.kv_stream.add(rid, seqs, ktp):    # decode: queued once its KV is in
            return
        if params.structured_outputs is not None:      # queued once its grammar is compiled
            self.grammars.add(rid, seqs, params.structured_outputs)
            return
        self._enqueue(seqs)

    def _enqueue(self, seqs: list[Request]) -> None:
        """Queue a request's sequences (n > 1 samples share the prompt's blocks when allowed)."""
        if self.config.cache.share_blocks:
            self.scheduler.add_samples(seqs)
        else:
            for r in seqs:
                self.scheduler.add(r)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests by user id: every sequence is finished and its blocks freed."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for r in list(self.groups.get(rid, ())):
                if not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            self._retire(rid)

    def abort_sequence(self, request_id: str, index: int) -> None:
        """Sample `index` of a request ends (the frontend found its stop string): its blocks are
        freed; the request is retired once every sample has ended."""
        seqs = self.groups.get(request_id)
        if seqs is None or request_id in self.scheduler.beam_groups:
            return
        for r in seqs:
            if r.index == index and not r.is_finished:
                self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
        if all(r.is_finished for r in seqs):
            self._retire(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0 or bool(self.kv_stream)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    @property
    def requests(self) -> dict[str, Request]:
        """Every sequence of every unfinished request, by sequence id."""
        return {r.request_id: r for seqs in self.groups.values() for r in seqs}

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule, the forward pass and sampling (the worker), then the outputs.
        With async scheduling the worker runs on its own thread, and while it runs step N the
        next step is planned (`_ahead`); N's outputs are made while N + 1 runs."""
        t0 = time.perf_counter()
        if self._worker is None:
            ended, sched, so = self._plan()
            return self._finish(ended, sched, self.runner.execute_model(so), t0)
        if self._inflight is None:
            ended, sched, so = self._plan()
            running = self._submit(so)
        else:                                   # planned and started during the last call
            ended, (sched, running) = [], self._inflight
        self._inflight = self._ahead(sched)
        return self._finish(ended, sched, running.result(), t0)

    def _plan(self):
        """(requests that ended waiting for a grammar, the step's plan, its SchedulerOutput)."""
        if len(self.grammars) and not self.scheduler.has_unfinished():
            self.grammars.wait(GRAMMAR_IDLE_WAIT_S)    # nothing else to run: wait, do not spin
        ended = self._take_waiting()
        sched = self.scheduler.schedule(self.spec.propose(self.scheduler) if self.spec else None)
        if self.kv_stream is not None:          # prefill: the blocks it streams; decode: the admitted
            self.kv_stream.after_schedule(sched.scheduled, self.groups)
        ops = self.kv.take_pending()                 # checked: no read after a write
        if ops:
            self.runner.apply_kv_ops(ops)
        so = self.worker_view.build(sched, self.kv, self.scheduler)    # the step as data
        bs = self.config.cache.block_size
        for req, n in sched.scheduled:     # the hand-off's invariant: every token has a slot
            assert self.kv.num_held_blocks(req.request_id) * bs >= req.num_computed_tokens + n, \
                f"{req} scheduled without slots"
        return ended, sched, so

    def _submit(self, so, ops=None):
        """The step on the worker thread, after the one before it (and `ops`, copy-on-write
        copies of the slots it writes, before it)."""
        def run():
            if ops:
                self.runner.apply_kv_ops(ops)
            return self.runner.execute_model(so)
        return self._worker.submit(run)

    def _ahead(self, prev):
        """Async scheduling: the step after `prev` planned and started while `prev` runs, or
        None where it must wait for `prev` (Scheduler.schedule_ahead; the grammar wait list,
        KV tiers and speculation always wait)."""
        if len(self.grammars) or self.kv.connector is not None or self.spec is not None or self.kv_stream is not None:
            return None
        plan = self.scheduler.schedule_ahead(prev)
        if plan is None:
            return None
        ops = self.kv.take_pending()
        so = self.worker_view.build(plan, self.kv, self.scheduler, ahead=True)
        self._stats.num_async_steps += 1
        return plan, self._submit(so, ops)

    def _finish(self, ended: list[str], sched, result, t0: float) -> list[EngineCoreOutput]:
        """A step's result applied: the scheduler's update, the outputs, finished requests retired."""
        touched, deltas, prompt_entries = self.scheduler.update_from_output(sched, result)
        self.worker_view.note_sampled(result.sampled)
        if self.kv_stream is not None:
            self.kv_stream.after_step()
        if self.config.tiers.kv_role == "prefill" and self.kv.connector:   # the prompt's KV in the store first
            self.kv.connector.flush(self.runner)
        if self.spec is not None:
            self.spec.after_step(self.scheduler)
        now = time.monotonic()
        outputs = [self._output(rid, deltas, prompt_entries, now) for rid in ended + touched if rid in self.groups]
        for out in outputs:
            if out.finished:
                self._retire(out.request_id)
        self._stats.num_steps += 1
        self._stats.step_time_total += time.perf_counter() - t0
        return outputs

    def _take_waiting(self) -> list[str]:
        """Requests that waited off the queue join it: PD decode requests whose prompt's KV landed
        (or whose transfer failed: they compute it), constrained ones once their grammar is ready,
        each sequence with its own matcher (a failed or timed-out compile finishes them with the
        reason). Returns the ids of the requests that finished."""
        idle = not self.scheduler.has_unfinished() and not len(self.grammars)
        for rid, live in self.kv_stream.take_ready(idle) if self.kv_stream is not None else ():
            if (so := live[0].params.structured_outputs) is not None:
                self.grammars.add(rid, live, so)
            else:
                self._enqueue(live)
        ended = []
        for g in self.grammars.take_ready():
            live = [r for r in g.seqs if not r.is_finished]
            if g.error is not None:
                for r in live:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ERROR, g.error, GRAMMAR_ERROR)
                ended.append(g.request_id)
            elif live:
                self.scheduler.grammar_ready(live, g.compiled)
                self._enqueue(live)
        return ended

    def _output(self, rid: str, deltas: dict, prompt_entries: dict, now: float) -> EngineCoreOutput:
        """The step's delta of request `rid`: its sequences' new tokens, and each finish once."""
        group = self.scheduler.beam_groups.get(rid)
        seqs = self.groups[rid] if group is None else [group.head]
        head = seqs[0]
        out = EngineCoreOutput(rid, [], False, now, head.num_cached_tokens or 0,
                               head.metrics.first_scheduled_time,
                               prompt_entries.get(head.request_id))
        if group is not None:
            out.finished = group.finished
            if group.finished:
                out.beams = [BeamResult(h.token_ids, h.logprobs, h.cumulative_logprob, h.finish_reason,
                                        h.stop_reason) for h in group.best(group.n)]
                out.error = head.error if not out.beams else None
            return out
        sent = self._finish_sent.setdefault(rid, set())
        for r in seqs:
            d = deltas.get(r.request_id)
            if r.is_finished and r.index not in sent:
                sent.add(r.index)
                d = d or SequenceDelta(r.index)
                d.finish_reason, d.error, d.error_code = r.status.value, r.error, r.error_code
                d.stop_reason = r.stop_reason if isinstance(r.stop_reason, int) else None
            if d is not None:
                out.seqs.append(d)
        out.finished = all(r.is_finished for r in seqs)
        return out

    def _retire(self, request_id: str) -> None:
        self.grammars.discard(request_id)
        if self.kv_stream is not None:
            self.kv_stream.discard(request_id)
        self.groups.pop(request_id, None)
        self._finish_sent.pop(request_id, None)
        self.scheduler.beam_groups.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown(wait=True)         # the step started ahead runs out
            self._worker = None
        if getattr(self, "workers", None) is not None:
            self.workers.close()
        if getattr(self, "kv", None) is not None and self.kv.connector is not None:
            self.kv.connector.close(self.runner)     # pending saves, then the disk writer
        if getattr(self, "grammars", None) is not None:
            self.grammars.compiler.close()
        if getattr(self, "kv_stream", None) is not None:   # (the receiver's port, the sender's thread)
            self.kv_stream.close()

    def stats(self) -> EngineStats:
        return collect_stats(self)

    def check_integrity(self) -> None:
        """No leaked block, no lost request: pool and refcounts, the scheduler's queues against
        the statuses and the KV manager's tables, and every registered request unfinished."""
        self.kv.check_integrity()
        self.scheduler.check_integrity()
        live = {r.request_id for seqs in self.groups.values() for r in seqs if not r.is_finished}
        live |= {r.request_id for g in self.scheduler.beam_groups.values() for r in g.live}
        self.worker_view.check_integrity(live, self.scheduler.finished_seq_ids)
        if self.spec is not None:
            self.spec.check_integrity(self.scheduler)
        for rid, seqs in self.groups.items():
            assert any(not r.is_finished for r in seqs), f"request {rid} finished but is still registered"
            for r in seqs:      # a grammar's state is that of the sequence's output, at every step
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                    assert rid in self.kv_stream, r
                elif r.status == RequestStatus.WAITING_FOR_GRAMMAR:
                    assert rid in self.grammars and r.grammar is None, r
                elif r.params.structured_outputs is not None and not r.is_finished:
                    assert r.grammar is not None and r.grammar.num_accepted == r.num_output_tokens, r
