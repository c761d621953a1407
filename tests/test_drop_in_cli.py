"""vLLM and llama-server command lines (issue 35, item 1): no option is ever an abbreviation of
another (llama-server's `-t 2` once parsed as `-tp 2`), llama-server's common flags are aliases
where they mean the same thing, and vLLM's recipe flags start a server."""
from __future__ import annotations

import pytest

from kvserve.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_no_option_is_an_abbreviation_of_another(capsys):
    for argv in (["--max-model", "100"], ["--tensor-parallel", "2"], ["--block", "8"]):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--max-tok", "5"])


def test_llama_server_flags_mean_what_they_mean_there():
    args = parse("-m", "/models/x.gguf", "-t", "2", "-np", "4", "--host", "0.0.0.0", "--port", "8080", "--jinja")
    assert (args.model, args.engine_threads, args.max_num_seqs) == ("/models/x.gguf", 2, 4)
    assert args.tensor_parallel_size == 1 and args.jinja                 # -t is threads, never -tp
    assert parse("--threads", "3", "--parallel", "2").engine_threads == 3


def test_vllm_recipe_flags_parse():
    args = parse("Qwen/Qwen3-0.6B", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--trust-remote-code", "--disable-log-stats", "--uvicorn-log-level", "warning")
    assert args.enable_auto_tool_choice and args.trust_remote_code and args.disable_log_stats
    assert args.uvicorn_log_level == "warning" and args.tool_call_parser == "hermes"


def test_generation_config_gives_the_defaults_a_request_leaves_out(tmp_path):
    import json

    from kvserve.server.openai.protocol import ChatCompletionRequest
    from kvserve.server.openai.sampling import generation_defaults, sampling_params

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7, "eos_token_id": 2, "do_sample": True}))
    d = generation_defaults("auto", str(tmp_path))
    assert d == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert generation_defaults("vllm", str(tmp_path)) == {} and generation_defaults(str(tmp_path), "/x") == d
    assert generation_defaults("auto", str(tmp_path / "model.gguf")) == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "nowhere"), "/x")
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    p = sampling_params(req, 10, None, defaults=d)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.6, 0.5, 10)      # the request's own top_p wins


def serve_args(*argv: str):
    from kvserve.server.cli import apply_llama_server_flags

    args = parse(*argv)
    apply_llama_server_flags(args)
    return args


def test_llama_server_context_gpu_layers_and_embeddings_flags():
    args = serve_args("-m", "x.gguf", "-c", "1000", "--block-size", "16", "-ngl", "0", "-n", "64")
    assert (args.num_kv_blocks, args.max_model_len, args.device, args.n_predict) == (63, 1000, "cpu", 64)
    assert serve_args("--ctx-size", "32", "--block-size", "16").num_kv_blocks == 2
    assert serve_args("--embeddings").task == "embed"
    for argv, message in ((("-ngl", "99"), "does not split"), (("-c", "64", "--num-kv-blocks", "4"), "give one"),
                          (("-c", "64", "--max-model-len", "32"), "disagree"), (("-ngl", "0", "--device", "cuda"), "disagree"),
                          (("--embeddings", "--task", "generate"), "disagree"), (("-n", "-5"), "-n / --n-predict")):
        with pytest.raises(ValueError, match=message):
            serve_args(*argv)


def test_foreign_flags_are_refused_naming_kvserves(capsys):
    for flag_, instead in (("-b", "--max-num-batched-tokens"), ("--flash-attn", "--attention-backend"),
                           ("--alias", "--served-model-name"), ("-hf", "--model PATH")):
        with pytest.raises(SystemExit):
            parse(flag_, "1")
        err = capsys.readouterr().err
        assert "unrecognized arguments" in err and f"{flag_} is not kvserve's: give {instead}" in err


def test_n_predict_is_chats_default_max_tokens():
    """-n 5: a chat request without max_tokens generates at most 5 tokens; one with max_tokens its own."""
    from fastapi.testclient import TestClient

    from kvserve.config import EngineConfig
    from kvserve.engine.engine_core import EngineCore
    from kvserve.server.app import build_app
    from tests.server.live import STORIES_HF

    app = build_app(EngineCore(EngineConfig(model=str(STORIES_HF))), "m", generation_defaults={"max_tokens": 5})
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 5
        assert client.post("/v1/chat/completions", json={**body, "max_tokens": 9}).json()["usage"]["completion_tokens"] == 9
