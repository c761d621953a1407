"""Pipeline parallelism (seed 004's parallelism; vLLM's --pipeline-parallel-size): the layers split
into P stages (kvserve/model/stages.py), stage s a process of its own holding only its layers'
weights and KV pools, the residual stream passed from stage to stage over `torch.distributed`
(gloo on CPU, NCCL on CUDA) and the last stage's logits sent back to stage 0, which samples.

Stage 0 is the driver, in the engine's process; stages 1..P-1 are the executor's workers
(executor.py, mp or Ray), which receive every step's SchedulerOutput and block move first, as
tensor-parallel ranks do, so each packs the same step from its own copy of the sequences. Every
stage knows the step's shapes from the step itself (T scheduled tokens, S sampling rows), so a
send needs no header.

One step is in flight at a time, cut into M micro-batches (the runner cuts it the same way on
every stage: worker/model_runner.micro_batch_groups; by default M = P on CUDA, 1 on the CPU:
`default_micro_batches`), which flow through the
stages GPipe's way within the step: stage 0 runs micro-batch 1 while stage 1 runs micro-batch 0.
Each stage idles (P - 1) / (M + P - 1) of the step (kvserve/analysis/pipeline.py); a step of one
sequence is one micro-batch, so single-stream decode gains nothing.

    stage 0          for each g: embed -> its layers -> isend x_g [T_g, hidden];  then recv logits_g [S_g, V]
    stage s          for each g: recv x_g -> its layers -> isend x_g
    stage P-1        for each g: recv x_g -> its layers -> final norm at the sampling rows -> LM head -> isend logits_g
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NO_LOGITS = torch.empty(0)


def default_micro_batches(stages: int, device) -> int:
    """One micro-batch per stage where each stage has memory of its own (a GPU each); one on the
    CPU, where the stages share one memory system: a decode step reads every weight once per
    micro-batch, so cutting the step in two doubles the weight traffic that bounds it (measured:
    benchmarks/bench_tp.py --split pp, PP=2's mixed workload with two micro-batches 0.72-0.88x one
    thread's, with one 0.92-0.93x: docs/past-one-process.md)."""
    return stages if torch.device(device).type == "cuda" else 1


class PipelineStage:
    """One stage's model as its ModelRunner sees it: the registry's class built over the stage's
    layers (`model`, with `supports_pipeline`), its `forward` the stage's part of the pass. Every
    other attribute is the inner model's."""

    def __init__(self, model, stage, micro_batches: int | None = None):
        if not getattr(type(model), "supports_pipeline", False):
            raise ValueError(f"pipeline_parallel_size > 1 is not built for {type(model).__name__}: use 1.")
        self.model, self.stage = model, stage
        self.micro_batches = micro_batches or default_micro_batches(stage.size, model.device)   # the runner reads it
        self.num_steps_total = 0                               # steps this stage has run
        self.num_micro_batches_total = 0                       # micro-batches among them

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches,
                logits_indices: torch.Tensor) -> torch.Tensor:
        return self.forward_micro_batches([(input_ids, positions, meta, logits_indices)], kv_caches)[0]

    @torch.inference_mode()
    def forward_micro_batches(self, batches: list[tuple], kv_caches) -> list[torch.Tensor]:
        """batches: (input_ids [T_g], positions [T_g], meta, logits_indices [S_g]) per micro-batch.
        Stage 0: logits [S_g, V] float32 of each (from the last stage); another stage: its part,
        then empty tensors (a worker's runner samples nothing)."""
        m, s = self.model, self.stage
        self.num_steps_total += 1
        self.num_micro_batches_total += len(batches)
        sends, out = [], []
        for input_ids, positions, meta, logits_indices in batches:
            if s.is_first:
                x = m.embed_tokens(input_ids)
            else:
                x = torch.empty(input_ids.shape[0], m.cfg.hidden_size, dtype=m.dtype, device=m.device)
                dist.recv(x, src=s.index - 1)
            x = m.run_layers(x, positions, meta, kv_caches)
            if s.is_last:
                x = m.logits(m.final_hidden(x, logits_indices))
            x = x.contiguous()                 # kept alive until its send completes
            sends.append((x, dist.isend(x, dst=0 if s.is_last else s.index + 1)))
            out.append(NO_LOGITS)
        if s.is_first and not s.is_last:
            out = []
            for _, _, _, logits_indices in batches:
                logits = torch.empty(logits_indices.shape[0], m.cfg.vocab_size, dtype=torch.float32,
                                     device=m.device)
                dist.recv(logits, src=s.size - 1)
                out.append(logits)
        for _, work in sends:
            work.wait()
        return out

    def hidden_states(self, *args, **kwargs):
        raise ValueError("pooling (hidden states) with pipeline_parallel_size > 1 is not built")
