"""The names a flag or field may take for a format, and their parsing: strings only, so the
configuration decides and checks them without importing torch or the code that runs them
(model/quant/formats.py, attention/kv_quant.py and worker/device.py read them from here)."""
from __future__ import annotations

import re

# EngineConfig.dtype spellings -> the torch dtype name (worker/device.torch_dtype maps a name to torch's)
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

# --kv-cache-dtype: vLLM's names (attention/kv_quant.py stores each)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")

# --quantization: weight-only formats kvserve quantizes to at load (model/quant/formats.py)
QUANTIZATION_METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)      # what the int4 kernel accepts


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}.")
    return name


def parse_quantization(method: str | None, group_size: int | None) -> tuple[str | None, int | None]:
    """("int4-g32", None) -> ("int4", 32); checks the method and the group size. "dequant":
    a GGUF file's quantized tensors dequantized to the model dtype at load (else the same as None)."""
    if method is None or method in ("none", "dequant"):
        if group_size is not None:
            raise ValueError("quantization_group_size needs quantization='int4'; set both or neither.")
        return (None if method == "none" else method), None
    match = re.fullmatch(r"(int8|int4)(?:-g(\d+))?", str(method))
    if match is None:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (int4 may carry a "
                         f"group size, e.g. 'int4-g32') or 'dequant', got {method!r}.")
    method, suffix = match.group(1), match.group(2)
    if suffix is not None:
        if group_size is not None and group_size != int(suffix):
            raise ValueError(f"quantization {method}-g{suffix} and quantization_group_size={group_size} "
                             "disagree; give the group size once.")
        group_size = int(suffix)
    if method == "int8" and group_size is not None:
        raise ValueError("int8 quantization is per output channel and takes no group size; "
                         "drop quantization_group_size or use int4.")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}.")
    return method, group_size
