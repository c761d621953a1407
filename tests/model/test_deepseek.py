"""DeepSeek-V2 / V3 (kvserve/model/deepseek.py, multi-head latent attention: kvserve/attention/mla.py)
against transformers' DeepseekV2 / DeepseekV3: tiny random checkpoints saved with save_pretrained --
one V2-shaped (q_lora_rank, YaRN with mscale_all_dim, greedy routing times routed_scaling_factor, a
dense first layer), one V2-Lite-shaped (q_proj, group_limited_greedy, two shared experts), two V3
(sigmoid router with a selection bias, groups by their best two, renormalised; one rotating halves:
rope_interleave false) -- give kvserve's
greedy tokens equal to transformers' and logprobs within 1e-4 (float32) with the default engine,
tiny blocks with chunked prefill (mixed decode + prefill steps), prefix caching, preemption by
recompute and by swap, speculative decoding with an int8 draft, and beam search equal to the
reference beam search. The cache holds kv_lora_rank + qk_rope_head_dim numbers a token and layer;
an int8 cache's outputs do not depend on chunking, preemption or prefix hits; decode attention
(absorbed) equals prefill attention (expanded) on the same context; the differential fuzzer
finds a constrained engine equal to an unconstrained one on the MLA model; configs kvserve does
not run are refused by field."""
from __future__ import annotations

import json
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.mla import MlaAttention
from kvserve.model.deepseek import DeepseekV2Model
from kvserve.model.loaders.checkpoint import read_model_config
from kvserve.sample.params import BeamSearchParams
from kvserve.worker.model_runner import ModelRunner
from tests.conftest import built_once, perturb_norms
from tests.reference.hf_reference import hf_greedy
from tests.reference.test_differential import check_model_constrained_equals_unconstrained
from tests.reference.test_beam_search import compare, reference_beam_search

MAX_TOKENS = 10
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=24, first_k_dense_replace=1)
MODELS = {
    "v2": dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               routed_scaling_factor=1.5, topk_method="greedy",
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
                                "beta_fast": 32, "beta_slow": 1}),
    # what a deepseek2 GGUF can say (tests/model/test_gguf_deepseek.py): mscale = mscale_all_dim
    "v2_gguf": dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                    routed_scaling_factor=1.5, topk_method="greedy",
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
                                     "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V3: sigmoid router + selection bias, groups by their best two, renormalised, scaled
    "v3": dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
               topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "v3_halves": dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2,
                      topk_group=1, norm_topk_prob=False, rope_interleave=False),
    "v2_lite": dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                    topk_method="group_limited_greedy", n_group=4, topk_group=2),
}
SETTINGS = {
    "default": dict(),
    "chunked_small_blocks": dict(block_size=2, max_num_batched_tokens=7, max_num_seqs=4),
    "prefix_cache": dict(block_size=4, num_kv_blocks=256, prefix_cache="radix"),
    "preempt_recompute": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8),
    "preempt_swap": dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8,
                         preemption_mode="swap"),
    "speculative": dict(speculative_config={"model": "self-int8", "num_speculative_tokens": 3}),
}


def build_deepseek(name: str, out_dir, seed: int = 0):
    """A tiny random DeepSeek-V2 checkpoint of `name` (MODELS), norm weights perturbed off 1."""
    import transformers as tf

    config_class = tf.DeepseekV3Config if name.startswith("v3") else tf.DeepseekV2Config
    cfg = config_class(**{**COMMON, **MODELS[name]})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb_norms(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):     # V3's selection bias (zeros at init)
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return built_once(tmp_path_factory, build_deepseek)


