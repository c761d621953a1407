"""Models and tokenizers for the structured-outputs tests: stories260K (SentencePiece-style BPE
with byte fallback, tokenizer.json) and a random-weight Llama with a byte-level BPE tokenizer
trained here in a few milliseconds; each token's bytes as a grammar sees them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import STORIES_HF

EOT = "<|endoftext|>"
CORPUS = ["Once upon a time there was a little girl named Lily.", "Tom had a big red ball.",
          '{"name": "Lily", "age": 3, "tags": ["a", "b"]}', "yes no maybe 0123456789 true false null",
          "The cat saw a dog. They were happy!"] * 20


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable character -> byte table (byte-level BPE spells every byte this way)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, spare = {chr(b): b for b in keep}, 0x100
    for b in range(256):
        if b not in keep:
            table[chr(spare)] = b
            spare += 1
    return table


def token_bytes(model_dir: Path) -> list[bytes | None]:
    """Each token's bytes (None for special tokens), read from tokenizer.json by its model type:
    SentencePiece-style (▁ is a space, <0xHH> a byte) or byte-level (GPT-2's alphabet)."""
    tj = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    byte_level = "ByteLevel" in json.dumps(tj.get("pre_tokenizer"))
    alphabet = gpt2_byte_alphabet()
    out: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        if i in special:
            continue
        if byte_level:
            out[i] = bytes(alphabet[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("▁", " ").encode("utf-8")
    return out


def build_byte_level_model(out_dir: Path) -> Path:
    """A random 2-layer Llama whose tokenizer is a byte-level BPE (vocab ~320) trained on CORPUS."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT, "bos_token": EOT}))
    eos = tok.token_to_id(EOT)
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.15,
                         bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def byte_level_model(tmp_path_factory) -> Path:
    return build_byte_level_model(tmp_path_factory.mktemp("byte_level"))


@pytest.fixture(scope="session")
def stories_hf() -> Path:
    return STORIES_HF
