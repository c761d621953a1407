"""Dense families beyond Llama (issue 34 item 5): tiny random Phi-3 / Phi-4-mini and Gemma models
saved with transformers; kvserve's greedy tokens equal transformers' cached greedy decoding (what
`generate(do_sample=False)` runs) and logprobs agree within 1e-4 in float32, also with small
blocks, chunked prefill and shared prefixes over the prefix cache; what kvserve lacks for them is
a ValueError."""
from __future__ import annotations

import functools
import random
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_HF

MAX_TOKENS = 16
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(6)],
            "long_factor": [1.5 + 0.7 * i for i in range(6)]}


def hf_config(name: str):
    import transformers as tf

    if name == "phi3":
        return tf.Phi3Config(**COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if name == "phi4mini":   # partial RoPE (12 of 16 dims) and LongRoPE switching at position 32
        return tf.Phi3Config(**COMMON, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                             rope_scaling=dict(LONGROPE))
    if name == "phi3_window":
        return tf.Phi3Config(**COMMON, sliding_window=9)
    gemma = {**COMMON, "num_hidden_layers": 4, "head_dim": 16, "tie_word_embeddings": True,
             "sliding_window": 8, "query_pre_attn_scalar": 24}
    if name == "gemma2":      # small caps, so that soft-capping changes the scores and the logits
        return tf.Gemma2Config(**gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if name == "gemma2_untied":
        return tf.Gemma2Config(**{**gemma, "tie_word_embeddings": False})
    if name == "gemma3":      # windowed, global, global, windowed; local base 100; linear-scaled global RoPE
        return tf.Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention",
                                                         "full_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 10000.0}})
    raise ValueError(name)


@functools.lru_cache(maxsize=None)
def model_dir(name: str, root: str) -> str:
    import transformers as tf

    out = f"{root}/{name}"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_HF / f, f"{out}/{f}")
    return out


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dense"))
    return lambda name: model_dir(name, root)


@functools.lru_cache(maxsize=None)
def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@functools.lru_cache(maxsize=512)
@torch.inference_mode()
def hf_greedy(path: str, prompt: tuple, n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decoding with its KV cache (the prompt in one pass, then a token at
    a time), as generate(do_sample=False) runs it: (tokens, their logprobs)."""
    model = load_hf(path)
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, lps = [], []
    for _ in range(n):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        t = int(lp.argmax())
        tokens.append(t)
        lps.append(float(lp[t]))
        out = model(torch.tensor([[t]]), cache=out.past_key_values, use_cache=True)
    return tokens, lps


def prompts(seed: int, n: int, lo: int, hi: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, 512) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


SETTINGS = {
    "default": dict(),
    "block1": dict(block_size=1),
    "chunked": dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4),
    "prefix": dict(block_size=4, prefix_cache="hash", max_num_seqs=1, max_num_batched_tokens=16),
}


def check(path: str, settings: dict, ps: list[list[int]], n: int = MAX_TOKENS, **extra):
    llm = LLM(path, dtype="float32", **settings, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    for p, out in zip(ps, outs):
        ref_tokens, ref_lps = hf_greedy(path, tuple(p), n)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    llm.engine.check_integrity()
    if settings.get("prefix_cache"):
        assert llm.engine.stats().prefix_cache_hits_total > 0
    return llm


# -- Phi-3 / Phi-4 ---------------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_phi3_matches_transformers(setting, build):
    check(build("phi3"), SETTINGS[setting], prompts(1, 4, 3, 40, prefix=8 if setting == "prefix" else 0))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_phi4_mini_partial_rope_and_longrope(setting, build):
    """Prompts up to original_max_position_embeddings (32) whose generations cross it: the
    positions from 32 on rotate with long_factor, as transformers' cached decoding does."""
    ps = prompts(2, 4, 12, 28, prefix=4)
    assert all(len(p) <= 32 < len(p) + MAX_TOKENS for p in ps)
    check(build("phi4mini"), SETTINGS[setting], ps)


def test_phi3_sliding_window(build):
    check(build("phi3_window"), SETTINGS["chunked"], prompts(3, 3, 12, 30))


def test_phi3_config_and_weights(build):
    from kvserve.model.loaders.checkpoint import load_model_dir

    cfg, weights, _ = load_model_dir(build("phi4mini"))
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rotary_dim == 12
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in weights)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


def test_phi3_fused_decode_only_where_it_is_exact(build):
    """The fused CPU decode step runs full-RoPE Phi-3 and is off for partial RoPE."""
    from kvserve import kernels

    plain = LLM(build("phi3"), dtype="float32").engine.model
    partial = LLM(build("phi4mini"), dtype="float32").engine.model
    assert partial.fused is None and "RoPE on 12 of 16" in partial.unfused()
    if kernels.available(torch.device("cpu")):
        assert plain.fused is not None


# -- Gemma 2 / 3 ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_matches_transformers(name, setting, build):
    """Prompts longer than the window (8), so windowed and global layers differ."""
    check(build(name), SETTINGS[setting], prompts(4, 4, 10, 40, prefix=8 if setting == "prefix" else 0))


def test_gemma2_untied_default_caps(build):
    check(build("gemma2_untied"), SETTINGS["chunked"], prompts(5, 3, 10, 30))


def test_gemma_backends_and_fused_step(build):
    """Soft-capping keeps Gemma 2 off the C++ decode kernel (auto picks torch, cpu_fused is
    refused by name); Gemma 3 may decode on it, layer by layer (no fused step), still exact."""
    from kvserve import kernels

    g2 = LLM(build("gemma2"), dtype="float32").engine.model
    assert g2.attn.name == "torch" and g2.fused is None and g2.attn.softcap == 2.0
    assert [a.sliding_window for a in g2.layer_attn] == [8, None, 8, None]
    if kernels.available(torch.device("cpu")):
        with pytest.raises(ValueError, match="soft-capping"):
            LLM(build("gemma2"), dtype="float32", attention_backend="cpu_fused")
        llm = check(build("gemma3"), dict(attention_backend="cpu_fused"), prompts(6, 3, 10, 30))
        assert llm.engine.model.fused is None and llm.engine.model.attn.name == "cpu_fused"


@pytest.mark.parametrize("name", ["gemma2", "phi4mini"])
def test_embeddings_equal_transformers_hidden_states(name, build):
    """The embedder's prompt-only attention (pooling/decoder.py) through the same windows and caps."""
    from kvserve.config import EngineConfig
    from kvserve.pooling.models import load_embedding_model

    model = load_embedding_model(EngineConfig(model=build(name), dtype="float32"))
    ps = prompts(7, 3, 10, 30)
    got = model.embed(ps)
    hf = load_hf(build(name)).model
    with torch.inference_mode():     # as hf_greedy runs it (LongRoPE updates its buffers in place)
        ref = torch.stack([torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
                           for p in ps])
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("lossy", [dict(quantization="int8"), dict(kv_cache_dtype="int8"),
                                   dict(dtype="bfloat16")])
@pytest.mark.parametrize("name", ["phi4mini", "gemma2", "gemma3"])
def test_lossy_paths_run_close(name, lossy, build):
    """int8 weights, an int8 KV cache (soft-capped prefill over dequantized context) and bf16 run
    these families; not exact, so only the first greedy token is held to transformers'."""
    ps = prompts(2, 4, 12, 28, prefix=4)
    llm = LLM(build(name), **{"dtype": "float32", **lossy}, **SETTINGS["chunked"])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids[0] == hf_greedy(build(name), tuple(p), MAX_TOKENS)[0][0]


def test_gemma_config_fields_of_older_configs():
    """config.json as Gemma 2 / 3 checkpoints on the Hub write it (no layer_types, rope_scaling
    and rope_local_base_freq at the top level)."""
    from kvserve.model.config import ModelConfig

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4096)
    g2 = ModelConfig.from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh"})
    assert g2.layer_windows == [4096, None] * 3 and g2.sliding_window is None
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.query_pre_attn_scalar == 256
    g3 = ModelConfig.from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 6,
                              "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                              "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert g3.layer_windows == [4096] * 5 + [None] and g3.qk_norm
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "layer_types": ["chunked_attention"] * 6})