def prompts_for(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 512) for _ in range(9)]      # a shared prefix for the cache
    return [system + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def check(model_dir, settings, prompts, ref_dir=None):
    llm = LLM(str(model_dir), dtype="float32", **settings)
    if settings.get("prefix_cache"):
        generate(llm, prompts[:1])              # its blocks are cached: the others hit its prefix
    for p, got in zip(prompts, generate(llm, prompts)):
        ref_tokens, ref_lps = hf_greedy(str(ref_dir or model_dir), p, MAX_TOKENS)
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    eng = llm.engine
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return llm


@pytest.mark.parametrize("name,setting", [(n, s) for n in MODELS for s in SETTINGS
                                          if n == "v2" or (n in ("v2_lite", "v3", "v3_halves")
                                                           and s in ("default", "chunked_small_blocks"))
                                          or (n == "v3" and s in ("preempt_swap", "prefix_cache"))])
def test_matches_transformers(name, setting, ds_dir):
    llm = check(ds_dir(name), SETTINGS[setting], prompts_for(list(MODELS).index(name)))
    model, stats = llm.engine.model, llm.engine.stats()
    assert type(model) is DeepseekV2Model and isinstance(model.attn, MlaAttention)
    assert model.fused is None
    assert [layer.dense_mlp for layer in model.layers] == [True, False, False]
    if setting.startswith("preempt"):
        assert stats.num_preemptions_total > 0
        assert (stats.num_swap_preemptions_total > 0) == (setting == "preempt_swap")
    if setting == "prefix_cache":
        assert stats.prefix_cache_hits_total > 0
    if setting == "speculative":
        assert stats.spec_decode_num_accepted_tokens > 0


def test_the_cache_holds_the_latent_and_the_rope_part_only(ds_dir):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim numbers (32 + 8), not 2 * H * D."""
    llm = LLM(str(ds_dir("v2")), dtype="float32", block_size=4, num_kv_blocks=16)
    cfg = llm.engine.model.cfg
    assert ModelRunner.kv_bytes_per_block(cfg, 4, torch.float32) == 3 * 4 * (32 + 8) * 4
    assert ModelRunner.kv_bytes_per_block(cfg, 4, torch.float32, "int8") == 3 * 4 * (32 + 8 + 2 * 4)
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 3
    for latent, pe in caches:                       # (the null block, then 16)
        assert latent.shape == (17, 1, 4, 32) and pe.shape == (17, 1, 4, 8)


def test_int8_cache_does_not_depend_on_scheduling(ds_dir):
    """An int8 latent cache: the same tokens under chunking, tiny blocks, preemption (both modes)
    and prefix hits as in one plain run; its first token's logprob within 0.05 of float32's."""
    model_dir, prompts = str(ds_dir("v2")), prompts_for(7)
    base = generate(LLM(model_dir, dtype="float32", kv_cache_dtype="int8"), prompts)
    for settings in SETTINGS.values():
        if "speculative_config" in settings:
            continue
        llm = LLM(model_dir, dtype="float32", kv_cache_dtype="int8", **settings)
        got = generate(llm, prompts)
        assert [g.token_ids for g in got] == [b.token_ids for b in base], settings
        llm.engine.check_integrity()
    ref = generate(LLM(model_dir, dtype="float32"), prompts)
    for g, r in zip(base, ref):             # the first token's distribution: close to float32's
        assert g.token_ids[0] == r.token_ids[0]
        assert abs(g.logprobs[0][g.token_ids[0]].logprob - r.logprobs[0][r.token_ids[0]].logprob) < 0.05


def test_absorbed_decode_equals_expanded_prefill():
    """The decode path (up-projections absorbed into q and the output) and the prefill path
    (latents expanded into per-head K and V) give the same attention on the same cached context."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk

    torch.manual_seed(0)
    H, R, P, nope, vd, bs, n = 4, 32, 8, 16, 12, 4, 11
    attn = MlaAttention(H, R, P, nope, vd, bs, scale=0.2)
    caches = [torch.zeros(s) for s in attn.cache_shapes(8)]
    q_nope, q_pe = torch.randn(n, H, nope), torch.randn(n, H, P)
    latent, k_pe = torch.randn(n, 1, R), torch.randn(n, 1, P)
    kv_b = torch.randn(H, nope + vd, R) * 0.2
    table = torch.tensor([3, 5, 1, 7])
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, n, n, table)])
    prefill = attn.forward(q_nope, q_pe, latent, k_pe, *caches, attn.prepare(meta), kv_b)     # [n, H, vd]
    # the last token again, as a decode row over the same n cached tokens
    meta = AttentionMetadata(slot_mapping=slots[-1:], num_decode_tokens=1, decode_block_tables=table[None],
                             decode_context_lens=torch.tensor([n]))
    decode = attn.forward(q_nope[-1:], q_pe[-1:], latent[-1:], k_pe[-1:], *caches, attn.prepare(meta), kv_b)
    torch.testing.assert_close(decode[0], prefill[-1], atol=1e-5, rtol=1e-5)


