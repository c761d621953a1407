"""CLI flags generated from the config fields (kvserve/config/cli_args.py): one place for each
default and help text, every field a flag, `kvserve serve --help` lists them all, and a command
line round-trips to the same EngineConfig (directly and through the data-parallel replica argv)."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from kvserve.config import EngineConfig
from kvserve.config.cli_args import cli_default, flag_fields, option_name
from kvserve.fleet.launcher import replica_argv
from kvserve.entrypoints.serve import add_serve_args
from kvserve.server.cli import ServerArgs, add_cli_args

# A value other than the default for every EngineConfig field, and how the command line spells it.
NON_DEFAULTS = {
    "model": ("/models/m", ["--model", "/models/m"]),
    "dtype": ("bfloat16", ["--dtype", "bfloat16"]),
    "device": ("cpu", ["--device", "cpu"]),
    "block_size": (8, ["--block-size", "8"]),
    "max_num_batched_tokens": (512, ["--max-num-batched-tokens", "512"]),
    "max_num_seqs": (8, ["--max-num-seqs", "8"]),
    "kv_cache_memory": (1 << 20, ["--kv-cache-memory", str(1 << 20)]),
    "gpu_memory_utilization": (0.5, ["--gpu-memory-utilization", "0.5"]),
    "num_kv_blocks": (64, ["--num-kv-blocks", "64"]),
    "max_model_len": (128, ["--max-model-len", "128"]),
    "seed": (7, ["--seed", "7"]),
    "watermark": (0.05, ["--watermark", "0.05"]),
    "enable_prefix_caching": (True, []),            # kv_tiers needs it on: see test below
    "prefix_cache": ("hash", []),
    "cache_aware_scheduling": (True, ["--cache-aware-scheduling"]),
    "max_wait_steps": (9, ["--max-wait-steps", "9"]),
    "scheduling_policy": ("vtc", ["--scheduling-policy", "vtc"]),
    "preemption_mode": ("swap", ["--preemption-mode", "swap"]),
    "swap_space": (1 << 20, ["--swap-space", str(1 << 20)]),
    "share_blocks": (False, ["--no-share-blocks"]),
    "preemption_warn_threshold": (5, ["--preemption-warn-threshold", "5"]),
    "async_scheduling": (False, []),               # speculative_config needs it off (tests/engine/test_async_scheduling.py)
    "quantization": ("int8", ["--quantization", "int8"]),
    "quantization_group_size": (None, []),
    "quantize_activations": (True, ["--quantize-activations"]),
    "kv_cache_dtype": ("int8", ["--kv-cache-dtype", "int8"]),
    "attention_backend": ("torch", ["--attention-backend", "torch"]),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 3}',
                           ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']),
    "tensor_parallel_size": (1, []),                # kv_tiers needs 1
    "enable_expert_parallel": (True, ["--enable-expert-parallel"]),
    "pipeline_parallel_size": (1, []),              # kv_tiers needs 1 (tested in tests/distributed/)
    "pipeline_micro_batches": (0, []),              # needs pipeline_parallel_size > 1
    "distributed_executor_backend": ("ray", ["--distributed-executor-backend", "ray"]),
    "kv_tiers": ("cpu:1MiB,redis://127.0.0.1:6379", ["--kv-tiers", "cpu:1MiB,redis://127.0.0.1:6379"]),
    "kv_tier_reload": ("always", ["--kv-tier-reload", "always"]),
    "kv_role": ("prefill", ["--role", "prefill"]),
    "kv_transfer": ("stream", ["--kv-transfer", "stream"]),
    "kv_stream_address": ("127.0.0.1:0", []),      # decode only (kv_role is prefill here): tests/kv/test_kv_stream.py
    "kv_stream_buffer": ("64MiB", ["--kv-stream-buffer", "64MiB"]),
    "kv_stream_timeout": (5.0, ["--kv-stream-timeout", "5"]),
    "kv_stream_rate": ("10MB", ["--kv-stream-rate", "10MB"]),
    "kv_stream_unit": ("prompt", ["--kv-stream-unit", "prompt"]),
    "max_grammar_compile_s": (2.5, ["--max-grammar-compile-s", "2.5"]),
}


def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return p


def test_every_field_is_a_flag_with_the_field_default():
    for cls, add in ((EngineConfig, EngineConfig.add_cli_args), (ServerArgs, add_cli_args)):
        p = argparse.ArgumentParser()
        add(p)
        parsed = p.parse_args([])
        assert [f.name for f in flag_fields(cls)] == [f.name for f in fields(cls)]    # none left out
        for f in fields(cls):
            assert f.metadata["help"], f.name
            assert getattr(parsed, f.name) == cli_default(f), f.name      # one place for each default
    assert engine_parser().parse_args([]).model is None     # the default model is filled in later


def test_serve_help_lists_every_flag():
    from kvserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["serve"].format_help()
    for cls in (EngineConfig, ServerArgs):
        for f in fields(cls):
            assert option_name(f) in text, f.name
            assert f.metadata["help"].split()[0] in text, f.name
    for extra in ("--data-parallel-size", "--router-policy", "--api-keys", "-tp", "--role",
                  "--no-enable-prefix-caching"):
        assert extra in text


def test_cli_round_trips_to_the_same_engine_config():
    assert set(NON_DEFAULTS) == {f.name for f in fields(EngineConfig)}
    argv = [tok for _, spelled in NON_DEFAULTS.values() for tok in spelled]
    direct = EngineConfig(**{k: v for k, (v, _) in NON_DEFAULTS.items()})
    parsed = EngineConfig.from_cli_args(engine_parser().parse_args(argv))
    assert parsed == direct
    assert parsed.speculative == direct.speculative
    assert parsed.kv_tier_list == ("cpu:1MiB", "redis://127.0.0.1:6379")


def test_replicas_are_started_with_the_same_engine_and_server_flags():
    """serve --data-parallel-size: the replica argv (fleet/launcher.py) re-parses to the same
    EngineConfig and server flags, without the launcher's and the router's."""
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    argv = [tok for _, spelled in NON_DEFAULTS.values() for tok in spelled]
    args = serve.parse_args(argv + ["--data-parallel-size", "2", "--router-policy", "round-robin",
                                    "--router-cb-failure-threshold", "9", "--port", "9000",
                                    "--max-waiting", "3", "--metrics-public", "--api-key", "k"])
    one = argparse.ArgumentParser()
    add_cli_args(one)
    replica = replica_argv(args, one)
    assert not {"--data-parallel-size", "--router-policy", "--router-cb-failure-threshold", "--port",
                "9000"} & set(replica)
    back = one.parse_args(replica)
    assert EngineConfig.from_cli_args(back) == EngineConfig.from_cli_args(args)
    assert (back.max_waiting, back.metrics_public, back.api_key) == (3, True, "k")


def test_api_key_default_follows_the_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    p = argparse.ArgumentParser()
    add_cli_args(p)
    assert p.parse_args([]).api_key == "from-env"


@pytest.mark.parametrize("argv, words", [
    (["--dtype", "int8"], "invalid choice"),          # the CLI offers auto and the three dtypes only
    (["--kv-role", "both", "--prefix-cache", "lru"], "invalid choice"),
    (["--block-size", "x"], "invalid int"),
])
def test_bad_flags_are_refused_by_the_parser(argv, words, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)
    assert words in capsys.readouterr().err


def test_speculative_flag_is_the_json_the_field_takes():
    cfg = EngineConfig.from_cli_args(engine_parser().parse_args(
        ["--model", "m", "--speculative-config", json.dumps({"model": "self-int4", "num_speculative_tokens": 2})]))
    assert (cfg.speculative.method, cfg.speculative.model) == ("draft_model", "self-int4")


def test_the_server_never_imports_the_fleet():
    """`kvserve serve` lives in entrypoints/serve.py (--data-parallel-size's replicas in fleet/):
    server/ imports nothing of fleet/, so the server <-> router import cycle cannot come back."""
    import ast
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[1] / "kvserve" / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("kvserve.fleet") for n in names), path
