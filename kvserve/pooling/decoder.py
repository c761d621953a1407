"""kvserve's own decoder models (the Llama family: stories260K, the default GGUF model) as
embedding models: one packed forward pass over whole prompts, with no KV cache, up to the final
norm (`LlamaModel.hidden_states`), only at the rows the pooling rule reads (rule.py: the last
token of each prompt, normalized, unless the directory is a sentence-transformers model).

The model is built as the engine builds it (worker/build.py: dtype "auto", a GGUF file's
own tensor types, --quantization); `PromptAttention` is the engine's portable prefill attention
(every prompt attends to itself, causally) with nothing written to a cache.
"""
from __future__ import annotations

import torch

from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
from kvserve.attention.mla import MlaAttention
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.pooling.rule import read_rule
from kvserve.worker.build import build_model, load_and_resolve
from kvserve.worker.device import torch_dtype

NO_TABLE = torch.empty(0, dtype=torch.long)


class PromptAttention(TorchPagedAttention):
    """Causal attention of whole prompts of a packed batch, each over its own tokens only,
    through TorchPagedAttention's padded prefill path; no KV cache is read or written."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._prefill(q, k, v, None, None, meta)


class PromptMlaAttention(MlaAttention):
    """The same for multi-head latent attention (DeepSeek-V2): each prompt's own latents expanded."""

    def forward(self, q_nope, q_pe, latent, k_pe, latent_cache, pe_cache, meta: AttentionMetadata,
                kv_b: torch.Tensor) -> torch.Tensor:
        return self._prefill(q_nope, q_pe, latent, k_pe, None, None, meta, kv_b)


class DecoderEmbedder:
    """embed(prompts) -> [B, hidden] float32, on the CPU."""

    def __init__(self, config):
        if config.tensor_parallel_size > 1:
            raise ValueError("--task embed runs on one device: drop --tensor-parallel-size.")
        if config.pipeline_parallel_size > 1:
            raise ValueError("--task embed runs on one device: drop --pipeline-parallel-size.")
        r, loaded = load_and_resolve(config)      # the file is read once
        self.device = torch.device(r.model.device)
        self.max_model_len = r.model.max_model_len
        attention = PromptMlaAttention if loaded[0].kv_lora_rank else PromptAttention
        built = build_model(r.model, r.cache.block_size, "auto", self.device, attention=attention, loaded=loaded)
        del loaded
        self.model, self.tokenizer, cfg = built.model, built.tokenizer, built.config
        self.no_cache = [(None, None)] * cfg.num_layers
        self.rule = read_rule(config.model)
        self.dim, self.vocab_size, self.dtype = cfg.hidden_size, cfg.vocab_size, torch_dtype(r.model.dtype)

    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        dev = self.device
        input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)  # [T]
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)                        # [T]
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
        meta = AttentionMetadata(slot_mapping=torch.empty(len(input_ids), dtype=torch.long, device=dev),
                                 prefills=[PrefillChunk(s, n, n, NO_TABLE) for s, n in zip(starts, lengths)])
        rows = self.model.hidden_states(input_ids, positions, meta, self.no_cache,
                                        self.rule.positions(lengths).to(dev))   # [R, hidden]
        return self.rule.pool(rows, lengths).cpu()
