"""Which quantized-matmul path each step shape takes on this CPU (seed 000: a decode step reads
every weight byte; a prefill step is compute-bound), chosen by the capability torch dispatches to.

torch's CPU kernels for packed weights (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
and its dense GEMMs change with the capability (`torch.backends.cpu.get_cpu_capability()`,
forced with ATEN_CPU_CAPABILITY) and with the ISA the BLAS libraries find (oneDNN's bf16 GEMMs
need AVX-512 BF16; without it they fall back to slow code). So the thresholds come from a table
keyed by the capability and native bf16, each entry measured with
`python benchmarks/bench_cpu_paths.py` (2 threads, SmolLM2's matrices; the figures are beside
the table), never from torch's private packed layouts: kvserve keeps its own values (formats.py)
and hands torch's kernels only the inputs their signatures document.

  path            what runs                                                  used for
  kernel          torch's int4 / int8 kernel on bfloat16 activations         steps of <= *_kernel_max_rows
  dequantize      the weight dequantized per call (row blocks) into          bigger steps (prefill)
                  `dense_dtype`, then a dense GEMM
  w8a8            int8 activations, `torch._int_mm` (quantize_activations)   int8, > w8a8_min_rows
  float resident  weights rounded to int4 / int8, then kept dequantized in   a capability whose every
                  the model dtype: the same values, none of the memory       quantized path loses
                  saving (DEFAULT: no SIMD in torch's own kernels)

Detection is portable: the capability string comes from torch (any other string, such as an Arm
build's, takes the DEFAULT entry), the bf16 flag from torch's cpuinfo query where it exists, and
every kernel is checked once against kvserve's own dequantized values on a probe matrix before it
is trusted; a kernel that raises or disagrees is switched off with one warning.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from kvserve import kernels

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The quantized-matmul paths of one CPU capability; -1 rows: the kernel is never used."""
    name: str                      # the table entry: "avx512_bf16" | "avx512" | "avx2" | "default"
    capability: str                # torch's string, as reported
    int4_kernel_max_rows: int
    int8_kernel_max_rows: int
    w8a8_min_rows: int             # quantize_activations: int8 steps of more rows run W8A8
    dense_dtype: torch.dtype       # the dequantize path's GEMM dtype
    float_resident: bool = False   # quantized weights kept dequantized in the model dtype

    def describe(self) -> str:
        def rows(n: int) -> str:
            return "never" if n < 0 else f"steps of <= {n} rows"
        dense = str(self.dense_dtype).removeprefix("torch.")
        if self.float_resident:
            return (f"CPU capability {self.capability} ({self.name}): quantized weights are kept "
                    f"dequantized in the model dtype (no quantized path wins here)")
        w8a8 = f"steps of > {self.w8a8_min_rows} rows"
        return (f"CPU capability {self.capability} ({self.name}): int4 kernel {rows(self.int4_kernel_max_rows)}, "
                f"int8 kernel {rows(self.int8_kernel_max_rows)}, bigger steps dequantize into a {dense} "
                f"GEMM; W8A8 (quantize_activations) {w8a8}")


