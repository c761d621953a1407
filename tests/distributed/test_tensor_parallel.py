"""Tensor parallelism (kvserve/distributed/): tensor_parallel_size=2 over gloo with the mp executor gives
the greedy tokens of tensor_parallel_size=1 and of transformers, logprobs within 1e-4 in float32
(the all-reduce changes the summation order), under chunked prefill, tiny blocks, prefix hits and
preemption in both modes; a worker that dies fails the step with a clear error, at once."""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.sharding import check_tp_size, shard_config
from kvserve.model.config import ModelConfig

from tests.conftest import STORIES_HF
from tests.reference.hf_reference import hf_greedy

PREFIX = [1, 45, 67, 89, 101, 23, 56, 78, 90, 12, 34, 56, 78, 9, 10, 11, 12, 13]
PROMPTS = [PREFIX + [200 + i, 300 + i] for i in range(3)] + [[1, 7, 8, 9], [1] + list(range(100, 140))]
MAX_TOKENS = 24
# Chunked prefill (budget 16), tiny blocks, a pool small enough to preempt, prefix caching on.
CONSTRAINED = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=24)


def build_kv1_model(out_dir) -> str:
    """A random Llama with ONE KV head (replicated on both ranks) and a vocabulary of 509 (odd:
    the last vocabulary shard is padded)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=509, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                         rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(1)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_HF / name, out_dir / name)
    return str(out_dir)


def run(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def close(llm: LLM) -> None:
    llm.engine.shutdown()


@pytest.mark.parametrize("arch,mode", [("qwen3", "recompute"), ("llama3", "swap"), ("kv1", "recompute")])
def test_tp2_equals_tp1_and_transformers(random_model_dir, tmp_path, arch, mode):
    """qwen3: q/k norms and qkv split; llama3: tied (vocabulary-parallel) embedding; kv1: one
    KV head replicated, an odd vocabulary."""
    model = build_kv1_model(tmp_path) if arch == "kv1" else str(random_model_dir(arch))
    tp2 = LLM(model, tensor_parallel_size=2, preemption_mode=mode, **CONSTRAINED)
    try:
        got = run(tp2)
        stats = tp2.engine.stats()
    finally:
        close(tp2)
    want = run(LLM(model, preemption_mode=mode, **CONSTRAINED))
    for (toks, lps), (wtoks, wlps), prompt in zip(got, want, PROMPTS):
        assert toks == wtoks
        assert lps == pytest.approx(wlps, abs=1e-4)
        ref_toks, ref_lps = hf_greedy(model, prompt, MAX_TOKENS)
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-4)
    # the constraints were exercised, not just configured
    assert stats.prefix_cache_hits_total > 0
    assert stats.num_preemptions_total > 0


def test_a_dead_worker_fails_the_step_at_once():
    llm = LLM(str(STORIES_HF), tensor_parallel_size=2)
    try:
        engine = llm.engine
        engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        worker = engine.core.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        # the very next step names the dead worker (not a collective's 60 s timeout, not a hang)
        with pytest.raises(RuntimeError, match="tensor-parallel worker 1 died"):
            engine.step()
    finally:
        close(llm)


def test_shapes_that_cannot_be_split_are_refused_clearly():
    cfg = ModelConfig(architecture="llama", vocab_size=100, hidden_size=48, intermediate_size=96, num_layers=1, num_heads=6,
                      num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        check_tp_size(cfg, 4)
    with pytest.raises(ValueError, match="3 and the model's 2 KV heads"):
        check_tp_size(cfg, 3)
    half = shard_config(cfg, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size) == (3, 1, 48)


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_ray_executor_runs_the_same_workers(split):
    """distributed_executor_backend="ray": the workers (tensor-parallel ranks or pipeline stages)
    are Ray actors on a local Ray instance (started here, stopped after), running the same worker
    code: the same tokens as one process."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():        # a Ray another test left connected: start our own
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        tp2 = LLM(str(STORIES_HF), distributed_executor_backend="ray", **split)
        try:
            got = run(tp2)
        finally:
            close(tp2)
    finally:
        ray.shutdown()
    want = run(LLM(str(STORIES_HF)))
    for (toks, lps), (wtoks, wlps) in zip(got, want):
        assert toks == wtoks
        assert lps == pytest.approx(wlps, abs=1e-4)


def test_server_with_a_dead_tp_worker_fails_requests_and_reports_unhealthy():
    import httpx

    from tests.server.live import LiveServer
    from tests.server.test_engine_process import core_pid

    server = LiveServer("--tensor-parallel-size", "2")
    try:
        r = httpx.post(server.base_url + "/v1/completions", trust_env=False, timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        core = core_pid(server)
        workers = [int(c) for c in open(f"/proc/{core}/task/{core}/children").read().split()
                   if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        # the dead worker is seen before the next forward pass; the 30 s timeout (half the
        # collectives' COLLECTIVE_TIMEOUT) raises if the core waited on it instead
        r = httpx.post(server.base_url + "/v1/completions", trust_env=False, timeout=30,
                       json={"prompt": "Once upon a time", "max_tokens": 50})
        assert r.status_code in (500, 503)
        assert httpx.get(server.base_url + "/health", trust_env=False, timeout=30).status_code == 500
        assert "tensor-parallel worker 1 died" in server.log()
    finally:
        server.stop()
