"""A draft model's KV pool is budgeted with the target's (engine/kv_sizing.py): kv_cache_memory
splits between the two pools in proportion to their bytes per token, both pools get the same
number of blocks (the same tokens), and what the two runners allocate stays within the budget."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineConfig
from kvserve.engine.kv_sizing import kv_pool_sizes
from kvserve.model.loaders.checkpoint import read_model_config
from kvserve.worker.model_runner import ModelRunner
from tests.conftest import STORIES_HF

BUDGET = 3 << 20


def allocated(runner) -> int:
    """Bytes of every K/V pool tensor the runner holds (values and scales)."""
    def tensors(x):
        return [x] if isinstance(x, torch.Tensor) else [t for y in x for t in tensors(y)]
    return sum(t.numel() * t.element_size() for t in tensors(runner.kv_caches))


def core(llm):
    return getattr(llm.engine, "core", llm.engine)


def resolved(cfg: EngineConfig):
    """The engine's resolved Config for `cfg` against its model (what kv_sizing reads)."""
    return cfg.resolve(read_model_config(cfg.model))


def per_block(model_dir, block_size: int = 16) -> int:
    return ModelRunner.kv_bytes_per_block(read_model_config(str(model_dir)), block_size, torch.float32)


@pytest.mark.parametrize("draft", ["llama", "self"])
def test_target_and_draft_pools_share_kv_cache_memory(random_model_dir, draft):
    """stories260K (1280 bytes a token) with a random 2-layer Llama draft of its vocabulary
    (512 bytes a token), or itself as its own draft (the budget halves)."""
    path = str(random_model_dir(draft)) if draft != "self" else "self"
    llm = LLM(str(STORIES_HF), kv_cache_memory=BUDGET,
              speculative_config={"model": path, "num_speculative_tokens": 2})
    eng = core(llm)
    target = per_block(STORIES_HF)
    drafted = target if draft == "self" else per_block(path)
    assert drafted != target or draft == "self"
    n = BUDGET // (target + drafted) - 1          # each pool also holds its null block
    proposer = eng.spec.proposer
    assert eng.kv.pool.num_blocks == proposer.kv.pool.num_blocks == n
    used = allocated(eng.runner) + allocated(proposer.runner)
    assert used == (n + 1) * (target + drafted) <= BUDGET


def test_without_a_draft_the_target_takes_the_whole_budget(random_model_dir):
    cfg = EngineConfig(model=str(STORIES_HF), device="cpu", kv_cache_memory=BUDGET, max_model_len=512)
    m = read_model_config(str(STORIES_HF))
    sizes = kv_pool_sizes(resolved(cfg), m, m, "cpu")
    assert sizes.draft_bytes_per_block == 0 and sizes.num_blocks == BUDGET // per_block(STORIES_HF) - 1
    ngram = EngineConfig(model=str(STORIES_HF), device="cpu", kv_cache_memory=BUDGET, max_model_len=512,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert kv_pool_sizes(resolved(ngram), m, m, "cpu") == sizes


def test_the_split_is_reported_and_an_explicit_block_count_goes_to_both(random_model_dir):
    draft = str(random_model_dir("llama"))
    spec = {"model": draft, "num_speculative_tokens": 2}
    m = read_model_config(str(STORIES_HF))
    cfg = EngineConfig(model=str(STORIES_HF), device="cpu", kv_cache_memory=BUDGET, max_model_len=512,
                       speculative_config=spec)
    sizes = kv_pool_sizes(resolved(cfg), m, m, "cpu")
    assert sizes.target_bytes_per_block == per_block(STORIES_HF)
    assert sizes.draft_bytes_per_block == per_block(draft)
    text = sizes.describe()
    assert f"{sizes.num_tokens} tokens" in text and "draft model" in text and "71%" in text   # 1280 / 1792
    fixed = EngineConfig(model=str(STORIES_HF), device="cpu", num_kv_blocks=40, max_model_len=512,
                         speculative_config=spec)
    assert kv_pool_sizes(resolved(fixed), m, m, "cpu").num_blocks == 40
    tiny = EngineConfig(model=str(STORIES_HF), device="cpu", kv_cache_memory=sizes.target_bytes_per_block,
                        max_model_len=512, speculative_config=spec)
    with pytest.raises(ValueError, match="for the draft model"):
        kv_pool_sizes(resolved(tiny), m, m, "cpu")
