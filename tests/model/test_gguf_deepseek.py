"""DeepSeek-V2 GGUF files (llama.cpp's `deepseek2`, as its converter conversion/deepseek.py writes
them: head_count_kv 1, key_length kv_lora_rank + rope and key_length_mla / value_length_mla for
the heads, kv_b_proj split into attn_k_b (transposed) and attn_v_b -- or whole as attn_kv_b in
older files --, experts stacked, shared experts as *_shexp, YaRN's mscale_all_dim as
yarn_log_multiplier) written with gguf-py from the tiny random checkpoints of test_deepseek.py:
F32 files give transformers' greedy tokens and logprobs within 1e-4 on the same weights, with
chunked prefill, tiny blocks and preemption, DeepSeek-V3's too (expert_gating_func sigmoid with
exp_probs_b, expert_weights_norm); a Q8_0 file loads in its own type and tracks its dequantized
weights; files with missing or mis-shaped MLA tensors, another gating function, a sigmoid router
without its bias or renormalised softmax weights are refused before any tensor is read."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvserve import LLM
from kvserve.model.deepseek import DeepseekV2Model
from kvserve.model.loaders.gguf import load_gguf
from kvserve.model.quant.formats import QuantizedWeight, keeps_quantized
from tests.model.gguf_files import add_stories_tokenizer, write_out
from tests.model.test_deepseek import build_deepseek, check, generate, prompts_for

gguf = pytest.importorskip("gguf")
NAMES = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
         "self_attn.q_proj.weight": "attn_q", "self_attn.q_a_proj.weight": "attn_q_a",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm", "self_attn.q_b_proj.weight": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
         "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
         "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
         "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
         "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
         "mlp.shared_experts.down_proj.weight": "ffn_down_shexp"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def write_deepseek_gguf(hf_dir, out, qtype: str = "F32", split_kv_b: bool = True, drop=(), extra_kv=None):
    """The HF DeepSeek-V2 checkpoint in `hf_dir` as llama.cpp's converter writes it (a row width
    that is not a multiple of 32 stays F32, as the converter falls back for such tensors)."""
    c = json.loads((hf_dir / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    H, R, P = c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, E = c["qk_nope_head_dim"], c["v_head_dim"], c["n_routed_experts"]
    w = gguf.GGUFWriter(str(out), "deepseek2")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(1)                     # MLA as MQA: one latent "head"
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    extra_kv = dict(extra_kv or {})
    w.add_kv_lora_rank(extra_kv.pop("add_kv_lora_rank", R))
    w.add_key_length(R + P)
    w.add_value_length(R)
    w.add_key_length_mla(nope + P)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_count(E)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("n_group") is not None:            # (the converter's base class writes these)
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    if c["architectures"] == ["DeepseekV3ForCausalLM"]:    # DeepSeek-V3: the sigmoid router
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if c.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(P)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    for key, value in extra_kv.items():
        getattr(w, key)(value)
    add_stories_tokenizer(w)
    qt = gguf.GGMLQuantizationType[qtype]

    def add(name, a):
        if name in drop:
            return
        if a.ndim >= 2 and qt != gguf.GGMLQuantizationType.F32 and "norm" not in name and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    for name, a in GLOBAL.items():
        add(a, weights[name])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for leaf, g in NAMES.items():
            if p + leaf in weights:
                add(f"blk.{i}.{g}" + ("" if g.endswith(".bias") else ".weight"), weights[p + leaf])
        kv_b = weights[p + "self_attn.kv_b_proj.weight"]
        if split_kv_b:
            k_b, v_b = np.split(kv_b.reshape(H, nope + v, R), [nope], axis=1)
            add(f"blk.{i}.attn_k_b.weight", k_b.transpose(0, 2, 1))
            add(f"blk.{i}.attn_v_b.weight", v_b)
        else:
            add(f"blk.{i}.attn_kv_b.weight", kv_b)
        if p + "mlp.experts.0.gate_proj.weight" in weights:
            for part in ("gate", "up", "down"):
                stacked = np.stack([weights[f"{p}mlp.experts.{e}.{part}_proj.weight"] for e in range(E)])
                add(f"blk.{i}.ffn_{part}_exps.weight", stacked)
    write_out(w)
    return out


@pytest.fixture(scope="module")
def ds_gguf(tmp_path_factory):
    cache = {}

    def get(name: str, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(name)
            build_deepseek(name, d)
            cache[key] = (d, write_deepseek_gguf(d, d / "model.gguf", **kw))
        return cache[key]

    return get


@pytest.mark.parametrize("name,split,settings", [
    ("v2_gguf", True, {}),
    ("v2_gguf", True, dict(block_size=2, max_num_batched_tokens=7, max_num_seqs=4)),
    ("v2_gguf", False, dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)),
    ("v2_lite", True, {}),
    ("v3", True, {}),                      # expert_gating_func sigmoid, exp_probs_b, expert_weights_norm
    ("v3", True, dict(block_size=2, max_num_batched_tokens=7, max_num_seqs=4)),
])
def test_f32_file_matches_transformers(name, split, settings, ds_gguf, tmp_path):
    hf_dir, path = ds_gguf(name, split_kv_b=split)
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").symlink_to(path)
    llm = check(gguf_dir, settings, prompts_for(11), ref_dir=hf_dir)
    assert type(llm.engine.model) is DeepseekV2Model


def test_config_and_weights_read_from_the_file(ds_gguf):
    hf_dir, path = ds_gguf("v2_gguf")
    cfg, weights, _ = load_gguf(path)
    ref = load_file(str(hf_dir / "model.safetensors"))
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (32, 8, 16, 12)
    assert cfg.mlp_only_layers == (0,) and cfg.shared_expert_intermediate_size == 24 and not cfg.shared_expert_gated
    torch.testing.assert_close(weights["model.layers.1.self_attn.kv_b_proj.weight"],
                               ref["model.layers.1.self_attn.kv_b_proj.weight"])
    assert set(weights) == set(ref)


def test_q8_0_file_runs_in_its_own_type(ds_gguf, tmp_path):
    """Q8_0 linear weights load as int8 (kv_b_proj read dequantized: decode multiplies its slices);
    the greedy tokens follow the same file read dequantized."""
    hf_dir, path = ds_gguf("v2_gguf", qtype="Q8_0")
    native = LLM(str(path), dtype="float32")
    model = native.engine.model
    assert model.layers[1].kv_b.dtype == torch.float32
    if keeps_quantized("cpu"):            # (where this CPU holds quantized weights quantized)
        assert isinstance(model.layers[1].kv_a, QuantizedWeight)
        assert model.weight_bytes() < 0.6 * LLM(str(path), dtype="float32", quantization="dequant").engine.model.weight_bytes()
    dequant = LLM(str(path), dtype="float32", quantization="dequant")
    prompts = prompts_for(12)
    got, want = generate(native, prompts), generate(dequant, prompts)
    same = sum(g.token_ids[0] == w.token_ids[0] for g, w in zip(got, want))
    assert same >= len(prompts) - 1


@pytest.mark.parametrize("drop,extra,words", [
    (("blk.1.attn_kv_a_mqa.weight",), None, r"lacks tensors \['blk.1.attn_kv_a_mqa.weight'\]"),
    (("blk.0.attn_v_b.weight",), None, r"lacks tensors \['blk.0.attn_v_b.weight'"),
    ((), {"add_expert_gating_func": SimpleNamespace(value=3)}, "neither softmax"),
    ((), {"add_expert_weights_norm": True}, "expert_weights_norm is true with a softmax router"),
    ((), {"add_expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}, r"lacks tensors \['blk.1.exp_probs_b.bias'"),
])
def test_bad_files_are_refused_before_reading_tensors(drop, extra, words, ds_gguf, tmp_path, monkeypatch):
    hf_dir, _ = ds_gguf("v2_gguf")
    bad = write_deepseek_gguf(hf_dir, tmp_path / "bad.gguf", drop=drop, extra_kv=extra)
    import kvserve.model.loaders.gguf as loader

    def never(*args, **kwargs):
        raise AssertionError("a tensor was read from a refused file")

    monkeypatch.setattr(loader, "_dequantize", never)
    monkeypatch.setattr(loader, "native_weight", never)
    with pytest.raises(ValueError, match=words):
        load_gguf(bad)


def test_mis_shaped_latent_is_refused(ds_gguf, tmp_path):
    hf_dir, _ = ds_gguf("v2_gguf")
    bad = write_deepseek_gguf(hf_dir, tmp_path / "bad.gguf", extra_kv={"add_kv_lora_rank": 16})
    with pytest.raises(ValueError, match=r"attn_kv_a_mqa.weight' has shape \[40, 64\] but the metadata implies \[24, 64\]"):
        load_gguf(bad)
