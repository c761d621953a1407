// The vector vocabulary kernels.h is written in, one set per ISA. Included once per ISA region
// (isa_avx512.cpp, isa_avx2.cpp, isa_scalar.cpp) after `#pragma GCC target`, with KV_ISA set:
// 512 (AVX-512F/BW/DQ/VL + FMA), 256 (AVX2 + FMA), 0 (portable C++, any CPU).
//   VF            a vector of KV_W floats
//   vload(p)      KV_W floats from p          vstore(p, v)
//   vfma(a, b, c) a * b + c                   vset(x), vzero(), vsum(v) (horizontal add)
//   nib32(p, s, z, out)  16 bytes of nibbles (kvserve's int4 layout: weight 2j in the low nibble
//                 of byte j) -> 32 weights q * s + z, as [the 16 even weights, the 16 odd ones]
//                 in 32 / KV_W vectors
//   high32(hb, s, out)  a fifth bit per weight (a GGUF Q5 file's): out[i] += 16 s where bit i of
//                 the 32-bit word at hb is set, bit i the i-th weight in nib32's order
//   deq32(p, bits, s, z, out)  16 bytes of nibbles -> the 32 weights (q + 16 fifth - 8) * s + z in
//                 weight order, in 32 / KV_W vectors (each the exact value rounded once: the
//                 product is exact); `bits` the fifth bits, bit j weight 2j, bit 16 + j weight 2j + 1
//   vstore_bf16(p, v)  KV_W floats -> bfloat16 (nearest even, as f32_to_bf16) at p
//   i8f(p)        KV_W int8 -> KV_W floats  vmul(a, b)
//   h2f(h)        one float16 (its bits) -> float (GGUF Q8_0's d)
//   vload_bf16(p) KV_W bfloat16 -> KV_W floats
//   vload_bf16_split(p, even, odd)  2 KV_W bfloat16 -> their even-indexed values and their odd
//                 ones as floats (a shift and a mask: no shuffle, unlike vload_bf16's widening)
//   vmax(a, b), vhmax(v) (horizontal max)
//   vsum_many(v, out)  out[i] = vsum(v[i]) for KV_W vectors, as one transpose-and-add tree
//                 (45 shuffles and adds for 16 zmm against 16 separate reductions' ~130)
#pragma once

// ahead(p): the cache line KV_AHEAD bytes past p requested into L1 (software prefetch). The
// integer GEMVs read a weight stream with a few instructions per 64 bytes; the hardware
// prefetcher alone keeps too few lines in flight for them on 2 cores (SmolLM2 Q8_0 at one row,
// benchmarks/profile_decode.py: 96-102 tokens/s without it, 133-140 with it, 2026-12-06, AVX512).
#ifndef KV_AHEAD
#define KV_AHEAD 4096
#endif
static inline void ahead(const void* p) { __builtin_prefetch((const char*)p + KV_AHEAD, 0, 3); }

