// The ATen-facing side of the kernels (default target): ISA choice, threading, shape checks.
#pragma once
#include <ATen/ATen.h>

#include "common.h"

namespace kvk {

// The kernel table in use: the widest ISA both the CPU and `set_isa` allow. `width_dividing(n)`:
// the widest allowed table whose vector width divides n (head dims that are not a multiple fall
// back to a narrower ISA, then to the portable code).
const IsaKernels& isa();
const IsaKernels& isa_dividing(int n);

// A linear weight as the kernels read it (kvserve/kernels/__init__.py packs them):
//   DENSE: a float32 or bfloat16 tensor [N, K] (bfloat16: x rounded to bfloat16 for the GEMM); INT4: nibbles [N, K/2] uint8 + scales and zeros [N, 2, K/G]
//   bfloat16; INT8: q [N, K] int8 + scale [N] bfloat16; Q8_0: q [N, K] int8 + d [N, K/G] float16
//   (G 32: GGUF Q8_0; G 16: GGUF Q6_K's sub-blocks).
//   `c`: an INT4 weight's fifth bits [N, K/8] uint8 (a GGUF Q5 type; common.h gemv_int4's hb), else
//   unused (empty). Steps of <= INT4_Q16_ROWS rows of an INT4 weight take the integer-dot route
//   (activations in int16 per 32 weights), of <= Q8_ROWS rows of a Q8_0 weight too (int16 in two
//   byte planes); more rows the float route (or AMX).
enum Format { DENSE = 0, INT4 = 1, INT8 = 2, Q8_0 = 3 };
struct Linear {
  int format = DENSE, N = 0, K = 0, G = 0;
  at::Tensor a, b, c;
};
constexpr int Q8_ROWS = 3;      // kvserve/kernels/__init__.py: KERNEL_ROWS
// int4 from 4 to 8 rows (where AMX does not take them): the int16 route 1.15-1.75x the float
// route's register blocks (benchmarks/bench_decode_kernels.py, SmolLM2's matrices, 2 threads, AVX2,
// and AVX512 with AMX off); past 8 rows it takes two passes over the weights and the tiles win.
constexpr int INT4_Q16_ROWS = 8;   // kvserve/kernels/__init__.py: INT4_Q16_ROWS
// Steps of at least AMX_ROWS rows run on AMX tiles where the CPU has them (isa_amx.cpp; int4,
// int8 and Q8_0 weights; a bfloat16 weight at any row count; the `amx_rows` op says which apply).
// Measured (3072 x 576 and 576 x 1536, 2 threads): kvserve's float route wins at 4 rows, they
// tie at 6, AMX is 1.6x at 8, 2-3.5x at 16-64. Against int4's int16 route (2026-12-07,
// bench_decode_kernels.py): at 6 rows level (gate_up 103 against 110 us, down 56 against 46), at
// 8 AMX ahead (gate_up 104 against 141 us).
constexpr int AMX_ROWS = 6;
Linear make_linear(int64_t format, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t group);
bool int4_q16_route(const Linear& w, int T);
// An INT4 weight's fifth bits, or null.
const uint8_t* high_bits(const Linear& w);
bool q8_0_q16_route(const Linear& w, int T);
bool amx_route(const Linear& w, int T);

// y [T, N] = x [T, K] @ W.T, both float32 row-major; `xp` scratch [T, K] for the int4 order.
void linear_into(const float* x, int T, const Linear& w, float* y, float* xp);

// Rows x [T, n] + delta [T, n] -> xo, and out = their RMSNorm times w [n], float32: the fused decode
// step's arithmetic (layers.cpp: the sum of squares one chain of adds a row, as torch's order is not).
void add_rms_norm_rows(const float* x, const float* delta, const float* w, float eps, int T, int n, float* xo,
                       float* out);

// Paged decode attention of B one-token queries: out [B, H, D] float32 (args as common.h), each
// sequence over its last min(context_len, window) tokens (window <= 0: all).
// ValueError-style checks (TORCH_CHECK) that every context fits its table row and every block
// id it reads is inside the cache: nothing is read out of bounds.
void check_tables(const AttnArgs& a, const int64_t* context_lens, int B, int64_t num_blocks);
void attention_into(const AttnArgs& a, const int64_t* context_lens, int B, int64_t window, float* out);
AttnArgs attn_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                   const at::Tensor& block_tables, double scale);

}  // namespace kvk
