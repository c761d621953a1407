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