# Measured with `python benchmarks/bench_cpu_paths.py` (2026-12-01, an AMD EPYC with AVX-512 BF16
# standing in for the others, load average 1.9-2.9; every figure in benchmarks/results/cpu_paths.json).
# Microseconds summed over SmolLM2's gate_up, qkv and down, per step of R rows: int4 kernel /
# int4 dequantize + GEMM in the entry's dense dtype (bf16 on avx512_bf16, else float32) | the same
# for int8 | W8A8 | the dense float32 GEMM of the unquantized matrices:
#   entry         R = 1                     R = 32                         R = 128                          R = 512
#   avx512_bf16   148/3895 | 135/873 | - | 433   1719/4177 | 1785/1419 | 880 | 2236   7136/7443 | 7540/4526 | 2174 | 8746   26854/14672 | 28753/12081 | 8032 | 27737
#   avx512        150/4107 | 140/685 | - | 400   1763/6020 | 2462/3873 | 816 | 3075   6681/11292 | 7202/9465 | 2081 | 7790   28107/31362 | 28593/27598 | 7654 | 27877
#   avx2          245/3326 | 194/1365 | - | 381   3984/7900 | 3677/5171 | 1634 | 3054   13469/12049 | 11643/9245 | 3974 | 7640   43105/28992 | 40648/27600 | 14383 | 24117
#   default       6053/7119 | 2918/2104 | - | 418   191887/8393 | 89503/3231 | 3104 | 2394   766652/16470 | 379352/10564 | 11448 | 10546
# The kernels win at decode on every SIMD capability and lose to a dense GEMM as rows grow: the
# entries take the largest R (of 1-512) up to which the kernel beats dequantizing. The int4
# entries are those of kvserve's own int4 kernel (kvserve/kernels), which replaced torch's
# (`python benchmarks/bench_cpu_paths.py`, 2026-12-06, an Intel Xeon with AVX-512 BF16 and AMX
# standing in for the others, load average 1-2; benchmarks/results/cpu_paths_own_int4.json),
# microseconds over the same three matrices, kvserve's kernel / torch's / dequantize + the
# entry's GEMM:
#   entry         R = 1           R = 16            R = 64              R = 128             R = 256
#   avx512_bf16   73/87/2009      463/566/1982      1461/2246/2146      3034/4550/2372      6219/9051/2752
#   avx512        76/87/1625      456/579/2226      1524/2258/3597      3059/4494/4852      6338/9036/6154
#   avx2          184/143/1596    770/1053/2151     3042/4032/3408      6096/8156/5190      12288/16726/8650
# (This host's bf16 GEMMs run on AMX, so its avx512_bf16 dequantize path is faster than a Zen 4's,
# whose crossover would be higher: 64 is this host's.) Without bf16
# instructions a bf16 GEMM is 2-4x a float32 one (avx2 at 128 rows: 16.0 against 3.9 ms on
# gate_up), so the other entries dequantize into float32. W8A8 beats both weight-only paths from
# 16 rows on every entry (from 8 on avx512); under DEFAULT (no SIMD in torch's own kernels) the
# kernels and every dequantization are 5-400x the dense float32 GEMM, so its plan holds the
# weights dequantized. Arm builds (DEFAULT, SVE256) and any other capability string take that plan.
TABLE = {
    "avx512_bf16": KernelPlan("avx512_bf16", "", int4_kernel_max_rows=64, int8_kernel_max_rows=16,
                              w8a8_min_rows=8, dense_dtype=torch.bfloat16),
    "avx512": KernelPlan("avx512", "", int4_kernel_max_rows=128, int8_kernel_max_rows=256,
                         w8a8_min_rows=8, dense_dtype=torch.float32),
    "avx2": KernelPlan("avx2", "", int4_kernel_max_rows=64, int8_kernel_max_rows=32,
                       w8a8_min_rows=8, dense_dtype=torch.float32),
    "default": KernelPlan("default", "", int4_kernel_max_rows=-1, int8_kernel_max_rows=-1,
                          w8a8_min_rows=8, dense_dtype=torch.float32,
                          float_resident=True),
}


def native_bf16() -> bool:
    """bf16 GEMMs run on bf16 instructions: AVX-512 BF16 (or AMX) present, and oneDNN, which runs
    them, not capped below it (ONEDNN_MAX_CPU_ISA, as a benchmark emulating an older CPU sets)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = cap != "ALL" and "BF16" not in cap and "AMX" not in cap and "FP16" not in cap
    return kernels.cpu_bf16() and not capped


def entry_for(capability: str, bf16: bool) -> str:
    if capability == "AVX512":
        return "avx512_bf16" if bf16 else "avx512"
    if capability == "AVX2":
        return "avx2"
    return "default"        # DEFAULT, and any string this table does not know (Arm, POWER, s390x)


def _int4_probe_ok() -> bool:
    """torch's int4 kernel against x @ W.T from the values it was packed from."""
    g = torch.Generator().manual_seed(0)
    N, K, G = 128, 256, 32
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = (torch.rand(K // G, N, 2, generator=g) - 0.5).bfloat16()          # [K/G, N, (scale, zero)]
    w = (q.float().view(N, -1, G) - 8) * sz[..., 0].float().T[..., None] + sz[..., 1].float().T[..., None]
    x = torch.randn(4, K, generator=g).bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz).float()
    ref = x.float() @ w.view(N, K).T
    return bool((y - ref).abs().max() <= 2e-2 * ref.abs().max())


def _int8_probe_ok() -> bool:
    g = torch.Generator().manual_seed(0)
    N, K = 64, 256
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g).bfloat16()
    x = torch.randn(4, K, generator=g).bfloat16()
    y = torch.ops.aten._weight_int8pack_mm(x, q, s).float()
    ref = x.float() @ (q.float() * s.float()[:, None]).T
    return bool((y - ref).abs().max() <= 2e-2 * ref.abs().max())


