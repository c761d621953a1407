// The decode kernels compiled for AVX-512 (F, BW, DQ, VL, VNNI) and FMA: kernels.h and attention.h in vec.h's KV_ISA=512 vocabulary.
#include <immintrin.h>
#include "common.h"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")
#define KV_ISA 512
namespace kvk {
namespace isa_avx512 {
#include "vec.h"
#include "kernels.h"
#include "attention.h"
#include "sampling.h"
#include "rows_bf16.h"
}  // namespace isa_avx512
}  // namespace kvk
#pragma GCC pop_options

const kvk::IsaKernels& kvk::avx512_kernels() {
  using namespace isa_avx512;
  static const IsaKernels k{"avx512", KV_W, gemv_int4, gemv_int4_q16, quantize_planes, gemv_int8, gemv_q8_0, gemv_q8_0_q16, quantize_q8, attn_part, silu_mul, dequant_int4, dequant_q8_0, draw_row, argmax_row, silu_mul_bf16, silu_mul_bf16_f32, rms_norm_bf16, rope_bf16, rope_f32};
  return k;
}