def _edit_config(src: str, dst, **changes) -> str:
    import json

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_phi3_refuses_what_it_lacks(build, tmp_path):
    with pytest.raises(ValueError, match="unsupported MLP activation 'gelu'"):
        LLM(_edit_config(build("phi3"), tmp_path / "gelu", hidden_act="gelu"), dtype="float32")
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        LLM(_edit_config(build("phi3"), tmp_path / "dyn", rope_scaling={"type": "dynamic", "factor": 2.0},
                         rope_parameters=None), dtype="float32")


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
@pytest.mark.parametrize("name", ["phi4mini", "gemma2", "gemma3"])
def test_tensor_and_pipeline_parallel(name, parallel, build):
    """Phi-3's split weights carry Llama's names, so TP slices them and PP stages hold them as
    Llama's; Gemma's extra norms are replicated, its residual branches all-reduced before their
    norms, a stage holds its layers' windows: tp=2 / pp=2 (gloo, mp workers) give transformers'
    tokens and logprobs."""
    ps = prompts(2, 3, 12, 28, prefix=4)
    llm = LLM(build(name), dtype="float32", **parallel, **SETTINGS["chunked"])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    finally:
        llm.engine.shutdown()
    for p, out in zip(ps, outs):
        ref_tokens, ref_lps = hf_greedy(build(name), tuple(p), MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        assert max(abs(lp[t].logprob - r) for lp, t, r in zip(got.logprobs, got.token_ids, ref_lps)) < 1e-4
