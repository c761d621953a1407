"""The model runner: packs one step's scheduled tokens into one flat (ragged) batch, runs one
forward pass over the paged KV cache and computes logits for the sequences that sample
(seed 000, "Chunked prefill": `pack(sequences)`; seed 003, block tables and slot mapping),
plus the rows of any other positions the caller names (prompt logprobs). `execute_model` takes
the step as data (a SchedulerOutput: worker/scheduler_output.py), keeps its own copy of every
live sequence (worker/request_state.py), then runs the sampling stage on the logits
(worker/sampling.py) and returns a ModelRunnerOutput, so the logits never leave the worker
(`execute` returns them, for the draft model's argmax). A sequence given
drafts (speculative decoding: the scheduler's `draft_tokens`) runs its last token and the k
drafts after it and returns logits at all k + 1 positions.
Its inputs are written into buffers and block-table rows kept across steps (worker/input_batch.py).
It never decides who runs, nor which rows are wanted, nor which drafts to keep."""
from __future__ import annotations

from typing import TYPE_CHECKING

import itertools
import time

import torch

from kvserve.attention import kv_quant
from kvserve.model.llama import LlamaModel
from kvserve.worker import kv_blocks
from kvserve.worker.device import keep_step_memory, torch_dtype
from kvserve.sample.sampler import Sampler
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.output import ModelRunnerOutput
from kvserve.worker.request_state import SequenceState
from kvserve.worker.scheduler_output import SchedulerOutput
from kvserve.worker.sampling import StepSampler

