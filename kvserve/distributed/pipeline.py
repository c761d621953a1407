"""Pipeline parallelism (seed 004's parallelism; vLLM's --pipeline-parallel-size): the layers split
into P stages (kvserve/model/stages.py), stage s a process of its own holding only its layers'
weights and KV pools, the residual stream passed from stage to stage over `torch.distributed`
(gloo on CPU, NCCL on CUDA) and the last stage's logits sent back to stage 0, which samples.

Stage 0 is the driver, in the engine's process; stages 1..P-1 are the executor's workers
(executor.py, mp or Ray), which receive every step's SchedulerOutput and block move first, as
tensor-parallel ranks do, so each packs the same step from its own copy of the sequences. Every
stage knows the step's shapes from the step itself (T scheduled tokens, S sampling rows), so a
send needs no header. One step is in flight at a time: the stages run one after another within a
step (no micro-batches in flight yet), so pipeline parallelism here buys memory (a model larger
than one process holds), not speed.

    stage 0          embed -> its layers -> send x [T, hidden] -> ... -> recv logits [S, V]
    stage s          recv x -> its layers -> send x
    stage P-1        recv x -> its layers -> final norm at the sampling rows -> LM head -> send logits
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NO_LOGITS = torch.empty(0)


class PipelineStage:
    """One stage's model as its ModelRunner sees it: the registry's class built over the stage's
    layers (`model`, with `supports_pipeline`), its `forward` the stage's part of the pass. Every
    other attribute is the inner model's."""

    def __init__(self, model, stage):
        if not getattr(type(model), "supports_pipeline", False):
            raise ValueError(f"pipeline_parallel_size > 1 is not built for {type(model).__name__}: use 1.")
        self.model, self.stage = model, stage

    def __getattr__(self, name):
        return getattr(self.model, name)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Stage 0: logits [S, V] float32 (from the last stage); another stage: its part, then an
        empty tensor (a worker's runner samples nothing)."""
        m, s = self.model, self.stage
        T, S = input_ids.shape[0], logits_indices.shape[0]
        if s.is_first:
            x = m.embed_tokens(input_ids)
        else:
            x = torch.empty(T, m.cfg.hidden_size, dtype=m.dtype, device=m.device)
            dist.recv(x, src=s.index - 1)
        x = m.run_layers(x, positions, meta, kv_caches)
        if not s.is_last:
            dist.send(x.contiguous(), dst=s.index + 1)
            if not s.is_first:
                return NO_LOGITS
            logits = torch.empty(S, m.cfg.vocab_size, dtype=torch.float32, device=m.device)
            dist.recv(logits, src=s.size - 1)
            return logits
        logits = m.logits(m.final_hidden(x, logits_indices))
        dist.send(logits.contiguous(), dst=0)
        return NO_LOGITS

    def hidden_states(self, *args, **kwargs):
        raise ValueError("pooling (hidden states) with pipeline_parallel_size > 1 is not built")
