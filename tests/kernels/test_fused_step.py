"""The fused decode step (kvserve/model/fused_decode.py: every layer of a pure-decode step in one
torch.ops.kvserve.decode_layers call) against the layer-by-layer path on the same weights:
greedy tokens equal and logprobs within 1e-4 in float32 (Llama, Llama 3's tied embeddings and
RoPE scaling, Qwen2's qkv bias, Qwen3's per-head q/k norm, Mistral's sliding window, mixtures
of experts: Mixtral, Qwen2-MoE's shared expert, a dense layer among MoE ones), and with
int8, int4 and int5 (GGUF Q5_0) weights (int4 and int5 within 1e-3); a bfloat16 model within bfloat16's rounding; a step
with prefill chunks never takes it; a model it refuses logs why and runs layer by layer."""
from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.model.fused_decode import FusedDecode
from kvserve.model.quant.formats import Int4Weight, Int8Weight
from tests.conftest import STORIES_HF, built_once
from tests.kernels.isa import needs_kernels

pytestmark = needs_kernels
MAX_TOKENS = 12
LOGPROB_TOL = 1e-4
INT4_LOGPROB_TOL = 1e-3


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def count_steps(llm: LLM) -> list[list]:
    """[tokens, decode tokens, fused?] of every forward pass the engine runs from now on."""
    model, steps = llm.engine.model, []
    forward, fused = model.forward, model.fused
    if fused is not None:
        run = fused.run

        def counted_run(*args, **kwargs):
            steps[-1][2] = True
            return run(*args, **kwargs)
        fused.run = counted_run

    def counted_forward(input_ids, positions, meta, *rest):
        steps.append([input_ids.shape[0], meta.num_decode_tokens, False])
        return forward(input_ids, positions, meta, *rest)
    model.forward = counted_forward
    return steps


