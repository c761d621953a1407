// What the ISA regions and the ATen-facing code share: plain structs and the kernel table.
// Nothing here is compiled for one ISA only, so every inline function of it is portable.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvk {

// bfloat16 bits <-> float32 (to bfloat16: nearest even, as torch's .to(torch.bfloat16) and
// vcvtneps2bf16 round).
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float16 bits -> float32, exactly (subnormals, infinities and NaN included): the portable code's;
// the ISA regions convert with F16C.
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu;
  uint32_t u;
  if (e == 31) {
    u = sign | 0x7F800000u | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else {                                  // zero or subnormal: m * 2^-24
    float f = (float)m * 5.9604644775390625e-8f;
    __builtin_memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Bytes a row of x takes as the int16 route's planes (kernels.h q16_rows): K rounded up to 128, twice.
static inline size_t q16_plane_bytes(int K) { return (size_t)(K + 127) / 128 * 256; }

// One decode-attention call over the paged KV cache (seed 003): q [B, H, D] float32; the caches
// [num_blocks, KV, block_size, D] in float32, bfloat16 or int8 (then one float32 scale per token
// and KV head, [num_blocks, KV, block_size]); block_tables [B, max_blocks] int64.
struct AttnArgs {
  const float* q;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;      // int8 caches only
  const float* v_scale;
  int kv_kind;               // 0 float32, 1 bfloat16, 2 int8
  int64_t block_stride;      // KV * block_size * D elements
  int block_size, num_heads, num_kv_heads, head_dim;
  const int64_t* block_tables;
  int64_t table_stride;      // max_blocks
  float scale;
};

// The kernels of one ISA. Shapes: x [T, K] float32; y [T, N] float32; rows n0..n1 of y computed.
//   gemv_int4: W = (q - 8) * scale + zero per group of G, q as kvserve's nibbles [N, K / 2],
//              scales and zeros bfloat16 [N, 2, K / G] (row n: its scales, then its zeros); `xp` is x in int4_order (each 32 weights:
//              the 16 even ones, then the 16 odd ones). `hb`: null, or a fifth bit per weight [N, K / 8]
//              (GGUF Q5_0 / Q5_1 / Q5_K held in their own type): q = nibble + 16 bit, 0..31; per 32
//              weights a little-endian 32-bit word, bit i the i-th weight in x's int4 order.
//   gemv_int4_q16: the same weights times x quantized to int16 per 32 weights, as byte planes (kernels.h: q16_rows),
//              which quantize_planes writes.
//   gemv_int8: W = q * scale[n], q [N, K] int8, scale [N] bfloat16.
//   gemv_q8_0: W = q * d[n, k / G] (GGUF Q8_0: G 32, d the file's bits; Q6_K: G 16, d its super-block's
//              d times the sub-block's scale, rounded to float16), q [N, K] int8, d [N, K / G] float16.
//   gemv_q8_0_q16: the same weights times x quantized to int16 per 32 weights (kernels.h: q8_q16_rows),
//              which quantize_q8 writes.
//   attn_part: query heads of KV head `kvh` of sequence b over tokens t0..t1: the unnormalised
//              output [G, D] and (max, sum of exp) [G, 2] of the online softmax (FlashDecoding).
//   silu_mul:  [T, 2I] (gate, up) -> [T, I] silu(gate) * up.
//   dequant_int4 / dequant_q8_0: rows n0..n1 of a weight as a dense matrix [n1 - n0, K], float32
//              (f) or bfloat16 (b, rounded to nearest even), for steps the kernels do not take.
//   draw_row:  a token drawn from logits x [V] by inverse CDF at u in [0, 1) (sampling.h), e [V] scratch.
//   argmax_row: the index of x's first largest entry [V], NaN the largest (torch.argmax's; sampling.h).
//   silu_mul_bf16 / rms_norm_bf16: silu_mul and RMSNorm (weight w [H]) over bfloat16 rows (rows_bf16.h);
//              RMSNorm with d: of x + d (rounded, written to xo) -- a residual add and the next norm.
//   rope_bf16: RoPE (rotate_half) of bfloat16 heads x [T][heads][D] (row stride `stride`) with
//              bfloat16 cos / signed sin [T, D] -> out [T, heads, D] (rows_bf16.h); rope_f32 the same in float32.
struct IsaKernels {
  const char* name;
  int width;      // floats per vector: head dims must be a multiple for attn_part
  void (*gemv_int4)(const float* xp, int T, int K, const uint8_t* nib, const uint16_t* sz, const uint8_t* hb,
                    int N, int G, float* y, int n0, int n1);
  void (*gemv_int4_q16)(const uint8_t* xb, const float* dx, const float* xsum, int T, int K, int Bp,
                       const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int N, int G, float* y,
                       int n0, int n1);
  void (*quantize_planes)(const float* x, int T, int K, int Bp, uint8_t* xb, float* dx, float* xs);
  void (*gemv_int8)(const float* x, int T, int K, const int8_t* q, const uint16_t* scale, int N,
                    float* y, int n0, int n1);
  void (*gemv_q8_0)(const float* x, int T, int K, const int8_t* q, const uint16_t* d, int G, int N,
                    float* y, int n0, int n1);
  void (*gemv_q8_0_q16)(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                        int T, int K, const int8_t* q, const uint16_t* d, int G, int N, float* y, int n0, int n1);
  void (*quantize_q8)(const float* x, int T, int K, int16_t* xq, uint8_t* xl, int8_t* xh, int32_t* xc, float* dx);
  void (*attn_part)(const AttnArgs& a, int b, int kvh, int t0, int t1, float* out, float* ml);
  void (*silu_mul)(const float* gu, int T, int I, float* out);
  void (*dequant_int4)(const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int K, int G, int n0, int n1,
                       float* f, uint16_t* b);
  void (*dequant_q8_0)(const int8_t* q, const uint16_t* d, int K, int G, int n0, int n1, float* f, uint16_t* b);
  int64_t (*draw_row)(const float* x, int V, float u, float* e);
  int64_t (*argmax_row)(const float* x, int V);
  void (*silu_mul_bf16)(const uint16_t* gu, int T, int I, uint16_t* out, bool once);
  void (*silu_mul_bf16_f32)(const uint16_t* gu, int T, int I, float* out);
  void (*rms_norm_bf16)(const uint16_t* x, const uint16_t* d, const uint16_t* w, int T, int H, float eps,
                        uint16_t* xo, uint16_t* out);
  void (*rope_bf16)(const uint16_t* x, int64_t stride, int T, int heads, int D, const uint16_t* cos,
                    const uint16_t* sin, uint16_t* out);
  void (*rope_f32)(const float* x, int64_t stride, int T, int heads, int D, const float* cos,
                   const float* sin, float* out);
};

// A weight as isa_amx.cpp reads it: `format` as ops.h's Format (dense: bfloat16 only), `a` / `b`
// the format's two tensors' data (common.h's shapes above; b unused for dense); `c` an int4
// weight's fifth bits (gemv_int4's hb) or null.
struct AmxWeight {
  int format, N, K, G;
  const void* a;
  const void* b;
  const void* c;
};
// The CPU has AMX-BF16 (and AVX512-BF16) and the OS granted this process the tile state.
bool amx_ready();
// y rows n0..n1 (a multiple of 16 from n0) of x @ W.T, any T activation rows, x as bfloat16
// VNNI pairs xb [ceil(T/16)][K/2][16][2] (amx_pack), y [T, N] float32.
void amx_linear(const uint16_t* xb, int T, const AmxWeight& w, float* y, int n0, int n1);
// x [T, K] float32 (K a multiple of 32) -> xb as amx_linear reads it, each value rounded to
// bfloat16 (nearest even), the rows past T of the last 16 zero.
void amx_pack(const float* x, int T, int K, uint16_t* xb);

const IsaKernels& avx512_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& scalar_kernels();

constexpr int MAX_GQA = 16;        // query heads per KV head attn_part holds
constexpr int MAX_HEAD_DIM = 256;

}  // namespace kvk
