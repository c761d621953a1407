"""Embeddings against the reference libraries on the same weights: all-MiniLM-L6-v2 against
sentence-transformers, stories260K-hf (kvserve's Llama forward) against transformers' LlamaModel."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.pooling.models import MINILM_NAME, known_name, load_embedding_model, minilm_dir, resolve_model
from kvserve.pooling.rule import PoolingRule
from tests.conftest import STORIES_HF

TEXTS = ["hello world", "a", "Embeddings: café, naïve, 東京 and emoji 🙂",
         "The quick brown fox jumps over the lazy dog. " * 20]      # ~200 tokens: past the file's 128
STORIES_TEXTS = ["Once upon a time", "The cat sat on the mat and looked at the big red ball.", "Hi",
                 "Lily and Tom went to the park to play. " * 8]


@pytest.fixture(scope="module")
def minilm():
    return load_embedding_model(EngineConfig(model=resolve_model(MINILM_NAME)))


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_dir(), device="cpu")


def test_minilm_name_resolves_to_the_package_directory(minilm):
    assert resolve_model(MINILM_NAME) == minilm_dir() and known_name(minilm_dir()) == MINILM_NAME
    assert resolve_model("/some/dir") == "/some/dir" and known_name(str(STORIES_HF)) is None
    assert (minilm.dim, minilm.max_model_len, minilm.rule) == (384, 256, PoolingRule("mean", True))


def test_minilm_tokenizes_as_sentence_transformers_without_truncating(minilm, st_model):
    for text in TEXTS:
        assert minilm.tokenizer.encode(text) == st_model.tokenizer(text)["input_ids"]
    assert len(minilm.tokenizer.encode(TEXTS[-1])) > 128


def test_minilm_equals_sentence_transformers(minilm, st_model):
    ref = st_model.encode(TEXTS, normalize_embeddings=False, convert_to_numpy=True)    # its Normalize module
    batched = minilm.embed([minilm.tokenizer.encode(t) for t in TEXTS]).numpy()        # lengths 4 to ~200
    alone = np.stack([minilm.embed([minilm.tokenizer.encode(t)]).numpy()[0] for t in TEXTS])
    ids = [st_model.tokenizer(t)["input_ids"] for t in TEXTS]                           # token-id input
    from_ids = minilm.embed(ids).numpy()
    assert batched.dtype == np.float32 and batched.shape == (4, 384)
    for got in (batched, alone, from_ids):
        assert np.abs(got - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    # normalize_embeddings=True changes nothing for a model that normalizes itself
    assert np.abs(st_model.encode(TEXTS, normalize_embeddings=True) - batched).max() < 1e-5


@pytest.fixture(scope="module")
def hf_llama():
    from transformers import LlamaModel
    return LlamaModel.from_pretrained(str(STORIES_HF), dtype=torch.float32).eval()


def hf_hidden(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]          # [len, hidden], after the final norm


def test_stories_last_token_equals_transformers(hf_llama):
    model = load_embedding_model(EngineConfig(model=str(STORIES_HF)))
    assert model.rule == PoolingRule("last", True)
    prompts = [model.tokenizer.encode(t) for t in STORIES_TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)              # a batch of different lengths
    got = model.embed(prompts).numpy()
    ref = np.stack([torch.nn.functional.normalize(hf_hidden(hf_llama, p)[-1], dim=0).numpy() for p in prompts])
    assert np.abs(got - ref).max() < 1e-4


def test_a_sentence_transformers_decoder_pools_by_its_own_rule(tmp_path, hf_llama):
    for f in os.listdir(STORIES_HF):
        os.symlink(STORIES_HF / f, tmp_path / f)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    model = load_embedding_model(EngineConfig(model=str(tmp_path)))
    assert type(model).__name__ == "DecoderEmbedder" and model.rule == PoolingRule("mean", False)
    prompts = [model.tokenizer.encode(t) for t in STORIES_TEXTS[:3]]
    ref = np.stack([hf_hidden(hf_llama, p).mean(0).numpy() for p in prompts])
    assert np.abs(model.embed(prompts).numpy() - ref).max() < 1e-4
