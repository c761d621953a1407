"""A sentence-transformers model whose transformer kvserve does not run itself (BERT and its
kin: all-MiniLM-L6-v2), through transformers' `AutoModel`, pooled by its own rule (rule.py).

Its context is sentence-transformers' `max_seq_length` (sentence_bert_config.json; 256 for
MiniLM), as vLLM serves it, unless --max-model-len says otherwise (up to the model's
max_position_embeddings). Its tokenizer is kvserve's over the model's tokenizer.json, without the
fixed truncation and padding such files may carry (MiniLM's: 128): an input over the context
is refused, never cut.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.worker.device import resolve_device
from kvserve.model.loaders.checkpoint import checkpoint_dtype, resolve_dtype
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.pooling.rule import read_rule


class EncoderTokenizer(HFTokenizer):
    """tokenizer.json as kvserve's Tokenizer, truncating and padding nothing."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        self._tok.no_truncation()
        self._tok.no_padding()
        self.pad_token_id = self._tok.token_to_id("[PAD]") or 0


class EncoderEmbedder:
    """embed(prompts) -> [B, hidden] float32, on the CPU."""

    def __init__(self, config):
        from transformers import AutoModel

        root = Path(config.model)
        self.rule = read_rule(root)
        self.device = torch.device(resolve_device(config.device))
        dtype = resolve_dtype(config.dtype, checkpoint_dtype(str(root)), self.device)
        self.model = AutoModel.from_pretrained(str(root), local_files_only=True, dtype=dtype)
        self.model = self.model.to(self.device).eval()
        self.tokenizer = EncoderTokenizer(root)
        hf = self.model.config
        self.dim, self.vocab_size = int(hf.hidden_size), int(hf.vocab_size)
        self.dtype = dtype
        max_pos = int(hf.max_position_embeddings)
        st_config = root / "sentence_bert_config.json"
        st_len = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
        self.max_model_len = config.max_model_len or min(st_len or max_pos, max_pos)
        if self.max_model_len > max_pos:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_pos}.")

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        ids = torch.full((len(prompts), max(lengths)), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):                     # right padding: [B, L]
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        hidden = self.model(input_ids=ids.to(self.device),
                            attention_mask=mask.to(self.device)).last_hidden_state   # [B, L, hidden]
        packed = hidden[mask.to(self.device).bool()]        # [sum(lengths), hidden], prompt by prompt
        rows = packed[self.rule.positions(lengths).to(self.device)]
        return self.rule.pool(rows, lengths).cpu()
