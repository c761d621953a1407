"""The pooling rule: how one prompt's final hidden states become its embedding -- the one place
that decides it, for every model kvserve embeds with.

A sentence-transformers model says it itself: `modules.json` lists its modules, the Pooling
module's `config.json` names the mode (`pooling_mode_mean_tokens`, `pooling_mode_cls_token`,
`pooling_mode_lasttoken`), and a Normalize module L2-normalizes the result. Any other module
(Dense, max or weighted-mean pooling, several modes at once) is refused with a ValueError: an
embedding kvserve cannot reproduce exactly is not served. A model without modules.json is a
decoder (kvserve's Llama family) and pools its last token's final hidden state (after the final
norm), normalized: vLLM's default for decoder embedding models.

Pooling reads packed rows: the prompts of a batch one after another, `lengths` [B] tokens each.
`positions(lengths)` names the rows a mode reads (the last of each prompt, the first, or all),
so a decoder computes only those; `pool(rows, lengths)` turns them into [B, hidden] float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
         "pooling_mode_lasttoken": "last"}
UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingRule:
    mode: str               # "mean" | "cls" | "last"
    normalize: bool

    def positions(self, lengths: list[int]) -> torch.Tensor:
        """The packed rows this rule reads: [B] (cls, last) or [sum(lengths)] (mean), int64."""
        ends = torch.tensor(lengths, dtype=torch.long).cumsum(0)
        if self.mode == "last":
            return ends - 1
        if self.mode == "cls":
            return ends - torch.tensor(lengths, dtype=torch.long)
        return torch.arange(int(ends[-1]))

    def pool(self, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """rows [R, hidden] (those `positions` named) -> embeddings [B, hidden] float32."""
        rows = rows.float()
        if self.mode == "mean":     # sentence-transformers' sum over the tokens / their count
            counts = torch.tensor(lengths, dtype=torch.float32, device=rows.device).unsqueeze(1)
            out = torch.stack([r.sum(0) for r in rows.split(lengths)]) / counts
        else:
            out = rows
        return torch.nn.functional.normalize(out, p=2, dim=1) if self.normalize else out


DECODER_RULE = PoolingRule("last", normalize=True)


def read_rule(model_dir: str | Path | None) -> PoolingRule:
    """The rule of the model at `model_dir`: its sentence-transformers modules, else the
    decoder default (a GGUF file or a directory without modules.json)."""
    root = Path(model_dir) if model_dir is not None else None
    if root is None or not root.is_dir() or not (root / "modules.json").exists():
        return DECODER_RULE
    modules = json.loads((root / "modules.json").read_text())
    mode, normalize = None, False
    for m in modules:
        kind = m.get("type", "")
        if kind == ST_TRANSFORMER:
            continue
        if kind == ST_POOLING:
            mode = _pooling_mode(root / m.get("path", "") / "config.json")
        elif kind == ST_NORMALIZE:
            normalize = True
        else:
            raise ValueError(f"{root}: the sentence-transformers module {kind!r} is not supported "
                             "(kvserve pools with Pooling and Normalize modules only).")
    if mode is None:
        raise ValueError(f"{root}/modules.json has no Pooling module: kvserve does not know how "
                         "to pool this model's hidden states.")
    return PoolingRule(mode, normalize)


def _pooling_mode(config_path: Path) -> str:
    cfg = json.loads(config_path.read_text())
    on = [k for k in (*MODES, *UNSUPPORTED) if cfg.get(k)]
    if len(on) != 1 or on[0] not in MODES:
        raise ValueError(f"{config_path}: pooling modes {on or 'none'} are not supported; kvserve "
                         "pools with exactly one of mean, cls or lasttoken.")
    return MODES[on[0]]
