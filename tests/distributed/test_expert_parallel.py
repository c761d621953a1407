"""Expert parallelism (`--enable-expert-parallel`, kvserve/model/sharding.py): with
tensor_parallel_size 2 each rank holds half of every MoE layer's experts whole (and half of the
attention heads), computes them for the tokens routed there, and the MLP's all-reduce adds the
partial sums. Mixtral, Qwen2-MoE (the shared expert split like a dense MLP), Qwen3-MoE with a
dense layer among its MoE ones and the fused expert layout give greedy tokens equal to
transformers' and logprobs within 1e-4 (float32) under chunked prefill and small blocks; what
cannot split is refused with the reason."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.sharding import shard_config, shard_weights
from kvserve.model.loaders.checkpoint import load_model_dir
from tests.model.test_moe_models import MAX_TOKENS, _fuse_experts, moe_dir, prompts_for  # noqa: F401
from tests.reference.hf_reference import hf_greedy

SETTINGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=7, max_num_seqs=4)


def check_ep2(model_dir, ref_dir=None):
    llm = LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS)
    prompts = prompts_for(3, 3)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
        llm.engine.check_integrity()
    finally:
        llm.engine.shutdown()
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lps = hf_greedy(str(ref_dir or model_dir), p, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe_mixed"])
def test_ep2_equals_transformers(name, moe_dir):
    check_ep2(moe_dir(name))


def test_each_rank_holds_half_the_experts_whole_and_the_fused_layout_splits_too(moe_dir, tmp_path):
    src = moe_dir("qwen2_moe")
    cfg, weights, _ = load_model_dir(str(src))
    for rank, mine in ((0, {0, 1}), (1, {2, 3})):
        w = shard_weights(weights, cfg, rank, 2)
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in w if ".experts." in n}
        assert held == mine
        name = "model.layers.0.mlp.experts.1.gate_proj.weight"
        if rank == 0:
            assert w[name].shape == weights[name].shape          # whole, not sliced
        assert w["model.layers.0.mlp.shared_expert.gate_proj.weight"].shape[0] == 24     # 48 / 2
    assert shard_config(cfg, 2, True).shared_expert_intermediate_size == 24
    fused = tmp_path / "fused"
    _fuse_experts(moe_dir("qwen3_moe"), fused)
    check_ep2(fused, ref_dir=moe_dir("qwen3_moe"))


def test_what_cannot_split_by_experts_is_refused(moe_dir, random_model_dir):
    with pytest.raises(ValueError, match="give --enable-expert-parallel"):
        LLM(str(moe_dir("mixtral")), dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="q/k norms run over every head's width"):
        LLM(str(moe_dir("olmoe")), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="has none"):
        LLM(str(random_model_dir("qwen3")), dtype="float32", enable_expert_parallel=True)


def test_a_gguf_moe_file_splits_by_experts(moe_dir, tmp_path):
    """llama.cpp's stacked ffn_*_exps tensors, split per expert at load, then by rank."""
    from tests.model.test_gguf_moe import write_moe_gguf

    hf_dir = moe_dir("mixtral")
    check_ep2(write_moe_gguf(hf_dir, tmp_path / "m.gguf"), ref_dir=hf_dir)
