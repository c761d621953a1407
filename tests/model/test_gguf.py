"""GGUF loading: files written here with gguf-py from random-weight transformers models (F32,
F16, Q8_0, Q4_0, Q4_1, and BF16/Q5/K-quants in one file), dequantized (quantization="dequant",
the exact reference; the default runs them in their own types: test_gguf_quant.py), give
transformers' own GGUF loading greedy token for token, logprobs within 1e-4; F32 files hold
exactly the HF weights; the real
stories260K GGUF generates what its HF copy does; bad files raise ValueError before any tensor
is dequantized."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loaders.gguf import load_gguf
from kvserve.model.layers import rope_inv_freq
from kvserve.model.loaders.checkpoint import load_model_dir
from tests.conftest import STORIES_HF
from tests.model.gguf_files import (STORIES_GGUF, add_stories_tokenizer, llama3_rope_freqs,
                                    write_hf_as_gguf, write_mixed_types, write_out)
from tests.reference.hf_reference import hf_greedy

pytest.importorskip("gguf")
MAX_TOKENS = 8
PROMPTS = [[1, 50, 60, 70, 300, 20, 9], [1] + list(range(100, 140, 3))]


def greedy(model: str, prompts=PROMPTS, n=MAX_TOKENS, **kw):
    llm = LLM(model, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                         o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "mixed"])
def test_matches_transformers_gguf_loading(qtype, random_model_dir, tmp_path):
    path = tmp_path / "model.gguf"
    if qtype == "mixed":
        write_mixed_types(path)
    else:
        write_hf_as_gguf(random_model_dir("llama"), path, qtype)
    for p, (tokens, lps) in zip(PROMPTS, greedy(str(path), quantization="dequant")):
        ref_tokens, ref_lps = hf_greedy(str(tmp_path), p, MAX_TOKENS, gguf_file=path.name)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_holds_the_hf_weights(arch, random_model_dir, tmp_path):
    """Names, q/k un-permutation (llama only), biases (qwen2), q/k norms and key_length
    (qwen3: head_dim 32 != hidden / heads): every tensor equals the HF checkpoint's."""
    hf_dir = random_model_dir(arch)
    path = write_hf_as_gguf(hf_dir, tmp_path / "m.gguf", "F32", arch)
    cfg, weights, tok = load_gguf(path)
    ref_cfg, ref_weights, _ = load_model_dir(str(hf_dir))
    assert vars(cfg) == {**vars(ref_cfg), "bos_token_id": 1, "eos_token_id": 2,
                         "rms_norm_eps": pytest.approx(ref_cfg.rms_norm_eps)}
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        assert w.dtype == torch.float32 and torch.equal(w, ref_weights[name].float()), name
    assert tok.vocab_size == 512 and tok.bos_token_id == 1


def test_rope_freqs_tensor_is_llama3_scaling(random_model_dir, tmp_path):
    """Llama 3.1 GGUFs carry rope scaling as a rope_freqs tensor of per-frequency divisors;
    with it, the file generates what the HF model with rope_type llama3 does (tied, too)."""
    hf_dir = random_model_dir("llama3")
    path = write_hf_as_gguf(hf_dir, tmp_path / "m.gguf", "F32", rope_freqs=llama3_rope_freqs(hf_dir))
    cfg, _, _ = load_gguf(path)
    ref_cfg, _, _ = load_model_dir(str(hf_dir))
    assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "freq_factors"
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    torch.testing.assert_close(scaled, rope_inv_freq(cfg.head_dim, cfg.rope_theta, ref_cfg.rope_scaling))
    assert not torch.allclose(scaled, plain)
    prompts = [[1] + list(range(3, 120))]   # past original_max_position_embeddings (32)
    got, ref = greedy(str(path), prompts), greedy(str(hf_dir), prompts)
    assert got[0][0] == ref[0][0]
    assert max(abs(a - b) for a, b in zip(got[0][1], ref[0][1])) < 1e-4