def test_beam_search_matches_reference(ds_dir):
    model_dir = ds_dir("v2")
    prompt = prompts_for(3, 1)[0]
    ref = reference_beam_search(model_dir, prompt, 3, 6, 1.0)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128)
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    compare(out.sequences, ref, prompt, 1.0)
    assert llm.engine.stats().num_cow_copies_total > 0


@pytest.mark.parametrize("setting", [1, 2, 3])
def test_differential_constrained_equals_unconstrained(setting, ds_dir):
    """The differential fuzzer's random workloads (greedy, sampled, beams, late arrivals, aborts)
    on the MLA model: a constrained engine (tiny pools, chunking, swap / recompute, radix hits)
    equals an unconstrained one, integrity checked after every step."""
    check_model_constrained_equals_unconstrained(str(ds_dir("v2")), setting, (setting, setting + 10), dtype="float32")


def _edit(src, dst, **config):
    dst.mkdir()
    cfg = {**json.loads((src / "config.json").read_text()), **config}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


@pytest.mark.parametrize("config,words", [
    (dict(norm_topk_prob=True), "norm_topk_prob=true"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=2), "n_group=3, topk_group=2 do not split"),
    (dict(n_routed_experts=6), "holds 8 experts and a router of 8 in layer 1"),
    (dict(moe_intermediate_size=20), r"experts.0.gate_proj.weight should be \[20, 64\]"),
])
def test_configs_kvserve_does_not_run_are_refused(config, words, ds_dir, tmp_path):
    bad = _edit(ds_dir("v2"), tmp_path / "bad", **config)
    with pytest.raises(ValueError, match=words):
        read_model_config(str(bad))


def test_tensor_parallelism_is_refused(ds_dir):
    with pytest.raises(ValueError, match="not built for multi-head latent attention"):
        LLM(str(ds_dir("v2")), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("backend", ["torch", "cpu_fused"])
def test_a_backend_without_mla_is_refused(backend, ds_dir):
    with pytest.raises(ValueError, match=f"attention backend {backend} cannot run .*multi-head latent attention"):
        LLM(str(ds_dir("v2")), dtype="float32", attention_backend=backend)


def test_yarn_rope_on_a_llama_matches_transformers(tmp_path):
    """YaRN (rope_type "yarn", which DeepSeek-V2 uses) on the Llama family too: positions past the
    original context, exact against transformers."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.15, rope_parameters={"rope_type": "yarn", "factor": 8.0,
                                                                  "original_max_position_embeddings": 64,
                                                                  "rope_theta": 10000.0})
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    rng = random.Random(0)
    prompt = [1] + [rng.randrange(3, 512) for _ in range(100)]
    got = generate(LLM(str(tmp_path), dtype="float32"), [prompt], 8)[0]
    ref_tokens, ref_lps = hf_greedy(str(tmp_path), prompt, 8)
    assert got.token_ids == ref_tokens
    assert max(abs(lp[t].logprob - r) for lp, t, r in zip(got.logprobs, got.token_ids, ref_lps)) < 1e-4


def test_embeddings_of_a_deepseek_model_equal_transformers(ds_dir):
    """--task embed on an MLA model: each prompt's last hidden state (after the final norm),
    normalized, equals transformers' (a packed batch of different lengths, no cache)."""
    from transformers import AutoModelForCausalLM

    from kvserve.config import EngineConfig
    from kvserve.pooling.models import load_embedding_model

    model_dir = str(ds_dir("v2"))
    model = load_embedding_model(EngineConfig(model=model_dir, dtype="float32"))
    prompts = prompts_for(21)
    got = model.embed(prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([torch.nn.functional.normalize(
            hf.model(torch.tensor([p])).last_hidden_state[0, -1], dim=0) for p in prompts])
    assert (got - ref).abs().max() < 1e-4