if TYPE_CHECKING:
    from kvserve.worker.sequence import RunnerSequence


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = model.device
        # One preallocated pool per layer and K/V, in the attention backend's layout
        # ([num_blocks + 1, n_kv_heads, block_size, head_dim] for the portable backend: row 0 is
        # the null block, kv/block_pool.py); with a quantized kv_cache_dtype each pool is
        # (values, scales [num_blocks + 1, KV, block_size]). The backend may shape K and V apart
        # (multi-head latent attention: the latent and the RoPE key part, attention/mla.py).
        shapes = model.attn.cache_shapes(num_blocks + 1)
        self.kv_cache_dtype = model.attn.kv_cache_dtype
        self.forward_time_total = 0.0   # seconds inside the model's forward pass
        # The KV connector (kv/connector.py's KVConnector, None without KV tiers), called at named
        # points: save_blocks(runner, saves) first in apply_kv_ops, load_blocks(runner, loads)
        # last in it (both before the forward pass), after_forward(scheduled, seconds) at the
        # end of execute. It reads and writes blocks through kv_cache_tensors().
        self.kv_connector = None
        self.kv_stream = None         # PD prefill side: a KVStreamSender, told as each layer is written
        self.sampling: StepSampler | None = None     # the sampling stage (init_sampling)
        self.kv_caches = [tuple(kv_quant.allocate(shape, self.kv_cache_dtype, model.dtype, self.device)
                                for shape in shapes) for _ in range(cfg.num_layers)]
        # A model that runs several micro-batches of one step at once (a pipeline stage:
        # kvserve/distributed/pipeline.py) gets the step cut into that many; one InputBatch each
        self.micro_batches = getattr(model, "micro_batches", 1)
        self.input_batches = [InputBatch(self.device, block_size) for _ in range(self.micro_batches)]
        self.states: dict[str, SequenceState] = {}   # every live sequence, by id (execute_model)
        keep_step_memory(self.device)    # the model and pools are in: what a step frees stays for the next

    # -- block moves for sharing and swapping (kv/manager.py queues them; run before execute) --
    def init_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU copies of the per-layer pools, in the device pools' layout and dtypes."""
        self.cpu_caches = []
        if num_cpu_blocks <= 0:
            return
        shapes = self.model.attn.cache_shapes(num_cpu_blocks)    # CPU block ids 0.. (no null block)
        pin = self.device.type == "cuda"
        self.cpu_caches = [tuple(kv_quant.allocate(shape, self.kv_cache_dtype, self.model.dtype, "cpu",
                                                   pin_memory=pin, zeros=False) for shape in shapes)
                           for _ in self.kv_caches]

    @staticmethod
    def _pools(caches) -> list[torch.Tensor]:
        """Every tensor of every layer's K and V pools (values and scales when quantized)."""
        return [t for layer in caches for pool in layer for t in kv_quant.cache_tensors(pool)]

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The device KV pools as tensors whose dim 0 is the block id: for each layer, K then V,
        values then scales when quantized (float8 viewed as bytes)."""
        return self._pools(self.kv_caches)

    def read_kv_blocks(self, block_ids: list[int]):
        """[n, block_bytes] uint8 (numpy): the blocks' bytes in every pool (worker/kv_blocks.py)."""
        return kv_blocks.read_blocks(self.kv_cache_tensors(), block_ids)

    def write_kv_blocks(self, block_ids: list[int], data) -> None:
        """n x block_bytes bytes (`read_kv_blocks`' layout) -> the blocks `block_ids` of every pool."""
        kv_blocks.write_blocks(self.kv_cache_tensors(), block_ids, data)

    def kv_block_bytes(self) -> int:
        return kv_blocks.block_bytes(self.kv_cache_tensors())

    def kv_layer_layout(self) -> tuple[int, int]:
        """(layers, bytes of one block in one layer): kv_cache_tensors() is layer-major."""
        tensors, n = self.kv_cache_tensors(), len(self.kv_caches)
        return n, sum(t[0].numel() * t.element_size() for t in tensors[:len(tensors) // n])

    def _kv_written(self, layer: int) -> None:
        """Layer-wise KV streaming (kv/stream_sender.py): layer `layer`'s K/V of the step are in
        the pool; hand the sender a copy of its slices of the blocks planned this step."""
        tensors = self.kv_cache_tensors()
        g = len(tensors) // len(self.kv_caches)
        for o, block_ids, keys in self.kv_stream.step_plan():
            data = kv_blocks.read_blocks(tensors[layer * g:(layer + 1) * g], block_ids)
            self.kv_stream.layer_data(o, layer, keys, data.tobytes())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy on write: block src -> dst in every layer's K and V cache."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for t in self.kv_cache_tensors():
            t.index_copy_(0, dst, t.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block): copy device blocks into the CPU swap space."""
        if not pairs:
            return
        gpu = torch.tensor([g for g, _ in pairs], dtype=torch.long, device=self.device)
        cpu = torch.tensor([c for _, c in pairs], dtype=torch.long)
        for t, ct in zip(self.kv_cache_tensors(), self._pools(self.cpu_caches)):
            ct.index_copy_(0, cpu, t.index_select(0, gpu).cpu())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block): copy swapped blocks back onto the device."""
        if not pairs:
            return
        cpu = torch.tensor([c for c, _ in pairs], dtype=torch.long)
        gpu = torch.tensor([g for _, g in pairs], dtype=torch.long, device=self.device)
        for t, ct in zip(self.kv_cache_tensors(), self._pools(self.cpu_caches)):
            t.index_copy_(0, gpu, ct.index_select(0, cpu).to(self.device, non_blocking=True))

    def apply_kv_ops(self, ops) -> None:
        """Run the manager's queued block moves: saves to the KV tiers (they read blocks this
        batch may overwrite), swap out, swap in, copies, then loads from the tiers."""
        if ops.saves:
            self.kv_connector.save_blocks(self, ops.saves)
        self.swap_out(ops.swap_out)
        self.swap_in(ops.swap_in)
        self.copy_blocks(ops.copies)
        if ops.loads:
            self.kv_connector.load_blocks(self, ops.loads)

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype | str, kv_cache_dtype: str = "auto") -> int:
        """K and V of every layer for block_size tokens (scales included when quantized); with
        multi-head latent attention the latent and the RoPE key part (ModelConfig.kv_cache_rows).
        `dtype`: the model's, or its name (config/names.py)."""
        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        rows = sum(heads * kv_quant.bytes_per_token_head(kv_cache_dtype, width, dtype)
                   for heads, width in cfg.kv_cache_rows())
        return cfg.num_layers * block_size * rows

    def execute(self, scheduled: list[tuple[RunnerSequence, int, list[int]]],
                extra_rows: dict[str, range] | None = None, draft_tokens: dict[str, list[int]] | None = None
                ) -> tuple[torch.Tensor, list, list[tuple[RunnerSequence, int, torch.Tensor]]]:
        """scheduled: (request, num_new_tokens, block_ids). Returns logits [S, V] for the
        requests whose every known token is now computed (they sample), and those requests
        (a request with k `draft_tokens`, which its num_new_tokens count, has k + 1 rows);
        and, for each request id in `extra_rows` (positions inside its chunk whose logits are
        wanted too), (request, first position, logits [r, V])."""
        t0 = time.perf_counter()
        groups = micro_batch_groups(scheduled, self.micro_batches)
        steps = [ib.prepare(g, extra_rows or {}, draft_tokens or {}) for ib, g in zip(self.input_batches, groups)]
        # Chunks that do not sample still run: their K/V must reach the cache.
        t1 = time.perf_counter()
        logits = self.forward(steps)                     # one [S_g + E_g, V] per micro-batch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.forward_time_total += t2 - t1
        if self.kv_connector is not None:
            self.kv_connector.after_forward(scheduled, t2 - t0)
        sample_rows, samplers, rows = [], [], []
        for step, out in zip(steps, logits):
            sample_rows.append(out[:step.num_sample_rows])
            samplers += step.samplers
            at = step.num_sample_rows
            for req, first, r in step.extras:
                rows.append((req, first, out[at:at + r]))
                at += r
        return (sample_rows[0] if len(steps) == 1 else torch.cat(sample_rows)), samplers, rows

    def init_sampling(self, vocab_size: int, seed: int | None, spec=None) -> None:
        """The sampling stage execute_model runs (worker/sampling.py): a seeded sampler over the
        vocabulary, and `spec`, the SpecDecoder whose drafts it verifies (None: no speculation)."""
        self.sampling = StepSampler(Sampler(vocab_size, self.device, seed), spec)
        for sid, st in self.states.items():
            self.sampling.table.add(sid, st.params)

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's data to the worker's copy of every live sequence: finished ones are
        forgotten, new ones recorded (their sampling parameters written into the sampling
        table's rows once), cached ones advanced (worker/request_state.py)."""
        states = self.states
        table = self.sampling.table if self.sampling is not None else None
        for sid in so.finished_seq_ids:
            states.pop(sid, None)
            if table is not None:
                table.remove(sid)
        for d in so.new_seqs:
            states[d.seq_id] = SequenceState.from_new(d)
            if table is not None:
                table.add(d.seq_id, d.params)
        for d in so.cached_seqs:
            states[d.seq_id].update(d)

    def append_sampled(self, sampled: dict) -> None:
        """The tokens this step sampled join their sequences' copies (the core counts them as
        known to the worker: engine/worker_view.py); seq id -> [Sampled]."""
        states = self.states
        for sid, run in sampled.items():
            st = states.get(sid)
            if st is not None:
                st.token_ids.extend([s.token_id for s in run])

    def execute_model(self, so: SchedulerOutput, sample: bool = True) -> ModelRunnerOutput:
        """One step from its SchedulerOutput: the sequences' states updated, the forward pass
        (`execute`), then the sampling stage on its logits (speculative verification, beam
        candidates, prompt logprobs): what the scheduler needs. A tensor-parallel worker rank
        runs it with sample=False (rank 0 samples)."""
        self.update_states(so)
        if not so.scheduled:
            return ModelRunnerOutput()
        states, batch = self.states, []
        for sid, n, start in so.scheduled:
            st = states[sid]
            st.num_computed_tokens = start
            batch.append((st, n, st.block_ids))
        logits, samplers, prompt_rows = self.execute(batch, so.prompt_logprob_rows, so.draft_tokens)
        if not sample:
            return ModelRunnerOutput()
        out = self.sampling(logits, samplers, prompt_rows, so, states)
        self.append_sampled(out.sampled)
        return out

    def forward(self, steps: list) -> list[torch.Tensor]:
        """The step's forward pass over this runner's KV pools: logits [S + E, V] for each of
        `steps` (StepInputs; more than one only for a model with micro_batches > 1)."""
        for step in steps:
            step.meta = self.model.attn.prepare(step.meta)     # the backend's per-step derivations, once
        if len(steps) > 1:
            return self.model.forward_micro_batches(
                [(st.input_ids, st.positions, st.meta, st.logits_indices) for st in steps], self.kv_caches)
        st = steps[0]
        if self.kv_stream is not None and self.kv_stream.step_plan():
            st.meta.kv_written = self._kv_written
        return [self.model.forward(st.input_ids, st.positions, st.meta, self.kv_caches, st.logits_indices)]


def micro_batch_groups(scheduled: list, m: int) -> list[list]:
    """The step's sequences cut into min(m, len) contiguous groups, each cut at the boundary whose
    token count lies nearest an even share (pipeline micro-batches; every stage cuts the same step
    the same way). [scheduled] for m = 1."""
    m = min(m, len(scheduled))
    if m <= 1:
        return [scheduled]
    prefix = list(itertools.accumulate(n for _, n, _ in scheduled))     # prefix[i - 1]: tokens of [:i]
    cuts = [0]
    for k in range(1, m):
        target = prefix[-1] * k / m
        cuts.append(min(range(cuts[-1] + 1, len(scheduled) - (m - k) + 1),
                        key=lambda i: abs(prefix[i - 1] - target)))
    cuts.append(len(scheduled))
    return [scheduled[a:b] for a, b in zip(cuts, cuts[1:])]
