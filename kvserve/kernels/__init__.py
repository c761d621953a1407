"""kvserve's CPU decode kernels: a PyTorch C++ extension (csrc/) built with ninja on first use for
the machine it runs on and cached, registered as `torch.ops.kvserve.*` ops (seed 000: a decode
step reads every weight byte once; its host work is a few calls, not thousands).

  linear_int4 / linear_int8 / linear_q8_0   GEMVs and tiled GEMMs reading kvserve's packed layouts (model/quant/formats.py)
  linear_bf16                               a bfloat16 weight (AMX tiles where the CPU has them, else torch's GEMM)
  decode_attention                          paged decode attention, split along the context
  silu_mul                                  SwiGLU (float32 or bfloat16 rows)
  rms_norm_bf16 / add_rms_norm              RMSNorm of bfloat16 rows; after a residual add, of bfloat16 or float32 ones
  rope                                      RoPE of bfloat16 or float32 heads
  write_slots                               new tokens' K or V rows into their paged cache slots
  draw_rows                                 sampled tokens drawn from logits rows (inverse CDF)
  argmax_rows                               greedy tokens of logits rows (torch.argmax's first largest)
  decode_layers                             every decoder layer of a pure-decode step, one call

The ISA is chosen at run time: the widest of AVX-512, AVX2 and portable C++ that both the CPU and
torch's dispatch capability allow (`ATEN_CPU_CAPABILITY=avx2` therefore tests the AVX2 code on
an AVX-512 host). On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) steps of `amx_rows()`
rows or more (and a bfloat16 weight at any row count) run on AMX tiles: weights dequantized to
bfloat16 a slab at a time, x rounded to bfloat16, float32 sums (csrc/isa_amx.cpp). `KVSERVE_KERNELS=torch` (or no compiler, or a failed build: one warning with
the compiler's message) leaves the pure-torch path, logged once.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "layers.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_scalar.cpp", "isa_amx.cpp")
CAPABILITY_BITS = {"AVX512": 512, "AVX2": 256}
# Steps of up to KERNEL_ROWS rows run Q8_0 weights on int16 dot products (a decode of a few
# streams) and int8 ones on kvserve's GEMV; more rows take the float routes and torch's int8
# kernel. csrc/ops.h's Q8_ROWS is the same. int4 takes the int16 route to INT4_Q16_ROWS rows
# (csrc/ops.h; AMX, where present, from 6), then dequantized tiles (faster than torch's int4
# kernel, benchmarks/bench_decode_kernels.py).
KERNEL_ROWS = 3
INT4_Q16_ROWS = 8
# -fno-trapping-math: no kernel reads floating-point exception flags, and without it gcc keeps
# every loop that calls floorf scalar (kernels.h's exp_inplace: the softmax of decode attention,
# SwiGLU, sampling's draws); it changes no result.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def _build_dir() -> Path:
    """A cache directory per source text, torch version, compiler, its flags and CPU flags -- not per
    checkout: any copy of kvserve with the same sources and torch on this machine finds the same
    build (torch's own path counts: the build links against that install's headers and libraries)."""
    h = hashlib.sha256(f"{torch.__version__} {Path(torch.__file__).parent} {os.environ.get('CXX', 'c++')} "
                       f"{' '.join(CFLAGS)}".encode())
    for p in sorted(CSRC.iterdir()):
        h.update(p.name.encode() + p.read_bytes())
    try:
        h.update(next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).encode())
    except (OSError, StopIteration):
        pass
    root = Path(os.environ.get("KVSERVE_KERNEL_CACHE", Path.home() / ".cache" / "kvserve" / "kernels"))
    return root / h.hexdigest()[:16]


def _cached_sources(build: Path) -> Path:
    """The sources copied into the build directory (once; the directory is keyed by their text),
    so the build reads the same paths from every checkout and ninja never rebuilds for a move."""
    src = build / "src"
    if not src.is_dir():
        tmp = build / f"src.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(CSRC, tmp)
        try:
            os.rename(tmp, src)
        except OSError:                 # another process put them there first: the same text
            shutil.rmtree(tmp, ignore_errors=True)
    return src


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """Build (or load the cached build of) the extension once per process; True when the ops are
    there. The ISA follows torch's capability (ATEN_CPU_CAPABILITY)."""
    if os.environ.get("KVSERVE_KERNELS", "").lower() == "torch":
        logger.info("KVSERVE_KERNELS=torch: kvserve's fused CPU kernels are off; the pure-torch path runs")
        return False
    try:
        from torch.utils import cpp_extension
        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        src = _cached_sources(build)
        with open(build / "kvserve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # concurrent first starts: one builds, the rest wait
            fresh = not (build / "kvserve_kernels.so").exists()
            if fresh:
                logger.info("building kvserve's CPU kernels for this machine, once (10-60 s) into %s", build)
            start = time.monotonic()
            cpp_extension.load(
                name="kvserve_kernels", sources=[str(src / s) for s in SOURCES], build_directory=str(build),
                extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)
            if fresh:
                logger.info("built kvserve's CPU kernels in %.0f s", time.monotonic() - start)
    except Exception as e:   # noqa: BLE001 - no compiler, a failed build: the torch path, never a crash
        logger.warning("kvserve's fused CPU kernels did not build, so the pure-torch path runs: %s",
                       str(e).strip()[-2000:])
        return False
    _register_fakes()
    bits = CAPABILITY_BITS.get(torch.backends.cpu.get_cpu_capability(), 0)
    isa = torch.ops.kvserve.set_isa(bits)
    logger.info("kvserve's fused CPU kernels: %s (torch's capability %s)", isa,
                torch.backends.cpu.get_cpu_capability())
    return True


def _register_fakes() -> None:
    """Shape functions of the ops, so they trace under torch.compile and FakeTensorMode."""
    def linear(x, w, *rest):
        return x.new_empty(x.shape[0], w.shape[0])
    for name in ("linear_int4", "linear_int8", "linear_q8_0"):
        torch.library.register_fake(f"kvserve::{name}")(linear)
    torch.library.register_fake("kvserve::decode_attention")(lambda q, *rest: torch.empty_like(q))
    torch.library.register_fake("kvserve::silu_mul")(
        lambda gu, out_dtype=None: gu.new_empty(gu.shape[0], gu.shape[1] // 2, dtype=out_dtype or gu.dtype))
    torch.library.register_fake("kvserve::rms_norm_bf16")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake("kvserve::add_rms_norm")(
        lambda x, d, w, eps: (torch.empty_like(x), torch.empty_like(x)))
    torch.library.register_fake("kvserve::write_slots")(lambda src, cache, slots: None)
    torch.library.register_fake("kvserve::draw_rows")(lambda x, rows, u: rows.new_empty(rows.shape))
    torch.library.register_fake("kvserve::rope")(lambda x, cos, sin: x.new_empty(x.shape))
    torch.library.register_fake("kvserve::argmax_rows")(lambda x: x.new_empty(x.shape[0], dtype=torch.long))


def available(device="cpu") -> bool:
    """The ops run here: a CPU device and a built extension."""
    return torch.device(device).type == "cpu" and load()


def cpu_flag(name: str) -> bool:
    """torch.cpu's cpuinfo query `name` (absent on some builds and platforms, or failing: False)."""
    query = getattr(torch.cpu, name, None)
    try:
        return bool(query()) if query is not None else False
    except Exception:      # noqa: BLE001 - a query that fails means the feature cannot be relied on
        return False


def cpu_bf16() -> bool:
    """The CPU multiplies bfloat16 in hardware: AVX-512 BF16 or AMX tiles."""
    return cpu_flag("_is_avx512_bf16_supported") or cpu_flag("_is_amx_tile_supported")


@functools.cache
def amx() -> bool:
    """The CPU runs kvserve's AMX tiles (csrc/isa_amx.cpp: AMX-BF16, granted by the OS) and
    torch's capability allows AVX-512 (`ATEN_CPU_CAPABILITY` below it turns them off)."""
    return load() and torch.ops.kvserve.amx_rows() > 0


def isa() -> str:
    """The ISA the ops run on ("avx512", "avx2", "scalar")."""
    bits = CAPABILITY_BITS.get(torch.backends.cpu.get_cpu_capability(), 0)
    return torch.ops.kvserve.set_isa(bits) if load() else "torch"

