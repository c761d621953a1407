"""Mixture-of-experts models (kvserve/model/moe_models.py) against transformers: for Mixtral,
Qwen2-MoE (shared expert), Qwen3-MoE (also with a dense layer among MoE ones) and OLMoE (q/k
norms over the full width, clip_qkv), tiny random checkpoints saved with save_pretrained give
kvserve's greedy tokens equal to transformers' and logprobs within 1e-4 (float32), with the
default engine, with small blocks, chunked prefill and prefix caching, and with an int8 copy of
the model drafting for speculative decoding. Also: the fused expert layout loads to the same
outputs; checkpoints whose experts do not match config.json are refused before a model is
built; int8 / int4 quantize every expert; the fused CPU decode step stays off; pipeline stages
keep each layer's kind; tensor parallelism without expert parallelism is refused
(tests/distributed/test_expert_parallel.py runs it); ModelConfig.mlp_params (the draft
footprint's count) counts every expert."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams, kernels
from kvserve.model.fused_decode import FusedDecode
from kvserve.model.fusion import _float
from kvserve.model.loaders.checkpoint import read_model_config
from kvserve.model.moe_models import MoeModel
from kvserve.model.quant.formats import QuantizedWeight, keeps_quantized, quantize
from tests.model.test_quant import teacher_forced
from tests.conftest import built_once, perturb_norms
from tests.reference.hf_reference import hf_greedy
from tests.reference.test_differential import check_model_constrained_equals_unconstrained

MAX_TOKENS = 10
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, num_experts_per_tok=2)
MODELS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, head_dim=32,
                                         norm_topk_prob=True)),
    "qwen3_moe_mixed": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
                                               num_hidden_layers=3, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, intermediate_size=32, clip_qkv=1.0)),
}
SETTINGS = {
    "default": dict(),
    "chunked_small_blocks": dict(block_size=4, max_num_batched_tokens=7, max_num_seqs=4),
    "prefix_cache": dict(block_size=4, num_kv_blocks=256, prefix_cache="radix"),
    # an int8 copy of the model drafts 3 tokens, the float32 model verifies them
    "speculative": dict(speculative_config={"model": "self-int8", "num_speculative_tokens": 3}),
}


def build_moe_model(name: str, out_dir, seed: int = 0):
    """A tiny random MoE checkpoint of `name` (MODELS), norm weights perturbed off 1."""
    import transformers as tf

    cls, extra = MODELS[name]
    cfg = getattr(tf, cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb_norms(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return built_once(tmp_path_factory, build_moe_model)


def prompts_for(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, 512) for _ in range(9)]      # a shared prefix for the cache
    return [system + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def check(model_dir, settings, prompts, ref_dir=None):
    llm = LLM(str(model_dir), dtype="float32", **settings)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(str(ref_dir or model_dir), p, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    llm.engine.check_integrity()
    return llm


@pytest.mark.parametrize("name,setting", [(n, s) for n in MODELS for s in SETTINGS
                                          if n != "qwen3_moe_mixed" or s == "default"])
def test_matches_transformers(name, setting, moe_dir):
    llm = check(moe_dir(name), SETTINGS[setting], prompts_for(list(MODELS).index(name)))
    model = llm.engine.model
    assert type(model) is MoeModel
    if setting == "speculative":    # drafts were made and some verified
        assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    if name == "qwen3_moe_mixed":
        assert [layer.dense_mlp for layer in model.layers] == [False, True, False]
    if setting == "default":
        # what the draft model's footprint (spec_decode/draft.py) counts: every expert
        mlp = [w for layer in model.layers for w in layer.linears()[2:]]
        mlp += [t for layer in model.layers if not layer.dense_mlp
                for t in (layer.router, layer.shared_gate) if t is not None]
        assert sum(w.numel() for w in mlp) == model.cfg.mlp_params()
        # the fused decode step runs the experts too (tests/kernels/test_fused_step.py); OLMoE's
        # full-width q/k norms keep it off
        why = FusedDecode._why_not(model)
        if name == "olmoe":
            assert model.fused is None and ("full width" in why or "kernels" in why)
        else:
            assert (model.fused is not None) == kernels.available(model.device)


def _fuse_experts(src, dst):
    """`src`'s checkpoint rewritten with experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = [w.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
        up = [w.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
        down = [w.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
        w[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        w[p + "down_proj"] = torch.stack(down)
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_fused_expert_layout_loads_the_same_model(moe_dir, tmp_path):
    src = moe_dir("qwen2_moe")
    check(_fuse_experts(src, tmp_path / "fused"), {}, prompts_for(5, 2), ref_dir=src)


def _edit(src, dst, config=None, drop=lambda name: False):
    dst.mkdir()
    cfg = {**json.loads((src / "config.json").read_text()), **(config or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not drop(k)}, str(dst / "model.safetensors"))
    return dst


FIELD = r"num_experts \(Mixtral: num_local_experts\) is "


@pytest.mark.parametrize("name,config,drop,words", [
    ("qwen3_moe", {"num_local_experts": 6, "num_experts": 6}, None,
     r"holds 8 experts and a router of 8 in layer 0 .*" + FIELD + "6"),
    ("mixtral", {"num_local_experts": 4}, None, r"holds 8 experts .*" + FIELD + "4"),
    ("olmoe", None, lambda k: ".experts." in k, r"lacks the expert tensors of MoE layer 0 .*" + FIELD + "8"),
    ("qwen2_moe", None, lambda k: k.endswith("experts.3.up_proj.weight"), r"expert 3 of layer 0 .*lacks its up"),
    ("qwen2_moe", None, lambda k: "experts.3." in k, r"holds 3 experts .*" + FIELD + "4"),
    ("qwen3_moe", None, lambda k: k.endswith("mlp.gate.weight"), r"no router model.layers.0.mlp.gate.weight"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, None, r"num_experts_per_tok=9 must be between 1 and num_experts=8"),
    ("qwen3_moe", {"moe_intermediate_size": 48}, None,
     r"experts.0.gate_proj.weight should be \[48, 64\] .*moe_intermediate_size .* it is \[32, 64\]"),
    ("qwen2_moe", None, lambda k: "shared_expert." in k, r"shared_expert.gate_proj.weight should be .* missing"),
])
def test_mismatched_checkpoints_are_refused_before_building(name, config, drop, words, moe_dir, tmp_path,
                                                            monkeypatch):
    bad = _edit(moe_dir(name), tmp_path / "bad", config, drop or (lambda k: False))
    with pytest.raises(ValueError, match=words):
        read_model_config(str(bad))

    def never(*args, **kwargs):
        raise AssertionError("a model was built from a refused checkpoint")

    monkeypatch.setattr(MoeModel, "__init__", never)
    with pytest.raises(ValueError, match=words):
        LLM(str(bad), dtype="float32")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_covers_every_expert(method, moe_dir):
    """Every expert's (and the shared expert's) weights are quantized, none left in float; the run
    tracks the float32 one as closely as a dense model's does (test_quant.BOUNDS)."""
    model_dir = str(moe_dir("qwen2_moe"))
    base = LLM(model_dir, dtype="float32").engine.model
    qmodel = LLM(model_dir, dtype="float32", quantization=method).engine.model
    for layer, ref in zip(qmodel.layers, base.layers):
        pairs = list(zip(layer.experts_gate_up + layer.experts_down + [layer.shared_gate_up, layer.shared_down],
                         ref.experts_gate_up + ref.experts_down + [ref.shared_gate_up, ref.shared_down]))
        assert len(pairs) == 2 * 4 + 2
        for w, dense in pairs:
            if keeps_quantized("cpu"):
                assert isinstance(w, QuantizedWeight)
            expected = _float(quantize(dense, method, None, torch.float32, "cpu", "w"))
            assert torch.equal(_float(w).float(), expected.float())
        assert torch.equal(layer.router, ref.router)            # the router stays in the model dtype
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(model_dir, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    top1, kl = teacher_forced(qmodel, base, prompts, ref)
    print(f"{method}: top-1 {top1:.3f}, KL {kl:.4f}")
    assert top1 >= {"int8": 0.85, "int4": 0.3}[method] and kl <= {"int8": 0.005, "int4": 0.3}[method]


def test_tensor_parallelism_needs_expert_parallelism(moe_dir):
    with pytest.raises(ValueError, match="by experts: give --enable-expert-parallel"):
        LLM(str(moe_dir("mixtral")), dtype="float32", tensor_parallel_size=2)


def test_pipeline_stages_keep_each_layers_kind(moe_dir):
    """The mixed model (layer 1 dense) split into three one-layer stages (model/stages.py), run
    stage after stage in process, gives the whole model's logits: each stage decides MoE or dense
    by its layers' numbers in the whole model."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
    from kvserve.model.loaders.checkpoint import load_model_dir
    from kvserve.model.stages import stage_config, stage_of, stage_weights

    model_dir = str(moe_dir("qwen3_moe_mixed"))
    full = LLM(model_dir, dtype="float32").engine.model
    cfg, weights, _ = load_model_dir(model_dir)
    stages = [stage_of(cfg, i, 3) for i in range(3)]
    models = [MoeModel(stage_config(cfg, s), stage_weights(weights, cfg, s), full.attn, torch.device("cpu"),
                       torch.float32, stage=s) for s in stages]
    assert [m.layers[0].dense_mlp for m in models] == [False, True, False]
    ids = prompts_for(11, 1)[0]
    T, bs = len(ids), full.attn.block_size
    nb = -(-T // bs)

    def run(model, x):
        caches = [(torch.zeros(model.attn.cache_shape(nb)), torch.zeros(model.attn.cache_shape(nb)))
                  for _ in model.layers]
        meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillChunk(0, T, T, torch.arange(nb))])
        return model.run_layers(x, torch.arange(T), meta, caches)

    x = models[0].embed_tokens(torch.tensor(ids))
    for m in models:
        x = run(m, x)
    got = models[-1].logits(models[-1].final_hidden(x, torch.arange(T)))
    want = full.logits(full.final_hidden(run(full, full.embed_tokens(torch.tensor(ids))), torch.arange(T)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_pipeline_parallel_processes_match_transformers(moe_dir):
    """The mixed Qwen3-MoE across three stage processes (kvserve/distributed/pipeline.py), three
    micro-batches, chunked prefill and tiny blocks: transformers' tokens and logprobs."""
    llm = check(moe_dir("qwen3_moe_mixed"), dict(pipeline_parallel_size=3, pipeline_micro_batches=3, block_size=4,
                                                 max_num_batched_tokens=16, max_num_seqs=4), prompts_for(12))
    assert llm.engine.core.model.num_micro_batches_total > llm.engine.core.model.num_steps_total
    llm.engine.shutdown()


@pytest.mark.parametrize("setting", [1, 3])
def test_differential_constrained_equals_unconstrained(setting, moe_dir):
    """The differential fuzzer's random workloads (greedy, sampled, beams, late arrivals, aborts)
    on an MoE model (Qwen2-MoE, its shared expert too): a constrained engine (tiny pools,
    chunking, swap, radix hits) equals an unconstrained one, integrity checked after every step."""
    check_model_constrained_equals_unconstrained(str(moe_dir("qwen2_moe")), setting, (setting, setting + 10), dtype="float32")