def test_stories260k_gguf_matches_its_hf_copy():
    """The real trained model, converted by llama.cpp: same prompt tokens, same greedy text."""
    prompts = ["Once upon a time", "Tom had a red ball. He"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    a = LLM(str(STORIES_GGUF)).generate(prompts, params)
    b = LLM(str(STORIES_HF)).generate(prompts, params)
    for x, y in zip(a, b):
        assert x.prompt_token_ids == y.prompt_token_ids
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
    assert a[0].outputs[0].text.startswith(", there was a little girl named Lily.")


def test_directory_with_one_gguf_loads(tmp_path):
    shutil.copy(STORIES_GGUF, tmp_path / "a.gguf")
    cfg, weights, tok = load_model_dir(str(tmp_path))
    assert cfg.num_layers == 5 and cfg.tie_word_embeddings and "lm_head.weight" not in weights
    shutil.copy(STORIES_GGUF, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        load_model_dir(str(tmp_path))


# ---- bad files: ValueError naming the problem, and nothing dequantized first ----

@pytest.fixture
def no_dequantize(monkeypatch):
    import gguf.quants

    def refuse(*a, **k):
        raise AssertionError("a tensor was dequantized before the file was checked")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)


def test_not_a_gguf_file(tmp_path, no_dequantize):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model_dir(str(path))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [0.001, 0.02, 0.5, 0.999])
def test_truncated_file(keep, tmp_path, no_dequantize):
    """Cut in the header, in the tokenizer metadata, in the tensor data, and its last byte."""
    data = STORIES_GGUF.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:max(8, int(len(data) * keep))])
    with pytest.raises(ValueError, match="truncated"):
        load_gguf(path)


def _tiny_file(path, arch="llama", head_count_kv=2, odd_tensor=None):
    """A one-layer model file (hidden 32) with stories' tokenizer; optionally a wrong
    head_count_kv, or `odd_tensor` (name, array, raw type) added or replacing its namesake."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 32),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 4),
                   (w.add_head_count_kv, head_count_kv)]:
        add(v)
    add_stories_tokenizer(w)
    shapes = {"token_embd.weight": (512, 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
              "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64)}
    odd_name, odd_array, odd_raw = odd_tensor or (None, None, None)
    for name, shape in shapes.items():
        if name != odd_name:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    if odd_tensor is not None:
        w.add_tensor(odd_name, odd_array, raw_dtype=odd_raw)
    write_out(w)
    return path


def test_tiny_file_loads(tmp_path):
    """The control for the bad-file cases below: unmodified, it loads."""
    cfg, weights, _ = load_gguf(_tiny_file(tmp_path / "ok.gguf"))
    assert cfg.num_kv_heads == 2 and weights["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)


def test_unsupported_architecture(tmp_path, no_dequantize):
    with pytest.raises(ValueError, match="architecture 'phi3'"):
        load_gguf(_tiny_file(tmp_path / "m.gguf", arch="phi3"))


def test_shape_disagreeing_with_metadata(tmp_path, no_dequantize):
    with pytest.raises(ValueError, match=r"blk.0.attn_k.weight.*shape \[16, 32\].*\[8, 32\]"):
        load_gguf(_tiny_file(tmp_path / "m.gguf", head_count_kv=1))


def test_unsupported_tensor_type(tmp_path, no_dequantize):
    import gguf

    iq4 = np.zeros((64, 18), dtype=np.uint8)   # IQ4_NL: 18 bytes per 32 values -> [64, 32]
    odd = ("blk.0.ffn_up.weight", iq4, gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight.*IQ4_NL"):
        load_gguf(_tiny_file(tmp_path / "m.gguf", odd_tensor=odd))


def test_unknown_tensor(tmp_path, no_dequantize):
    import gguf

    odd = ("blk.0.ffn_gate_exps.weight", np.zeros((2, 32), np.float32), gguf.GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        load_gguf(_tiny_file(tmp_path / "m.gguf", odd_tensor=odd))


def test_metadata_rope_scaling_and_experts():
    from kvserve.model.loaders.gguf import config_from_metadata

    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 1,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
            "tokenizer.ggml.tokens": ["a"] * 512}
    cfg, permuted = config_from_metadata(meta, "m.gguf")
    assert permuted and cfg.rope_scaling is None and cfg.head_dim == 16 and cfg.num_kv_heads == 4
    linear = {**meta, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert config_from_metadata(linear, "m.gguf")[0].rope_scaling == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        config_from_metadata({**linear, "llama.rope.scaling.type": "yarn"}, "m.gguf")
    with pytest.raises(ValueError, match=r"llama.expert_used_count = 0 must be between 1 and llama.expert_count = 8"):
        config_from_metadata({**meta, "llama.expert_count": 8}, "m.gguf")
    moe = config_from_metadata({**meta, "llama.expert_count": 8, "llama.expert_used_count": 2}, "m.gguf")[0]
    assert (moe.architecture, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (
        "MixtralForCausalLM", 8, 2, True)
    with pytest.raises(ValueError, match="partial rotary"):
        config_from_metadata({**meta, "llama.rope.dimension_count": 8}, "m.gguf")
    assert not config_from_metadata({**meta, "general.architecture": "qwen2",
                                     **{k.replace("llama.", "qwen2."): v for k, v in meta.items()
                                        if k.startswith("llama.")}}, "m.gguf")[1]
