"""Per-step timers for benchmarks/bench_host_overhead.py, inside the engine core process.

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH, so a spawned engine
core (multiprocessing "spawn" re-runs start-up) loads this file too. It does nothing unless
KVSERVE_HOST_OVERHEAD_DIR names a folder. Then an import hook wraps, as their modules load:

    ModelRunner.forward   (kvserve.worker.model_runner; kvserve.engine.model_runner before the
                           layout change): the model's forward pass, nothing else
    LLMEngine.step (kvserve.engine.engine; kvserve.frontend.llm_engine after the rewrite) and
    EngineCore.step (kvserve.engine.engine_core), where they exist: one engine step

with perf_counter timers (CLOCK_MONOTONIC: comparable across processes), and writes one JSON
line per call to <dir>/<pid>.jsonl (buffered; closed at exit):

    ["f", t0, t1, num_tokens, num_decode_tokens, first_decode_position, last_decode_position]
    ["s", t0, t1, qualified name]     e.g. "LLMEngine.step"
    ["module", module name, file]         once per wrapped module: which tree was measured

The bookkeeping after each forward (two .item() calls, json.dumps, a buffered write) costs about
10 us, which the benchmark counts as host time (under 1% of the smallest step it reports).
"""
import os

OUT_DIR = os.environ.get("KVSERVE_HOST_OVERHEAD_DIR")

# module -> [(class, method, record kind)]
TARGETS = {
    "kvserve.worker.model_runner": [("ModelRunner", "forward", "f")],
    "kvserve.engine.model_runner": [("ModelRunner", "forward", "f")],
    "kvserve.engine.engine": [("LLMEngine", "step", "s")],
    "kvserve.engine.engine_core": [("EngineCore", "step", "s")],
    "kvserve.frontend.llm_engine": [("LLMEngine", "step", "s")],
}


def _install() -> None:
    import atexit
    import functools
    import importlib.abc
    import importlib.util
    import json
    import sys
    from time import perf_counter

    out = None

    def write(rec) -> None:
        nonlocal out
        if out is None:
            out = open(os.path.join(OUT_DIR, f"{os.getpid()}.jsonl"), "a")
            atexit.register(out.close)
        out.write(json.dumps(rec) + "\n")

    def timed_forward(fn):
        @functools.wraps(fn)
        def forward(self, input_ids, positions=None, meta=None, *args, **kwargs):
            t0 = perf_counter()
            result = fn(self, input_ids, positions, meta, *args, **kwargs)
            t1 = perf_counter()
            n = int(input_ids.numel())
            nd = getattr(meta, "num_decode_tokens", n)
            first = int(positions[0].item()) if nd and positions is not None else -1
            last = int(positions[nd - 1].item()) if nd and positions is not None else -1
            write(["f", t0, t1, n, nd, first, last])
            return result
        return forward

    def timed_step(fn):
        name = fn.__qualname__

        @functools.wraps(fn)
        def step(self, *args, **kwargs):
            t0 = perf_counter()
            result = fn(self, *args, **kwargs)
            write(["s", t0, perf_counter(), name])
            return result
        return step

    def patch(module) -> None:
        for cls_name, method, kind in TARGETS[module.__name__]:
            cls = getattr(module, cls_name, None)
            if cls is not None and method in cls.__dict__:
                wrap = timed_forward if kind == "f" else timed_step
                setattr(cls, method, wrap(cls.__dict__[method]))
                write(["module", module.__name__, getattr(module, "__file__", "?")])

    class Finder(importlib.abc.MetaPathFinder):
        """Find a target module with the other finders, then patch it once it has run."""

        def find_spec(self, name, path=None, target=None):
            if name not in TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if OUT_DIR:
    _install()
