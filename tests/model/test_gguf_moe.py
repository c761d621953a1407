"""MoE GGUF files (llama.cpp's layout: `llama` with experts for Mixtral, `qwen2moe` with its
shared expert, `qwen3moe`, `olmoe`; stacked blk.N.ffn_{gate,up,down}_exps [E, ...] and the
router ffn_gate_inp) written with gguf-py from the tiny random HF MoE checkpoints of
test_moe_models.py: F32 files give transformers' greedy tokens and logprobs within 1e-4 on the
same weights; a Q8_0 file run dequantized matches transformers on the dequantized weights; files
whose expert tensors are missing, mis-shaped or disagree with expert_count are refused with a
ValueError before any tensor is dequantized."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model.loaders.gguf import load_gguf
from tests.model.gguf_files import (add_decoder_hparams, add_stories_tokenizer, gguf_name, permute_rope_rows,
                                    write_out)
from tests.model.test_gguf_quant import AGREEMENT
from tests.model.test_quant import teacher_forced
from tests.model.test_moe_models import build_moe_model, check, prompts_for

gguf = pytest.importorskip("gguf")
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
MOE_NAMES = {"mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def stacked_experts(w: dict, layer: str, E: int) -> dict:
    """{gate, up, down: [E, rows, cols]} from per-expert or fused HF tensors of `layer`."""
    p = layer + ("block_sparse_moe.experts." if any(k.startswith(layer + "block_sparse_moe.") for k in w)
                 else "mlp.experts.")
    if p + "gate_up_proj" in w:
        gu = w.pop(p + "gate_up_proj")
        half = gu.shape[1] // 2
        return {"gate": gu[:, :half], "up": gu[:, half:], "down": w.pop(p + "down_proj")}
    out = {}
    for part, role in PARTS.items():
        if p + f"0.{part}.weight" in w:
            out[role] = torch.stack([w.pop(p + f"{e}.{part}.weight") for e in range(E)])
    return out


def write_moe_gguf(hf_dir, out, qtype: str = "F32", drop=(), reshape=None, expert_count=None):
    """The HF MoE checkpoint in `hf_dir` as llama.cpp's converter writes it (experts stacked,
    q/k permuted for `llama`); `drop`: GGUF names left out; `reshape`: {name: array}."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    weights = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv, _ = add_decoder_hparams(w, cfg)
    w.add_expert_count(expert_count or E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if "norm_topk_prob" in cfg and arch != "llama":
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(float(cfg["clip_qkv"]))
    add_stories_tokenizer(w)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        for role, t in stacked_experts(weights, layer, E).items():
            tensors[f"blk.{i}.ffn_{role}_exps.weight"] = t
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        leaf = name.split(".", 3)[-1] if name.startswith("model.layers.") else None
        leaf = leaf.replace("block_sparse_moe.", "mlp.") if leaf else None
        g = (f"blk.{name.split('.')[2]}.{MOE_NAMES[leaf]}" if leaf in MOE_NAMES else
             gguf_name(name if leaf is None else f"model.layers.{name.split('.')[2]}.{leaf}"))
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            t = torch.from_numpy(permute_rope_rows(t.float().numpy(), heads if "q_proj" in name else kv))
        tensors[g] = t
    qt = gguf.GGMLQuantizationType[qtype]
    for g, t in tensors.items():
        if g in drop:
            continue
        a = (reshape or {}).get(g, t.float().numpy() if isinstance(t, torch.Tensor) else t)
        keep_f32 = a.ndim == 1 or "gate_inp" in g or "norm" in g or a.shape[-1] % 32 != 0
        if qt != gguf.GGMLQuantizationType.F32 and not keep_f32:
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), qt), raw_dtype=qt)
        else:
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    write_out(w)
    return out


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_moe_model(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_mixed", "olmoe"])
def test_f32_gguf_matches_transformers(name, moe_hf, tmp_path):
    hf_dir = moe_hf(name)
    path = write_moe_gguf(hf_dir, tmp_path / "m.gguf")
    cfg, weights, _ = load_gguf(path)
    from kvserve.model.loaders.checkpoint import load_model_dir
    ref_cfg, ref_weights, _ = load_model_dir(str(hf_dir))
    assert (cfg.architecture, cfg.num_experts, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size) == (
        ref_cfg.architecture, ref_cfg.num_experts, ref_cfg.norm_topk_prob, ref_cfg.shared_expert_intermediate_size)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [ref_cfg.is_moe_layer(i)
                                                                   for i in range(cfg.num_layers)]
    check(path, {}, prompts_for(3), ref_dir=hf_dir)


def test_q8_0_gguf_matches_transformers_on_its_values(moe_hf, tmp_path):
    """Q8_0 experts, run dequantized, against transformers holding the same dequantized values."""
    hf_dir = moe_hf("qwen2_moe")
    path = write_moe_gguf(hf_dir, tmp_path / "m.gguf", "Q8_0")
    _, weights, _ = load_gguf(path)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    deq = {}
    for k, v in hf.items():
        src = weights.get(k)
        deq[k] = (src if src is not None else v).reshape(v.shape).contiguous()
    assert any(not torch.equal(deq[k], hf[k]) for k in hf if "experts.0." in k)   # Q8_0 moved them
    save_file(deq, str(ref / "model.safetensors"))
    check(path, {"quantization": "dequant"}, prompts_for(4, 3), ref_dir=ref)


@pytest.fixture
def no_dequantize(monkeypatch):
    import kvserve.model.loaders.gguf as g

    def boom(*a, **k):
        raise AssertionError("a tensor was dequantized before the file was refused")

    monkeypatch.setattr(g, "_dequantize", boom)
    monkeypatch.setattr(g, "native_weight", boom)


@pytest.mark.parametrize("edit,words", [
    (dict(drop=("blk.0.ffn_up_exps.weight",)), r"lacks tensors \['blk.0.ffn_up_exps.weight'\]"),
    (dict(expert_count=6), r"blk.0.ffn_gate_exps.weight' has shape \[8, 32, 64\] but the metadata implies \[6, 32, 64\] \(expert_count 6"),
    (dict(reshape={"blk.1.ffn_down_exps.weight": np.zeros((8, 64, 16), np.float32)}),
     r"blk.1.ffn_down_exps.weight' has shape \[8, 64, 16\] but the metadata implies \[8, 64, 32\]"),
    (dict(drop=tuple(f"blk.{i}.ffn_{p}.weight" for i in range(2)
                     for p in ("gate_inp", "gate_exps", "up_exps", "down_exps"))),
     r"expert_count 8, but no layer holds expert tensors"),
])
def test_bad_expert_tensors_are_refused_before_reading(edit, words, moe_hf, tmp_path, no_dequantize):
    path = write_moe_gguf(moe_hf("qwen3_moe"), tmp_path / "bad.gguf", **edit)
    with pytest.raises(ValueError, match=words):
        load_gguf(path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_experts_run_in_their_own_type(qtype, moe_hf, tmp_path):
    """The default load keeps each expert quantized (Q8_0: itself with kvserve's kernels, per-row
    int8 without; Q4_0: int4) and tracks
    the same file run dequantized as the dense quantized files do (test_gguf_quant's AGREEMENT,
    teacher-forced): the kernels' bfloat16 scales and per-row requantization differ by ISA, so
    greedy tokens of a random model need not be equal on every CPU (AVX2 flipped some)."""
    from kvserve import LLM, SamplingParams
    from kvserve import kernels
    from kvserve.model.quant.formats import keeps_quantized

    kind = {"Q4_0": "Int4Weight", "Q8_0": "Int8BlockWeight" if kernels.available() else "Int8Weight"}[qtype]
    path = write_moe_gguf(moe_hf("qwen3_moe"), tmp_path / "m.gguf", qtype)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(3)]
    native = LLM(str(path), dtype="float32")
    if keeps_quantized("cpu"):
        assert {type(w).__name__ for layer in native.engine.model.layers for w in layer.experts_gate_up} == {kind}
    ref_llm = LLM(str(path), dtype="float32", quantization="dequant")
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params)]
    top1, kl = teacher_forced(native.engine.model, ref_llm.engine.model, prompts_for(3), ref)
    print(f"{qtype} experts: top-1 {top1:.3f}, KL {kl:.5f}")
    min_top1, max_kl = AGREEMENT[qtype]
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)
