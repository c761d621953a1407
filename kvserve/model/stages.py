"""A model split into pipeline stages (seed 004's parallelism: "pipeline parallelism splits the
layers"; kvserve/distributed/pipeline.py runs the stages).

Stage s of P holds a contiguous run of decoder layers (`stage_layers`: as even as the count
allows, the first stages taking one more), their KV pools and their weights only; the first stage
also holds the embedding, the last the final norm and the LM head (and the embedding too when the
LM head is tied to it). A stage's layers are renumbered from 0, so each stage is an ordinary model
of fewer layers (`stage_config`, `stage_weights`) built by the registry's class.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kvserve.model.config import ModelConfig

EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class Stage:
    index: int              # 0 .. size - 1
    size: int
    first_layer: int        # the whole model's number of this stage's first layer
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1


def stage_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """(first layer, count) of each of `size` stages; ValueError if a stage would hold none."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}.")
    if size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size} exceeds the model's {num_layers} layers: every "
                         f"stage needs at least one (choose at most {num_layers}).")
    base, extra = divmod(num_layers, size)
    counts = [base + (s < extra) for s in range(size)]
    return [(sum(counts[:s]), counts[s]) for s in range(size)]


def stage_of(cfg: ModelConfig, index: int, size: int) -> Stage:
    first, n = stage_layers(cfg.num_layers, size)[index]
    return Stage(index, size, first, n)


def stage_config(cfg: ModelConfig, stage: Stage) -> ModelConfig:
    """The stage as a model of its own: its layer count (and its layers' windows, if per layer)."""
    windows = cfg.layer_windows and cfg.layer_windows[stage.first_layer:stage.first_layer + stage.num_layers]
    return dataclasses.replace(cfg, num_layers=stage.num_layers, layer_windows=windows)


def stage_weights(weights: dict, cfg: ModelConfig, stage: Stage) -> dict:
    """The checkpoint's tensors (HF names) this stage holds, its layers renumbered from 0."""
    out = {}
    keep_embed = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
    for name, w in weights.items():
        m = _LAYER.match(name)
        if m is not None:
            i = int(m.group(1)) - stage.first_layer
            if 0 <= i < stage.num_layers:
                out[f"model.layers.{i}.{m.group(2)}"] = w
        elif name == EMBED:
            if keep_embed:
                out[name] = w
        elif name in (HEAD, NORM):
            if stage.is_last:
                out[name] = w
        else:
            out[name] = w
    return out