#if KV_ISA == 512
#define KV_W 16
typedef __m512 VF;
static inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vset(float x) { return _mm512_set1_ps(x); }
static inline VF vzero() { return _mm512_setzero_ps(); }
static inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
static inline void nib32(const uint8_t* p, VF s, VF z, VF* out) {
  // the 16 values q * s + z as a table, each weight looked up by its nibble (vpermps reads the
  // low 4 bits of each index: the low nibble as it is, the high one shifted down)
  const VF lut = vfma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, z);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  out[0] = _mm512_permutexvar_ps(q, lut);
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
}
static inline void high32(const uint8_t* hb, VF s, VF* out) {
  uint32_t bits;
  __builtin_memcpy(&bits, hb, 4);
  const VF s16 = _mm512_mul_ps(s, _mm512_set1_ps(16.0f));
  out[0] = _mm512_mask_add_ps(out[0], (__mmask16)(bits & 0xFFFF), out[0], s16);
  out[1] = _mm512_mask_add_ps(out[1], (__mmask16)(bits >> 16), out[1], s16);
}
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline void deq32(const uint8_t* p, uint32_t bits, VF s, VF z, VF* out) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15), h = _mm_set1_epi8(16);
  __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  lo = _mm_mask_add_epi8(lo, (__mmask16)(bits & 0xFFFF), lo, h);
  hi = _mm_mask_add_epi8(hi, (__mmask16)(bits >> 16), hi, h);
  const __m512i eight = _mm512_set1_epi32(8);
  out[0] = vfma(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), eight)), s, z);
  out[1] = vfma(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), eight)), s, z);
}
static inline void vstore_bf16(uint16_t* p, VF v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline VF i8f(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline VF vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void vload_bf16_split(const uint16_t* p, VF& even, VF& odd) {
  const __m512i u = _mm512_loadu_si512((const void*)p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline float vhmax(VF v) { return _mm512_reduce_max_ps(v); }
static inline void vsum_many(const VF* v, float* out) {
  __m512 s8[8], s4[4], s2[2];
  for (int k = 0; k < 8; ++k)          // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s8[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)          // per lane: the lane's sums of v[4k .. 4k + 3]
    s4[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s8[2 * k]), _mm512_castps_pd(s8[2 * k + 1]))),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s8[2 * k]), _mm512_castps_pd(s8[2 * k + 1]))));
  for (int k = 0; k < 2; ++k)          // lanes summed in pairs
    s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * k], s4[2 * k + 1], 0x88), _mm512_shuffle_f32x4(s4[2 * k], s4[2 * k + 1], 0xDD));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD)));
}
#elif KV_ISA == 256
#define KV_W 8
typedef __m256 VF;
static inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vset(float x) { return _mm256_set1_ps(x); }
static inline VF vzero() { return _mm256_setzero_ps(); }
static inline float vsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline void nib32(const uint8_t* p, VF s, VF z, VF* out) {
  __m128i b = _mm_loadu_si128((const __m128i*)p);
  __m128i m = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  out[0] = vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, z);
  out[1] = vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, z);
  out[2] = vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, z);
  out[3] = vfma(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, z);
}
static inline void high32(const uint8_t* hb, VF s, VF* out) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const VF s16 = _mm256_mul_ps(s, _mm256_set1_ps(16.0f));
  for (int v = 0; v < 4; ++v) {     // each byte's 8 bits as 8 lane masks
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(hb[v]), sel), sel);
    out[v] = _mm256_add_ps(out[v], _mm256_and_ps(_mm256_castsi256_ps(m), s16));
  }
}
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline void deq32(const uint8_t* p, uint32_t bits, VF s, VF z, VF* out) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p), m = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  if (bits) {       // 16 bits -> 16 byte masks: byte j of the pair (j / 8) tested against 1 << (j % 8)
    const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, (char)128, 1, 2, 4, 8, 16, 32, 64, (char)128);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i h = _mm_set1_epi8(16);
    const __m128i ml = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)(bits & 0xFFFF)), spread), sel), sel);
    const __m128i mh = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)(bits >> 16)), spread), sel), sel);
    lo = _mm_add_epi8(lo, _mm_and_si128(ml, h));
    hi = _mm_add_epi8(hi, _mm_and_si128(mh, h));
  }
  const __m128i q0 = _mm_unpacklo_epi8(lo, hi), q1 = _mm_unpackhi_epi8(lo, hi);
  const __m256i eight = _mm256_set1_epi32(8);
  out[0] = vfma(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q0), eight)), s, z);
  out[1] = vfma(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q0, 8)), eight)), s, z);
  out[2] = vfma(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q1), eight)), s, z);
  out[3] = vfma(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q1, 8)), eight)), s, z);
}
static inline void vstore_bf16(uint16_t* p, VF v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
}
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline VF i8f(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline VF vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void vload_bf16_split(const uint16_t* p, VF& even, VF& odd) {
  const __m256i u = _mm256_loadu_si256((const __m256i*)p);
  even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline void vsum_many(const VF* v, float* out) {
  __m256 s4[4], s2[2];
  for (int k = 0; k < 4; ++k)          // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s4[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)          // per lane: the lane's sums of v[4k .. 4k + 3]
    s2[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(s4[2 * k]), _mm256_castps_pd(s4[2 * k + 1]))),
                          _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(s4[2 * k]), _mm256_castps_pd(s4[2 * k + 1]))));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20), _mm256_permute2f128_ps(s2[0], s2[1], 0x31)));
}
static inline float vhmax(VF v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define KV_W 1
typedef float VF;
static inline VF vload(const float* p) { return *p; }
static inline void vstore(float* p, VF v) { *p = v; }
static inline VF vfma(VF a, VF b, VF c) { return a * b + c; }
static inline VF vset(float x) { return x; }
static inline VF vzero() { return 0.f; }
static inline float vsum(VF v) { return v; }
static inline void nib32(const uint8_t* p, VF s, VF z, VF* out) {
  for (int j = 0; j < 16; ++j) {
    out[j] = (float)(p[j] & 15) * s + z;
    out[16 + j] = (float)(p[j] >> 4) * s + z;
  }
}
static inline void high32(const uint8_t* hb, VF s, VF* out) {
  for (int i = 0; i < 32; ++i)
    if ((hb[i / 8] >> (i % 8)) & 1) out[i] += 16.0f * s;
}
static inline VF vmul(VF a, VF b) { return a * b; }
static inline void deq32(const uint8_t* p, uint32_t bits, VF s, VF z, VF* out) {
  for (int j = 0; j < 16; ++j) {
    out[2 * j] = (float)((int)(p[j] & 15) + 16 * (int)((bits >> j) & 1) - 8) * s + z;
    out[2 * j + 1] = (float)((int)(p[j] >> 4) + 16 * (int)((bits >> (16 + j)) & 1) - 8) * s + z;
  }
}
static inline void vstore_bf16(uint16_t* p, VF v) { *p = f32_to_bf16(v); }
static inline float h2f(uint16_t h) { return f16_to_f32(h); }
static inline VF i8f(const int8_t* p) { return (float)p[0]; }
static inline VF vmax(VF a, VF b) { return a > b ? a : b; }
static inline void vsum_many(const VF* v, float* out) { out[0] = v[0]; }
static inline float vhmax(VF v) { return v; }
#endif
