"""EngineConfig.resolve(model_config) -> Config (kvserve/config/resolved.py): frozen sections, each
flat field in exactly one of them, "auto" and None decided once against the model; validation
errors as before; and the config package imports none of what it configures."""
from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from kvserve.config import Config, EngineConfig, SpeculativeConfig
from kvserve.worker.device import torch_dtype
from kvserve.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1] / "kvserve"
ARCH = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=256)


def test_resolved_config_is_frozen():
    cfg = EngineConfig(model="m", device="cpu").resolve(ARCH)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = None
    for section in (cfg.model, cfg.cache, cfg.scheduler, cfg.parallel, cfg.tiers):
        name = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, getattr(section, name))
    assert isinstance(cfg.tiers.kv_tiers, tuple)


def test_every_flat_field_lands_in_exactly_one_section():
    sections = {name: cls for name, cls in typing.get_type_hints(Config).items() if name != "speculative"}
    placed = [f.name for cls in sections.values() for f in dataclasses.fields(cls)]
    assert len(placed) == len(set(placed)), "a field in two sections"
    assert set(placed) == {f.name for f in dataclasses.fields(EngineConfig)} - {"speculative_config"}


def test_resolve_decides_what_depends_on_the_model():
    cfg = EngineConfig(model="m", device="cpu", dtype="auto").resolve(ARCH)
    assert (cfg.model.max_model_len, cfg.model.dtype) == (256, "float32")   # "auto": float32 for now
    assert cfg.scheduler.cache_aware_scheduling is False and cfg.speculative is None
    cfg = EngineConfig(model="m", device="cpu", dtype="bf16", max_model_len=100, prefix_cache="radix",
                       kv_tiers=None, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                       ).resolve(ARCH)
    assert (cfg.model.max_model_len, cfg.model.dtype, str(torch_dtype(cfg.model.dtype))) == (100, "bfloat16",
                                                                                             "torch.bfloat16")
    assert cfg.scheduler.cache_aware_scheduling is True and cfg.cache.prefix_cache_kind == "radix"
    assert isinstance(cfg.speculative, SpeculativeConfig) and cfg.speculative.disable_by_batch_size == 4
    with pytest.raises(ValueError, match="kv_tiers needs the hash prefix cache"):
        EngineConfig(model="m", enable_prefix_caching=False, kv_tiers="cpu:1MiB")
    tiers = EngineConfig(model="m", kv_tiers="cpu:1MiB,disk:/tmp/x:1MiB").resolve(ARCH).tiers
    assert tiers.kv_tiers == ("cpu:1MiB", "disk:/tmp/x:1MiB")


def test_resolve_refuses_a_context_longer_than_the_model():
    with pytest.raises(ValueError, match=r"^max_model_len 257 exceeds the model's max_position_embeddings 256\.$"):
        EngineConfig(model="m", max_model_len=257).resolve(ARCH)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int3"}, "dtype must be one of auto, float32, bfloat16, float16, got 'int3'."),
    ({"block_size": 0}, "block_size must be >= 1, got 0."),
    ({"max_num_seqs": 16, "max_num_batched_tokens": 8}, "max_num_batched_tokens (8) must be >= max_num_seqs (16)"),
    ({"prefix_cache": "lru"}, "prefix_cache must be 'hash' or 'radix', got 'lru'."),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be fcfs, priority or vtc, got 'lifo'."),
    ({"kv_role": "decode"}, "kv_role='decode' needs a KV tier that both roles share"),
    ({"distributed_executor_backend": "slurm"}, "distributed_executor_backend must be 'mp' or 'ray'"),
    # new with their flags: values that silently did nothing
    ({"preemption_warn_threshold": 0}, "preemption_warn_threshold must be >= 1, got 0."),
    ({"max_model_len": 0}, "max_model_len must be >= 1"),
])
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(model="m", **kwargs)
    assert message in str(e.value)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_config_imports_no_subsystem_it_configures():
    """The config package imports neither spec_decode, the engine, the server nor the fleet."""
    for path in (ROOT / "config").glob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(("kvserve.spec_decode", "kvserve.engine",
                                                          "kvserve.server", "kvserve.fleet"))]
        assert not bad, (path, bad)