def _checked(plan: KernelPlan) -> KernelPlan:
    """`plan` with each kernel that raises or disagrees on the probe switched off (one warning)."""
    for field, probe in (("int4_kernel_max_rows", _int4_probe_ok), ("int8_kernel_max_rows", _int8_probe_ok)):
        if getattr(plan, field) < 0:
            continue
        try:
            ok, why = probe(), "gave wrong results on a probe matrix"
        except Exception as e:     # noqa: BLE001 - a missing or broken op: the fallback path
            ok, why = False, f"failed ({type(e).__name__}: {e})"
        if not ok:
            logger.warning("CPU capability %s: torch's %s kernel %s; those weights take the dequantize "
                           "path instead", plan.capability, field.split("_")[0], why)
            plan = dataclasses.replace(plan, **{field: -1})
    return plan


@functools.lru_cache(maxsize=None)
def kernel_plan() -> KernelPlan:
    """This process's plan (the capability cannot change after torch is imported); logged once."""
    capability = torch.backends.cpu.get_cpu_capability()
    name = entry_for(capability, native_bf16())
    if name == "default" and capability != "DEFAULT":
        logger.warning("CPU capability %r is not in kvserve's kernel table; quantized weights take the "
                       "portable path (the DEFAULT entry)", capability)
    plan = _checked(dataclasses.replace(TABLE[name], capability=capability))
    if plan.int4_kernel_max_rows >= 0 and kernels.amx():
        plan = dataclasses.replace(plan, int4_kernel_max_rows=AMX_INT4_ROWS)
    logger.info("%s", plan.describe())
    return plan


# kvserve's int4 / Q8_0 op on AMX tiles (kvserve/kernels/csrc/isa_amx.cpp: each weight dequantized once
# for a block of x, in L1/L2) against dequantizing the whole matrix into oneDNN's bf16 GEMM
# (`bench_cpu_paths.py --entries avx512_bf16`, i4o against i4d.b, bfloat16 activations; 2026-12-07,
# Intel Xeon with AMX, 2 threads), in us for 3072 x 576, 960 x 576 and 576 x 1536: 256 rows 449 / 569,
# 169 / 203, 237 / 361; 512 rows 830 / 826, 299 / 268, 500 / 415; 1,024 rows 1736 / 1216, 577 / 430,
# 998 / 1194. At 512 rows the dequantize path is ahead on two matrices, but a float32 model's x and
# y are converted around it (the op takes and gives float32): where AMX runs, the op takes steps to
# 512 rows (mixed prefill + decode steps) instead of the entry's 64.
AMX_INT4_ROWS = 512


def warn_once(message: str, *args) -> None:
    """One warning per distinct message in a process (a fallback met by many weights)."""
    text = message % args if args else message
    if text not in _warned:
        _warned.add(text)
        logger.warning("%s", text)


_warned: set[str] = set()


def refuse_off_cpu(method: str, device) -> None:
    """ValueError unless `device` is the CPU: kvserve's quantized matmuls are CPU kernels, and
    elsewhere (CUDA) a quantized weight would be dequantized on every call of every step."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    raise ValueError(f"{method} weights on {device.type}: kvserve runs quantized weights with CPU kernels "
                     f"only (on {device.type} they would be dequantized on every step). Load the model in "
                     "a float dtype there: quantization='dequant' for a GGUF file's quantized tensors, "
                     "or no quantization (and no self-int8/self-int4 draft) with dtype='bfloat16' or "
                     "'float16'; or run on device='cpu'.")