def generate(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_integrity()
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_same(fused, layered, tol):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(fused, layered, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < tol


def fused_and_layered(model_dir, prompts, **kw):
    """The outputs with the fused step on, then off (`model.fused = None`), and the steps run."""
    on = LLM(str(model_dir), **kw)
    assert on.engine.core.model.fused is not None
    steps = count_steps(on)
    fused = generate(on, prompts)
    off = LLM(str(model_dir), **kw)
    off.engine.core.model.fused = None
    return fused, generate(off, prompts), steps


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_fused_step_equals_layer_by_layer(arch, random_model_dir):
    fused, layered, steps = fused_and_layered(random_model_dir(arch), prompts_for(1, 5), block_size=8)
    assert_same(fused, layered, LOGPROB_TOL)
    assert sum(f for _, _, f in steps) >= MAX_TOKENS - 1     # every decode step of the batch was fused


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from tests.model.test_moe_models import build_moe_model

    return built_once(tmp_path_factory, build_moe_model)


@pytest.mark.parametrize("name,quantization,tol", [
    ("mixtral", None, LOGPROB_TOL),                # top-2 renormalised
    ("qwen2_moe", None, LOGPROB_TOL),              # not renormalised, a sigmoid-gated shared expert
    ("qwen3_moe_mixed", None, LOGPROB_TOL),        # a dense layer between MoE ones
    ("mixtral", "int8", LOGPROB_TOL),
    ("qwen3_moe_mixed", "int4", INT4_LOGPROB_TOL),
])
def test_fused_step_with_experts(name, quantization, tol, moe_model_dir, monkeypatch):
    """Mixture-of-experts layers in the fused step (routing, the chosen experts, the shared expert
    in the kernel) against the layer-by-layer torch path (kvserve/model/moe.py), on batches of 6
    rows. With quantized weights the fused step takes more than KERNEL_ROWS rows too, where the
    torch path would switch to torch's kernels (bf16 on this CPU); here every quantized matmul of
    both paths (prefill too) runs kvserve's own op, so the two differ only in what the fused step
    does, not in whose kernel multiplies."""
    if quantization is not None:
        monkeypatch.setattr(Int8Weight, "linear", lambda self, x, bias=None, gemm_dtype=False: torch.ops.kvserve.linear_int8(
            x.float(), self.q, self.scale).to(x.dtype))
        monkeypatch.setattr(Int4Weight, "linear", lambda self, x, bias=None, gemm_dtype=False: torch.ops.kvserve.linear_int4(
            x.float(), self.nibbles, self.scales, self.group_size, self.high).to(x.dtype))
    kw = dict(dtype="float32", block_size=8, quantization=quantization)
    fused, layered, steps = fused_and_layered(moe_model_dir(name), prompts_for(4, 6), **kw)
    assert_same(fused, layered, tol)
    assert sum(f for _, _, f in steps) >= MAX_TOKENS - 1
    assert any(f and T > kernels.KERNEL_ROWS for T, _, f in steps)      # batches past KERNEL_ROWS fused


def test_fused_moe_refuses_a_spec_without_its_experts(moe_model_dir):
    """decode_layers checks the experts' tensors and spec ints it is given against the header."""
    llm = LLM(str(moe_model_dir("mixtral")), dtype="float32")
    fused = llm.engine.model.fused
    with pytest.raises(RuntimeError, match="lacks its experts' tensors|decode_layers got"):
        torch.ops.kvserve.decode_layers(torch.zeros(1, 64), fused.weights[:-3], fused.spec[:-2],
                                        llm.engine.model.rope_cos, llm.engine.model.rope_sin, torch.zeros(1, dtype=torch.long),
                                        [k for k, _ in llm.engine.runner.kv_caches], [v for _, v in llm.engine.runner.kv_caches],
                                        [], [], torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                                        torch.zeros(1, dtype=torch.long) + 8, 4, 2, 1e-5, 0.25, 0)


@pytest.fixture(scope="module")
def windowed_model_dir(tmp_path_factory):
    """A random Mistral with a sliding window of 8 (the shared fixture's has none)."""
    import transformers as tf
    cfg = tf.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                           initializer_range=0.15, bos_token_id=1, eos_token_id=2, sliding_window=8)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mistral_window8")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_HF / name, out / name)
    return out


def test_fused_step_with_a_sliding_window(windowed_model_dir):
    fused, layered, steps = fused_and_layered(windowed_model_dir, prompts_for(5, 3), block_size=4)
    assert LLM(str(windowed_model_dir)).engine.model.attn.sliding_window == 8
    assert_same(fused, layered, LOGPROB_TOL)
    assert any(f for _, _, f in steps)


@pytest.mark.parametrize("quantization, tol", [("int4", INT4_LOGPROB_TOL), ("int8", LOGPROB_TOL)])
def test_fused_step_with_quantized_weights(quantization, tol, random_model_dir):
    """Both paths run kvserve's int4 / int8 GEMVs at <= KERNEL_ROWS rows; tokens equal, logprobs
    within 1e-4 for int8, 1e-3 for int4 (measured 1.6e-4, against 1.4e-6 with int8). The int16
    route rounds each activation to a step of 2^-15 of its 32-block's largest, so a float32
    rounding difference between the paths (1e-7) can move an activation by a whole step: a
    1e-7 relative change of x measured a 5.5e-6 relative change of y."""
    fused, layered, steps = fused_and_layered(random_model_dir("llama"), prompts_for(3, 3),
                                              quantization=quantization, max_num_seqs=3)
    assert_same(fused, layered, tol)
    assert any(f for _, _, f in steps)


def test_fused_step_with_int5_weights(random_model_dir, tmp_path):
    """A GGUF Q5_0 file (every matrix int5: nibbles and a fifth bit) through the fused step and
    layer by layer: tokens equal, logprobs within int4's 1e-3."""
    from tests.model.gguf_files import write_hf_as_gguf
    path = write_hf_as_gguf(random_model_dir("llama"), tmp_path / "m.gguf", "Q5_0")
    fused, layered, steps = fused_and_layered(path, prompts_for(4, 3), max_num_seqs=3)
    assert_same(fused, layered, INT4_LOGPROB_TOL)
    assert any(f for _, _, f in steps)


def test_a_step_with_prefill_chunks_never_takes_the_fused_path(random_model_dir):
    """A short prompt decodes while a long one is still prefilled in chunks of the token budget:
    those mixed steps run layer by layer; the pure decodes run fused."""
    prompts = [[1, 7, 9, 11], [1] + list(range(3, 90))]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    fused, layered, steps = fused_and_layered(random_model_dir("llama"), prompts, **kw)
    assert_same(fused, layered, LOGPROB_TOL)
    mixed = [s for s in steps if 0 < s[1] < s[0]]
    assert mixed and not any(f for _, _, f in mixed)
    assert all(f == (T == nd) for T, nd, f in steps)            # and every pure decode step was fused


@pytest.mark.parametrize("kw, why", [(dict(dtype="float16"), "model dtype torch.float16"),
                                     (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype fp8_e4m3")])
def test_a_refused_model_logs_why_and_runs_layer_by_layer(kw, why, random_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.model.fused_decode"):
        llm = LLM(str(random_model_dir("llama")), **kw)
    assert llm.engine.core.model.fused is None
    assert any(why in r.getMessage() and "fused decode step off" in r.getMessage() for r in caplog.records)
    out = generate(llm, prompts_for(4, 2))
    assert [len(tokens) for tokens, _ in out] == [MAX_TOKENS, MAX_TOKENS]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_step_with_an_int8_kv_cache(arch, random_model_dir):
    """An int8 KV cache, written and read by the fused step as attention/kv_quant.py stores it
    (a scale per token and KV head, round half to even): the same tokens and logprobs within
    1e-4 as the layer-by-layer path over the same int8 cache."""
    fused, layered, steps = fused_and_layered(random_model_dir(arch), prompts_for(2, 4), block_size=8,
                                              kv_cache_dtype="int8")
    assert_same(fused, layered, LOGPROB_TOL)
    assert sum(f for _, _, f in steps) >= MAX_TOKENS - 1


def test_fused_step_with_a_bfloat16_kv_cache():
    """`kv_cache_dtype="bfloat16"` under a float32 model: K/V rounded to bfloat16 as they are
    written, by the fused step and the torch path alike (the step attends to the rounded values
    too): the same tokens, logprobs within 1e-3 (a float32 difference of 1e-7 can move a value
    across a bfloat16 rounding boundary; measured <= 5e-4); half the pool's bytes."""
    fused, layered, steps = fused_and_layered(STORIES_HF, prompts_for(7, 4), kv_cache_dtype="bfloat16", block_size=8)
    assert_same(fused, layered, 1e-3)
    assert sum(f for _, _, f in steps) >= MAX_TOKENS - 1
    llm = LLM(str(STORIES_HF), kv_cache_dtype="bfloat16", num_kv_blocks=8)
    assert {t.dtype for t in llm.engine.core.runner.kv_cache_tensors()} == {torch.bfloat16}


BF16_LOGPROB_TOL = 0.15      # a bfloat16 model's logprobs move by ~2^-8 of its logits


def test_fused_step_runs_a_bfloat16_model():
    """A bfloat16 model takes the fused step (its weights and KV cache bfloat16, the step's
    arithmetic float32) and tracks its layer-by-layer run, which computes in bfloat16: on the
    trained stories260K, greedy tokens equal while both paths agree (3 of 4 runs all the way;
    the fourth meets a near-tie), logprobs within bfloat16's rounding (measured <= 0.07)."""
    fused, layered, steps = fused_and_layered(STORIES_HF, prompts_for(7, 4), dtype="bfloat16", block_size=8)
    assert sum(f for _, _, f in steps) >= MAX_TOKENS - 1
    same = 0
    for (tokens, lps), (ref_tokens, ref_lps) in zip(fused, layered, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        same += n == len(tokens)
        assert n >= 1 and max(abs(a - b) for a, b in zip(lps[:n], ref_lps[:n])) < BF16_LOGPROB_TOL
    assert same >= 3


def test_takes_only_pure_decode_steps_it_holds():
    fused = FusedDecode.__new__(FusedDecode)
    fused.max_rows = 3
    assert fused.takes(1, 1) and fused.takes(3, 3)
    assert not fused.takes(4, 4) and not fused.takes(5, 1) and not fused.takes(5, 0) and not fused.takes(0, 0)
