"""dtype="auto" (kvserve/model/loaders/checkpoint.py): the checkpoint's dtype read from its headers
(`checkpoint_dtype`: safetensors, GGUF's non-quantized tensors, llama2.c), the rule that turns it
into the model dtype on a GPU and on the CPU (`resolve_dtype`), and `read_model_config`, the
loaded model's config without its tensors."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from kvserve.model.quant import cpu_paths
from kvserve.model.loaders.checkpoint import checkpoint_dtype, load_model_dir, read_model_config, resolve_dtype
from tests.conftest import STORIES_C, STORIES_HF, build_random_model
from tests.model.gguf_files import STORIES_GGUF, write_hf_as_gguf, write_mixed_types

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random Llama saved in float32, bf16 and fp16, and as fp16 / Q8_0 GGUF files; the
    llama2.c stories260K alone in a directory."""
    root = tmp_path_factory.mktemp("dtypes")
    f32 = build_random_model("llama", root / "f32")
    out = {"f32": f32}
    for name, dtype in (("bf16", BF16), ("f16", F16)):
        d = root / name
        d.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (d / f).write_bytes((f32 / f).read_bytes())
        weights = load_model_dir(str(f32))[1]
        save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
        out[name] = d
    out["llama2c"] = root / "llama2c"            # STORIES_C also holds a GGUF file, which wins there
    out["llama2c"].mkdir()
    for f in ("stories260K.bin", "tok512.bin"):
        (out["llama2c"] / f).symlink_to(STORIES_C / f)
    out["gguf_f16"] = write_hf_as_gguf(f32, root / "f16.gguf", "F16")
    out["gguf_q8"] = write_hf_as_gguf(f32, root / "q8.gguf", "Q8_0")
    return out


def test_checkpoint_dtype_reads_the_headers(checkpoints):
    assert checkpoint_dtype(str(checkpoints["f32"])) == F32
    assert checkpoint_dtype(str(checkpoints["bf16"])) == BF16
    assert checkpoint_dtype(str(checkpoints["f16"])) == F16
    assert checkpoint_dtype(str(STORIES_HF)) == F32
    assert checkpoint_dtype(str(checkpoints["llama2c"])) == F32      # llama2.c: float32 by format
    assert checkpoint_dtype(str(STORIES_GGUF)) == F32
    assert checkpoint_dtype(str(checkpoints["gguf_f16"])) == F16     # F16 matrices, F32 norms
    assert checkpoint_dtype(str(checkpoints["gguf_q8"])) == F32      # only the norms are floats


def test_a_quantized_gguf_file_computes_in_float32(tmp_path):
    """A file whose most elements are quantized is float32, whatever float types it also holds
    (here one BF16 and one F16 matrix beside seven quantized ones)."""
    assert checkpoint_dtype(str(write_mixed_types(tmp_path / "mixed.gguf"))) == F32


def test_the_engine_default_is_auto(checkpoints):
    """dtype defaults to "auto", as vLLM's: a bf16 checkpoint is not widened to float32 where
    the CPU runs bf16, a float32 one stays float32."""
    from kvserve import LLM
    from kvserve.config.engine_config import EngineConfig
    assert EngineConfig(model="m").dtype == "auto"
    want = cpu_paths.kernel_plan().dense_dtype
    assert LLM(str(checkpoints["bf16"]), num_kv_blocks=8).engine.model.dtype == want
    assert LLM(str(checkpoints["f32"]), num_kv_blocks=8).engine.model.dtype == F32


def test_the_type_holding_most_weights_wins(tmp_path):
    """bf16 matrices with float32 norms (a common mix) are a bf16 checkpoint."""
    src = STORIES_HF
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    _, weights, _ = load_model_dir(str(src))
    save_file({k: v.contiguous() if v.dim() == 1 else v.to(BF16).contiguous() for k, v in weights.items()},
              str(tmp_path / "model.safetensors"))
    assert checkpoint_dtype(str(tmp_path)) == BF16


def test_auto_on_a_gpu_is_the_checkpoint_dtype():
    for dtype in (BF16, F16, F32):
        assert resolve_dtype("auto", dtype, "cuda") == dtype
        assert resolve_dtype("auto", dtype, torch.device("cuda", 1)) == dtype


def test_auto_on_the_cpu_follows_the_measured_rule(monkeypatch):
    plan = cpu_paths.kernel_plan()
    for dense, want_bf16 in ((BF16, BF16), (F32, F32)):
        monkeypatch.setattr(cpu_paths, "kernel_plan", lambda: dataclasses.replace(plan, dense_dtype=dense))
        assert resolve_dtype("auto", BF16, "cpu") == want_bf16       # bf16 only with bf16 instructions
        assert resolve_dtype("auto", F16, "cpu") == F32
        assert resolve_dtype("auto", F32, "cpu") == F32


def test_an_explicit_dtype_is_kept_and_a_bad_one_refused():
    assert resolve_dtype("float16", F32, "cpu") == F16
    assert resolve_dtype("bf16", F32, "cuda") == BF16
    assert resolve_dtype("float32", BF16, "cuda") == F32
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16"):
        resolve_dtype("int8", F32, "cpu")


@pytest.mark.parametrize("which", ["hf", "llama2c", "gguf", "gguf_q8"])
def test_read_model_config_is_the_loaded_config(checkpoints, which):
    path = {"hf": STORIES_HF, "gguf": STORIES_GGUF, **checkpoints}[which]
    assert read_model_config(str(path)) == load_model_dir(str(path))[0]
