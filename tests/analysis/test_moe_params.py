"""The planner's parameter counts from a config.json against transformers' own models: total
parameters (memory) and, for a mixture of experts, the parameters a token multiplies (decode
bandwidth, seed 001's N_act), and `kvserve plan ceiling` reading both from a model directory."""
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from kvserve.analysis.specs import model_from_hf_config  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=200, tie_word_embeddings=False)
CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 6, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 32,
                                                 "shared_expert_intermediate_size": 48}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                                                 "moe_intermediate_size": 24, "mlp_only_layers": [1]}),
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 4, "num_experts_per_tok": 3}),
    # multi-head latent attention (with and without q_lora_rank), a dense first layer, shared experts
    "deepseek_v2": (transformers.DeepseekV2Config, {"n_routed_experts": 6, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 24, "n_shared_experts": 2,
                                                     "first_k_dense_replace": 1, "kv_lora_rank": 32,
                                                     "q_lora_rank": 48, "qk_nope_head_dim": 16,
                                                     "qk_rope_head_dim": 8, "v_head_dim": 12}),
    "deepseek_v3": (transformers.DeepseekV3Config, {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 24, "n_shared_experts": 1,
                                                     "first_k_dense_replace": 2, "kv_lora_rank": 32,
                                                     "q_lora_rank": 48, "qk_nope_head_dim": 16, "n_group": 4,
                                                     "topk_group": 2, "qk_rope_head_dim": 8, "v_head_dim": 12}),
    "deepseek_v2_lite": (transformers.DeepseekV2Config, {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                                          "moe_intermediate_size": 24, "kv_lora_rank": 32,
                                                          "q_lora_rank": None, "qk_nope_head_dim": 16,
                                                          "qk_rope_head_dim": 8, "v_head_dim": 12}),
}


def _routed_expert_params(model) -> int:
    """What a token does not multiply: every MoE layer's unrouted experts, read off the modules."""
    skipped = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        n_experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") \
            else model.config.num_experts
        per_expert = sum(p.numel() for p in experts.parameters()) // n_experts
        skipped += (n_experts - model.config.num_experts_per_tok) * per_expert
    return skipped


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_param_counts_equal_transformers(kind):
    cls, extra = CONFIGS[kind]
    config = cls(**BASE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    spec = model_from_hf_config(config.to_dict(), kind)
    total = sum(p.numel() for p in model.parameters())
    assert spec.n_params == total
    assert spec.n_act == total - _routed_expert_params(model)
    if "num_experts_per_tok" in extra:
        assert spec.n_act < spec.n_params and spec.top_k == extra["num_experts_per_tok"]
        assert spec.n_experts == extra.get("num_local_experts", extra.get("num_experts", extra.get("n_routed_experts")))
    else:
        assert spec.n_active is None and spec.n_experts is None


def test_plan_ceiling_reads_a_moe_directory(tmp_path):
    cls, extra = CONFIGS["qwen2_moe"]
    cls(**BASE, **extra).save_pretrained(tmp_path)
    spec = model_from_hf_config(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "ceiling", "--model", str(tmp_path),
                          "--batch", "1", "4", "--seq-len", "128"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MoE_params_read_B" in out.stdout
    lines = out.stdout.splitlines()
    assert lines[1].split()[-3] == "MoE_params_read_B"       # the table's last three columns are MoE's
    rows = {line.split()[0]: {"MoE_params_read_B": line.split()[-3]} for line in lines
            if line.split()[:1] in (["1"], ["4"])}
    # one token reads the active parameters; four tokens touch more experts, never more than all
    assert float(rows["1"]["MoE_params_read_B"]) == pytest.approx(spec.n_act / 1e9, rel=5e-3)
    assert spec.n_act / 1e9 < float(rows["4"]["MoE_params_read_B"]) < spec.n_params / 1e9


def test_moe_presets_match_published_counts():
    from kvserve.analysis.specs import MODELS
    mixtral, qwen = MODELS["mixtral-8x7b"], MODELS["qwen3-30b-a3b"]
    # Mistral: 46.7B parameters, 12.9B active per token; Qwen: 30.5B, 3.3B active (3.35B: it rounds down)
    assert (round(mixtral.n_params / 1e9, 1), round(mixtral.n_act / 1e9, 1)) == (46.7, 12.9)
    assert (round(qwen.n_params / 1e9, 1), round(qwen.n_act / 1e9, 1)) == (30.5, 3.4)
    assert (mixtral.n_experts, mixtral.top_k, qwen.n_experts, qwen.top_k) == (8, 2, 128, 8)
    # DeepSeek: V2-Lite has 15.7B parameters (2.4B active: without the 0.2B input embedding table)
    lite = MODELS["deepseek-v2-lite"]
    assert round(lite.n_params / 1e9, 1) == 15.7
    assert 2.4 <= (lite.n_act - lite.vocab_size * lite.d_model) / 1e9 < 2.5          # (DeepSeek rounds down)
    v3 = MODELS["deepseek-v3"]                                   # 671B parameters, 37B active
    assert round(v3.n_params / 1e9) == 671 and round((v3.n_act - v3.vocab_size * v3.d_model) / 1e9) == 37


def test_plan_kv_reports_the_mla_saving(capsys):
    """`kvserve plan kv` on DeepSeek-V2-Lite: 27 layers x (512 + 64) bf16 numbers a token against
    27 x 16 heads x (192 + 128) with full K/V, 8.9x, and the contexts that fit either way."""
    from kvserve.analysis.cli import main

    assert main(["plan", "kv", "--model", "deepseek-v2-lite", "--seq-len", "4096", "--budget-gib", "8"]) == 0
    out = {line[:41].strip(): line[41:].strip() for line in capsys.readouterr().out.splitlines()}
    assert out["KV bytes / token"] == f"{27 * 576 * 2:,}"
    assert out["KV bytes / token with full K/V"] == f"{27 * 16 * 320 * 2:,}"
    assert out["MLA saving (full K/V / latent)"] == "8.89"
    assert out["contexts of 4096 that fit"] == str(8 * 2**30 // (27 * 576 * 2 * 4096))
    assert out["contexts of 4096 that fit with full K/V"] == str(8 * 2**30 // (27 * 16 * 320 * 2 * 4096))
