"""Shared fixtures: the real stories260K model and random-weight models built with transformers."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

# The models under test are tiny: one thread is as fast as two, and it keeps the suite steady
# when the two cores are shared (a live server subprocess, CI neighbours).
torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES_HF = SHARED / "models" / "stories260K-hf"
STORIES_C = SHARED / "models" / "stories260K"


def build_random_model(arch: str, out_dir: Path, seed: int = 0, added_tokens: tuple[str, ...] = ()) -> Path:
    """Save a small random-weight model of `arch` with transformers, plus the stories260K
    tokenizer (vocab 512), so kvserve and transformers can run the same weights. `added_tokens`:
    text tokens added to the tokenizer (ids 512, 513, ...; not special), the vocabulary grown to hold them."""
    import transformers as tf

    common = dict(vocab_size=512 + -(-len(added_tokens) // 8) * 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "llama3":  # Llama-3 rope scaling, tied embeddings
        cfg = tf.LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32})
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES_HF / name, out_dir / name)
    if added_tokens:
        from tokenizers import AddedToken, Tokenizer

        tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
        tok.save(str(out_dir / "tokenizer.json"))
    return out_dir


def built_once(tmp_path_factory, build):
    """get(name) -> build(name, a fresh directory), built the first time a name is asked for."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def perturb_norms(model, scale: float = 0.2) -> None:
    """Move a random model's norm weights off 1 (transformers initialises them to ones)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(scale * torch.randn_like(p))


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    return built_once(tmp_path_factory, build_random_model)


@pytest.fixture(params=["auto", "int8"])
def kv_cache_dtype(request, monkeypatch):
    """Runs a test twice: with the model-dtype KV cache, then with every engine it builds on an
    int8 cache (issue 11: prefix caching, sharing, preemption and swap keep working on quantized
    blocks). Modules opt in with `pytestmark = pytest.mark.usefixtures("kv_cache_dtype")`."""
    if request.param != "auto":
        from kvserve.config import EngineConfig
        post_init = EngineConfig.__post_init__

        def quantized_cache(self):
            if self.kv_cache_dtype == "auto":
                self.kv_cache_dtype = request.param
            post_init(self)

        monkeypatch.setattr(EngineConfig, "__post_init__", quantized_cache)
    return request.param


@pytest.fixture(autouse=True)
def _sigint_left_as_found():
    """A test that leaves SIGINT changed (e.g. ignored) breaks every later child that expects
    Ctrl-C (children inherit an ignored signal): fail the test that did it, by name."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"the test left SIGINT's handler changed ({before!r} -> {after!r})")
