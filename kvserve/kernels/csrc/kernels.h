// The decode kernels, written once in vec.h's vocabulary and compiled once per ISA region. Only
// raw pointers and this file's own functions here: nothing from ATen or the standard library is
// instantiated inside an ISA region (it would be merged with other regions' copies at link time).
// Each function of one ISA is reached through kvk::IsaKernels (common.h).

static inline int imin(int a, int b) { return a < b ? a : b; }

// exp(x) for x <= 0 in place (Cephes' polynomial, about 2 ulp), a loop the compiler vectorises.
static void exp_inplace(float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    float v = x[i] < -87.0f ? -87.0f : (x[i] > 88.0f ? 88.0f : x[i]);
    float fx = __builtin_floorf(v * 1.44269504088896341f + 0.5f);
    float r = v - fx * 0.693359375f + fx * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)fx + 127) << 23;
    float two_n;
    __builtin_memcpy(&two_n, &e, 4);
    x[i] = p * two_n;
  }
}

// ---- int4 GEMV: RB weight rows by TB activation rows per register block -----------------
// Few activation rows (decode): each weight is dequantized once into registers and multiplied
// with every row; NA accumulators per (row, activation) break the FMA latency chain at T <= 2.
// hb: the fifth bits [N, K / 8] (vec.h high32; null for int4), q then 0..31.
template <int RB, int TB>
static inline void int4_block(const float* xp, int K, const uint8_t* nib, const uint16_t* sz,
                              const uint8_t* hb, int N, int G, float* y, int n, int t0) {
  constexpr int NV = 32 / KV_W, NA = TB <= 2 ? 2 : 1;
  VF acc[RB][TB][NA];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t)
      for (int a = 0; a < NA; ++a) acc[r][t][a] = vzero();
  const size_t row_bytes = (size_t)K / 2, groups = (size_t)K / G;
  for (int g = 0; g < K / G; ++g) {
    for (int c = g * G; c < (g + 1) * G; c += 32) {
      VF w[RB][NV];
      for (int r = 0; r < RB; ++r) {
        const uint16_t* sg = sz + (size_t)(n + r) * 2 * groups + g;     // [N, 2, K/G]: scales, then zeros
        const float sc = bf16_to_f32(sg[0]);
        if (!(c & 127)) ahead(nib + (size_t)(n + r) * row_bytes + c / 2);
        nib32(nib + (size_t)(n + r) * row_bytes + c / 2, vset(sc), vset(bf16_to_f32(sg[groups]) - 8.0f * sc), w[r]);
        if (hb) high32(hb + (size_t)(n + r) * (K / 8) + c / 8, vset(sc), w[r]);
      }
      for (int t = 0; t < TB; ++t) {
        VF xv[NV];
        for (int v = 0; v < NV; ++v) xv[v] = vload(xp + (size_t)(t0 + t) * K + c + v * KV_W);
        for (int r = 0; r < RB; ++r)
          for (int v = 0; v < NV; ++v) acc[r][t][v % NA] = vfma(w[r][v], xv[v], acc[r][t][v % NA]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      VF s = acc[r][t][0];
      for (int a = 1; a < NA; ++a) s = s + acc[r][t][a];
      y[(size_t)(t0 + t) * N + n + r] = vsum(s);
    }
}

#if KV_ISA == 512
#define KV_RB 4
#define KV_TB 6      // KV_RB * KV_TB accumulators + KV_RB weights + 1 activation <= 32 zmm
#else
#define KV_RB 2
#define KV_TB 6      // <= 16 ymm (the portable build has no registers to count)
#endif
constexpr int SLAB = 1024;   // weights of a row dequantized at a time by the tile path (in L1)

// acc[r][t] over one slab of `buf` (KV_RB dequantized weight rows) for TB activation rows from t0.
template <int TB>
static inline void tile_block(const float* x, int K, int k0, int kn, const float* buf, int t0,
                              float* y, int N, int n, int rb) {
  VF acc[KV_RB][TB];
  for (int r = 0; r < KV_RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = vzero();
  const float* xt = x + (size_t)t0 * K + k0;
  for (int c = 0; c < kn; c += KV_W) {
    VF w[KV_RB];
    for (int r = 0; r < KV_RB; ++r) w[r] = vload(buf + (size_t)r * SLAB + c);
    for (int t = 0; t < TB; ++t) {
      const VF xv = vload(xt + (size_t)t * K + c);
      for (int r = 0; r < KV_RB; ++r) acc[r][t] = vfma(w[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < rb; ++r)
    for (int t = 0; t < TB; ++t) y[(size_t)(t0 + t) * N + n + r] += vsum(acc[r][t]);
}

// Many activation rows (batches, prefill) of any weight format: rows n..n+rb dequantized into a
// buffer SLAB weights at a time by `deq(r, k0, kn, out)` (row n + r, weights k0..k0+kn, in the
// order x is in), then a register-blocked KV_RB x KV_TB product over every activation row.
template <class Deq>
static void tile_rows(const float* x, int T, int K, float* y, int N, int n, int rb, const Deq& deq) {
  float buf[KV_RB * SLAB];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < rb; ++r) y[(size_t)t * N + n + r] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += SLAB) {
    const int kn = imin(SLAB, K - k0);
    for (int r = 0; r < rb; ++r) deq(r, k0, kn, buf + (size_t)r * SLAB);
    for (int r = rb; r < KV_RB; ++r)
      for (int c = 0; c < kn; ++c) buf[(size_t)r * SLAB + c] = 0.0f;
    int t0 = 0;
    for (; t0 + KV_TB <= T; t0 += KV_TB) tile_block<KV_TB>(x, K, k0, kn, buf, t0, y, N, n, rb);
    switch (T - t0) {
      case 5: tile_block<5>(x, K, k0, kn, buf, t0, y, N, n, rb); break;
      case 4: tile_block<4>(x, K, k0, kn, buf, t0, y, N, n, rb); break;
      case 3: tile_block<3>(x, K, k0, kn, buf, t0, y, N, n, rb); break;
      case 2: tile_block<2>(x, K, k0, kn, buf, t0, y, N, n, rb); break;
      case 1: tile_block<1>(x, K, k0, kn, buf, t0, y, N, n, rb); break;
      default: break;
    }
  }
}

// int4 rows as float32 in int4 order (x must be int4_order'd).
static void int4_tile(const float* xp, int T, int K, const uint8_t* nib, const uint16_t* sz,
                      const uint8_t* hb, int N, int G, float* y, int n, int rb) {
  tile_rows(xp, T, K, y, N, n, rb, [&](int r, int k0, int kn, float* out) {
    const int groups = K / G;
    const uint16_t* srow = sz + (size_t)(n + r) * 2 * groups;
    for (int c = 0; c < kn; c += 32) {
      if (!(c & 127)) ahead(nib + (size_t)(n + r) * (K / 2) + (k0 + c) / 2);
      const uint16_t* p = srow + (k0 + c) / G;
      const float sc = bf16_to_f32(p[0]);
      VF w[32 / KV_W];
      nib32(nib + (size_t)(n + r) * (K / 2) + (k0 + c) / 2, vset(sc), vset(bf16_to_f32(p[groups]) - 8.0f * sc), w);
      if (hb) high32(hb + (size_t)(n + r) * (K / 8) + (k0 + c) / 8, vset(sc), w);
      for (int v = 0; v < 32 / KV_W; ++v) vstore(out + c + v * KV_W, w[v]);
    }
  });
}

// Few activation rows, integer dot products: x quantized per 32 weights to int16 (xq = round(x /
// dx), dx = max |x| / 32767: about 2^-16 of the block's largest, as exact as float32 at these
// sizes) and held as its two bytes, xq = 256 xh + xl (xh signed, xl unsigned); each block's
//   sum(q * xq) = 256 sum(q * xh) + sum(xl * q)
// exact in int32 from byte products (VNNI vpdpbusd, AVX2 vpmaddubsw: the nibbles and xl unsigned,
// xh and q, <= 31, signed), then
//   y[n] += s[n, b] * dx[b] * (sum(q * xq) - 8 sum(xq)) + zero[n, b] * sum(x)
// x's planes (quantize_planes below), per 128 weights 256 bytes: xh of the even weights, xh of
// the odd ones, xl of the even ones, xl of the odd ones (64 each), so that a row's 64 bytes of
// nibbles, masked (the even weights) and shifted (the odd ones), meet their x byte for byte: 32-bit
// lane l of a product holds weights 8l .. 8l + 7, all of block l / 4. [T, QP] bytes, QP = K rounded
// up to 128, twice (a row of K % 128 == 64 ends in half a chunk, zero-padded).
// dx [T, Bp] and xs [T, 2, Bp] (per block sum(x), then dx * sum(xq)), Bp = K / 32 padded to 16
// with zeros. The weight's scales and zeros per group, [N, 2, K / G] bfloat16 as every int4
// kernel reads them, give each block of 32 its group's pair.

// 16 bfloat16 values as float32, the first n of them (n <= 16) read, the rest zero.
static inline void bf16x16(const uint16_t* p, int n, float* out) {
#if KV_ISA == 512
  const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  return;
#endif
  if (n == 16) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) out[i] = bf16_to_f32(p[i]);
  } else {
    for (int i = 0; i < 16; ++i) out[i] = i < n ? bf16_to_f32(p[i]) : 0.0f;
  }
}

// The scales and the zeros of blocks b0 .. b0 + n - 1 (n <= 16) of one row (`row`: its [2, K/G]
// slice), zero-padded to 16 each: groups of 32 are the blocks themselves, wider ones repeat.
static inline void block_scales16(const uint16_t* row, int K, int G, int b0, int n, float* s16, float* z16) {
  const int groups = K / G;
  if (G == 32) {
    bf16x16(row + b0, n, s16);
    bf16x16(row + groups + b0, n, z16);
    return;
  }
  const int per = G / 32;
  for (int i = 0; i < 16; ++i) {
    const int g = (b0 + i) / per;
    s16[i] = i < n ? bf16_to_f32(row[g]) : 0.0f;
    z16[i] = i < n ? bf16_to_f32(row[groups + g]) : 0.0f;
  }
}

#if KV_ISA == 512
// The sums of four vectors.
static inline __m128 vsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0x4E));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
  return _mm512_castps512_ps128(s);
}
#elif KV_ISA == 256
// 32 bits -> 32 byte masks (byte j: bit j set).
static inline __m256i byte_masks(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                          3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), sel), sel);
}
#endif

// RB weight rows n.. times TB activation rows. hb: the fifth bits (null for int4), bits 0-15 of a
// block's word its even weights, 16-31 its odd ones: q = nibble + 16 bit, 0..31 (the - 8 sum(xq)
// term is the same).
template <int RB, int TB>
static inline void q16_rows(const uint8_t* xb, const float* dx, const float* xs, int K, int Bp,
                            const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int G, float* y, int N, int n) {
  const int nb = K / 32, groups = K / G;
  const size_t QP = q16_plane_bytes(K);
  alignas(64) float s16[16], z16[16];
#if KV_ISA == 512
  __m512 facc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) facc[r][t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15), v16 = _mm512_set1_epi8(16), four = _mm512_set1_epi32(4);
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int bn = imin(16, nb - b0);
    __m512 sv[RB][TB];
    for (int r = 0; r < RB; ++r) {
      block_scales16(sz + (size_t)(n + r) * 2 * groups, K, G, b0, bn, s16, z16);
      const __m512 s = _mm512_load_ps(s16), s8 = _mm512_mul_ps(_mm512_set1_ps(-8.0f), s), zv = _mm512_load_ps(z16);
      for (int t = 0; t < TB; ++t) {
        const float* st = xs + (size_t)t * 2 * Bp + b0;
        facc[r][t] = _mm512_fmadd_ps(zv, _mm512_loadu_ps(st), _mm512_fmadd_ps(s8, _mm512_loadu_ps(st + Bp), facc[r][t]));
        sv[r][t] = _mm512_mul_ps(s, _mm512_loadu_ps(dx + (size_t)t * Bp + b0));
      }
    }
    __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);   // lane -> block of sv
    for (int p = 0; p < bn; p += 4) {           // four blocks: 128 weights, 64 bytes of nibbles
      const int left = imin(4, bn - p);
      const __mmask64 m = left == 4 ? ~0ull : (1ull << (16 * left)) - 1;
      __m512i xv[TB][4];
      for (int t = 0; t < TB; ++t)
        for (int k = 0; k < 4; ++k) xv[t][k] = _mm512_loadu_si512((const void*)(xb + t * QP + (size_t)(b0 + p) * 64 + 64 * k));
      for (int r = 0; r < RB; ++r) {
        const uint8_t* w = nib + (size_t)(n + r) * (K / 2) + (size_t)(b0 + p) * 16;
        ahead(w);
        const __m512i bytes = _mm512_maskz_loadu_epi8(m, w);
        __m512i lo = _mm512_and_si512(bytes, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), m4);
        if (hb) {        // the words' low halves (the evens) and high halves (the odds) as two byte masks
          const __m128i words = _mm_maskz_loadu_epi32((__mmask8)((1u << left) - 1), hb + (size_t)(n + r) * (K / 8) + (size_t)(b0 + p) * 4);
          const __m128i halves = _mm_shuffle_epi8(words, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
          lo = _mm512_mask_add_epi8(lo, (__mmask64)_mm_cvtsi128_si64(halves), lo, v16);
          hi = _mm512_mask_add_epi8(hi, (__mmask64)_mm_extract_epi64(halves, 1), hi, v16);
        }
        for (int t = 0; t < TB; ++t) {
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xv[t][0]);
          d = _mm512_dpbusd_epi32(d, hi, xv[t][1]);
          d = _mm512_slli_epi32(d, 8);
          d = _mm512_dpbusd_epi32(d, xv[t][2], lo);
          d = _mm512_dpbusd_epi32(d, xv[t][3], hi);
          facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, sv[r][t]), facc[r][t]);
        }
      }
      idx = _mm512_add_epi32(idx, four);
    }
  }
  for (int t = 0; t < TB; ++t) {
    if (RB == 4) {
      _mm_storeu_ps(y + (size_t)t * N + n, vsum4(facc[0][t], facc[RB > 1][t], facc[RB > 2 ? 2 : 0][t], facc[RB > 3 ? 3 : 0][t]));
    } else {
      for (int r = 0; r < RB; ++r) y[(size_t)t * N + n + r] = _mm512_reduce_add_ps(facc[r][t]);
    }
  }
#elif KV_ISA == 256
  __m256 facc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) facc[r][t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), v16 = _mm256_set1_epi8(16);
  const __m256i ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int bn = imin(16, nb - b0);
    __m256 sv[RB][TB][2];
    for (int r = 0; r < RB; ++r) {
      block_scales16(sz + (size_t)(n + r) * 2 * groups, K, G, b0, bn, s16, z16);
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_load_ps(s16 + 8 * h), s8 = _mm256_mul_ps(_mm256_set1_ps(-8.0f), s);
        const __m256 zv = _mm256_load_ps(z16 + 8 * h);
        for (int t = 0; t < TB; ++t) {
          const float* st = xs + (size_t)t * 2 * Bp + b0 + 8 * h;
          facc[r][t] = _mm256_fmadd_ps(zv, _mm256_loadu_ps(st), _mm256_fmadd_ps(s8, _mm256_loadu_ps(st + Bp), facc[r][t]));
          sv[r][t][h] = _mm256_mul_ps(s, _mm256_loadu_ps(dx + (size_t)t * Bp + b0 + 8 * h));
        }
      }
    }
    for (int p = 0; p < bn; p += 2) {           // two blocks: 64 weights, 32 bytes of nibbles
      const int j = p & 7;
      const __m256i idx = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
      const size_t xo = (size_t)(b0 + p) / 4 * 256 + ((b0 + p) & 2) * 16;   // the half of the chunk
      for (int r = 0; r < RB; ++r) {
        const uint8_t* w = nib + (size_t)(n + r) * (K / 2) + (size_t)(b0 + p) * 16;
        if (!(p & 2)) ahead(w);
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)w);
        __m256i lo = _mm256_and_si256(bytes, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
        if (hb) {
          uint32_t wd[2];
          __builtin_memcpy(wd, hb + (size_t)(n + r) * (K / 8) + (size_t)(b0 + p) * 4, 8);
          lo = _mm256_add_epi8(lo, _mm256_and_si256(byte_masks((wd[0] & 0xFFFF) | (wd[1] << 16)), v16));
          hi = _mm256_add_epi8(hi, _mm256_and_si256(byte_masks((wd[0] >> 16) | (wd[1] & 0xFFFF0000u)), v16));
        }
        for (int t = 0; t < TB; ++t) {
          const uint8_t* xp = xb + t * QP + xo;
          // each 16-bit sum of two byte products: |q xh| <= 31 * 128, xl q <= 255 * 31, so the pairs
          // of lo and hi together stay under 2^15: no saturation
          const __m256i mh = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xp)),
                                              _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xp + 64))));
          const __m256i ml = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(xp + 128)), lo),
                                              _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(xp + 192)), hi));
          const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(mh, c256), _mm256_madd_epi16(ml, ones));
          facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(sv[r][t][p >> 3], idx), facc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) y[(size_t)t * N + n + r] = vsum(facc[r][t]);
#else
  float acc[RB][TB] = {};
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int bn = imin(16, nb - b0);
    for (int r = 0; r < RB; ++r) {
      block_scales16(sz + (size_t)(n + r) * 2 * groups, K, G, b0, bn, s16, z16);
      const uint8_t* w = nib + (size_t)(n + r) * (K / 2);
      for (int t = 0; t < TB; ++t) {
        for (int i = 0; i < 16; ++i)
          acc[r][t] += z16[i] * xs[(size_t)t * 2 * Bp + b0 + i] - 8.0f * s16[i] * xs[(size_t)t * 2 * Bp + Bp + b0 + i];
        for (int p = 0; p < bn; ++p) {
          const int b = b0 + p;
          const uint8_t* bw = w + (size_t)b * 16;
          const uint8_t* xc = xb + t * QP + (size_t)(b / 4) * 256 + (b % 4) * 16;
          uint32_t bits = 0;
          if (hb) __builtin_memcpy(&bits, hb + (size_t)(n + r) * (K / 8) + (size_t)b * 4, 4);
          int32_t d = 0;
          for (int j = 0; j < 16; ++j) {
            const int even = (bw[j] & 15) + 16 * (int)((bits >> j) & 1), odd = (bw[j] >> 4) + 16 * (int)((bits >> (16 + j)) & 1);
            d += even * (256 * (int8_t)xc[j] + xc[128 + j]) + odd * (256 * (int8_t)xc[64 + j] + xc[192 + j]);
          }
          acc[r][t] += (float)d * s16[p] * dx[(size_t)t * Bp + b];
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) y[(size_t)t * N + n + r] = acc[r][t];
#endif
}

// One block of 32 activations -> q[j] = round(x[j] / dx) (nearest even), dx = max |x| / 32767;
// returns max |x|, and the block's sum of x in *sum where it is asked for. (quantize_planes and
// quantize_q8 then lay q out as their routes read it.)
static inline float q16_block(const float* xv, int32_t* q, float* sum) {
#if KV_ISA == 512
  const __m512 a = _mm512_loadu_ps(xv), e = _mm512_loadu_ps(xv + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(e)));
  if (sum) *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, e));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  _mm512_storeu_si512((void*)q, _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
  _mm512_storeu_si512((void*)(q + 16), _mm512_cvtps_epi32(_mm512_mul_ps(e, inv)));
#elif KV_ISA == 256
  __m256 v[4], m = _mm256_setzero_ps(), sv = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xv + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
    sv = _mm256_add_ps(sv, v[i]);
  }
  const float amax = vhmax(m);
  if (sum) *sum = vsum(sv);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  for (int i = 0; i < 4; ++i) _mm256_storeu_si256((__m256i*)(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
#else
  float amax = 0.0f, s = 0.0f;
  for (int j = 0; j < 32; ++j) { amax = xv[j] > amax ? xv[j] : (-xv[j] > amax ? -xv[j] : amax); s += xv[j]; }
  if (sum) *sum = s;
  const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
  for (int j = 0; j < 32; ++j) q[j] = (int32_t)__builtin_nearbyintf(xv[j] * inv);
#endif
  return amax;
}

// x [T, K] -> the activations q16_rows reads: per 32 weights xq = round(x / dx) (nearest even),
// dx = max |x| / 32767, as the byte planes xb [T, q16_plane_bytes(K)] (zero-padded); dx [T, Bp]
// and xs [T, 2, Bp] (each block's sum of x, then dx * the sum of its xq), zero past K / 32.
static void quantize_planes(const float* x, int T, int K, int Bp, uint8_t* xb, float* dx, float* xs) {
  const size_t QP = q16_plane_bytes(K);
  for (int t = 0; t < T; ++t) {
    uint8_t* xt = xb + (size_t)t * QP;
    for (size_t i = (size_t)K / 128 * 256; i < QP; ++i) xt[i] = 0;     // a half chunk's other half
    for (int b = 0; b < Bp; ++b) {
      float* d = dx + (size_t)t * Bp + b;
      float* s = xs + (size_t)t * 2 * Bp + b;
      if (b >= K / 32) { *d = s[0] = s[Bp] = 0.0f; continue; }
      uint8_t* c = xt + (size_t)(b / 4) * 256 + (b % 4) * 16;    // this block's 16 bytes of each plane
      alignas(64) int32_t q[32];
      const float amax = q16_block(x + (size_t)t * K + (size_t)b * 32, q, s);
      int64_t qsum = 0;
#if KV_ISA == 512
      const __m512i qa = _mm512_load_si512((const void*)q), qe = _mm512_load_si512((const void*)(q + 16));
      qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qe));
      const __m512i ev = _mm512_permutex2var_epi32(qa, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), qe);
      const __m512i od = _mm512_permutex2var_epi32(qa, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), qe);
      _mm_storeu_si128((__m128i*)c, _mm512_cvtepi32_epi8(_mm512_srai_epi32(ev, 8)));
      _mm_storeu_si128((__m128i*)(c + 64), _mm512_cvtepi32_epi8(_mm512_srai_epi32(od, 8)));
      _mm_storeu_si128((__m128i*)(c + 128), _mm512_cvtepi32_epi8(ev));
      _mm_storeu_si128((__m128i*)(c + 192), _mm512_cvtepi32_epi8(od));
#else
      for (int j = 0; j < 32; ++j) {
        const int at = (j & 1) * 64 + j / 2;
        c[at] = (uint8_t)(q[j] >> 8);
        c[128 + at] = (uint8_t)(q[j] & 255);
        qsum += q[j];
      }
#endif
      *d = amax / 32767.0f;
      s[Bp] = *d * (float)qsum;
    }
  }
}

// Weight rows in fours for one activation row, twos for two, one for more; up to 8 activation rows a pass.
template <int TB>
static void q16_tb(const uint8_t* xb, const float* dx, const float* xs, int K, int Bp, const uint8_t* nib,
                   const uint16_t* sz, const uint8_t* hb, int N, int G, float* y, int n0, int n1) {
  constexpr int RB = KV_ISA == 512 ? (TB == 1 ? 4 : TB == 2 ? 2 : 1) : 1;
  int n = n0;
  for (; n + RB <= n1; n += RB) q16_rows<RB, TB>(xb, dx, xs, K, Bp, nib, sz, hb, G, y, N, n);
  for (; n < n1; ++n) q16_rows<1, TB>(xb, dx, xs, K, Bp, nib, sz, hb, G, y, N, n);
}

static void gemv_int4_q16(const uint8_t* xb, const float* dx, const float* xs, int T, int K, int Bp,
                          const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int N, int G, float* y,
                          int n0, int n1) {
  for (int t = 0; t < T; t += 8) {
    const uint8_t* xt = xb + (size_t)t * q16_plane_bytes(K);
    const float *dt = dx + (size_t)t * Bp, *st = xs + (size_t)t * 2 * Bp;
    float* yt = y + (size_t)t * N;
    switch (imin(8, T - t)) {
      case 8: q16_tb<8>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 7: q16_tb<7>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 6: q16_tb<6>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 5: q16_tb<5>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 4: q16_tb<4>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 3: q16_tb<3>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      case 2: q16_tb<2>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
      default: q16_tb<1>(xt, dt, st, K, Bp, nib, sz, hb, N, G, yt, n0, n1); break;
    }
  }
}

template <int RB>
static void int4_rows(const float* xp, int T, int K, const uint8_t* nib, const uint16_t* sz,
                      const uint8_t* hb, int N, int G, float* y, int n) {
  switch (T) {
    case 1: int4_block<RB, 1>(xp, K, nib, sz, hb, N, G, y, n, 0); break;
    case 2: int4_block<RB, 2>(xp, K, nib, sz, hb, N, G, y, n, 0); break;
    case 3: int4_block<RB, 3>(xp, K, nib, sz, hb, N, G, y, n, 0); break;
    case 4: int4_block<RB, 4>(xp, K, nib, sz, hb, N, G, y, n, 0); break;
    case 5: int4_block<RB, 5>(xp, K, nib, sz, hb, N, G, y, n, 0); break;
    case 6: case 7: case 8:          // half the weight rows a block: the accumulators fit
      for (int h = 0; h < RB; h += (RB + 1) / 2) {
        constexpr int H = (RB + 1) / 2;
        if (T == 6) int4_block<H, 6>(xp, K, nib, sz, hb, N, G, y, n + h, 0);
        else if (T == 7) int4_block<H, 7>(xp, K, nib, sz, hb, N, G, y, n + h, 0);
        else int4_block<H, 8>(xp, K, nib, sz, hb, N, G, y, n + h, 0);
      }
      break;
    default: int4_tile(xp, T, K, nib, sz, hb, N, G, y, n, RB); break;
  }
}

// Activation rows a pass of the tiles takes: each chunk of x stays in L2 while every weight row
// of the thread's range passes over it (a weight is dequantized once per chunk).
constexpr int T_CHUNK = 64;

static void gemv_int4(const float* xp, int T, int K, const uint8_t* nib, const uint16_t* sz,
                      const uint8_t* hb, int N, int G, float* y, int n0, int n1) {
  for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
    const int tn = imin(T_CHUNK, T - t0);
    const float* xt = xp + (size_t)t0 * K;
    float* yt = y + (size_t)t0 * N;
    int n = n0;
    for (; n + KV_RB <= n1; n += KV_RB) int4_rows<KV_RB>(xt, tn, K, nib, sz, hb, N, G, yt, n);
    for (; n < n1; ++n) int4_rows<1>(xt, tn, K, nib, sz, hb, N, G, yt, n);
  }
}

// ---- int8 GEMVs: one scale per row (int8) or per BG weights (blocks: GGUF Q8_0, BG 32; Q6_K's
// sub-blocks, BG 16) ----------------------------------------------------------------------------
// The scales of the 32 / KV_W vectors of 32 weights from column c of a block row `dr` [K / BG].
template <int BG>
static inline void q8_scales(const uint16_t* dr, int c, VF* dv) {
  if constexpr (BG == 32) {
    const VF s = vset(h2f(dr[c / 32]));
    for (int v = 0; v < 32 / KV_W; ++v) dv[v] = s;
  } else {
    for (int v = 0; v < 32 / KV_W; ++v) dv[v] = vset(h2f(dr[(c + v * KV_W) / BG]));
  }
}

template <int RB, int TB, int BG>
static inline void int8_block(const float* x, int K, const int8_t* q, const uint16_t* row_scale,
                              const uint16_t* d, float* y, int N, int n, int t0) {
  constexpr int NV = 32 / KV_W, NA = TB <= 2 ? 2 : 1;
  VF acc[RB][TB][NA];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t)
      for (int a = 0; a < NA; ++a) acc[r][t][a] = vzero();
  for (int c = 0; c < K; c += 32) {
    VF xv[TB][NV];
    for (int t = 0; t < TB; ++t)
      for (int v = 0; v < NV; ++v) xv[t][v] = vload(x + (size_t)(t0 + t) * K + c + v * KV_W);
    for (int r = 0; r < RB; ++r) {
      const int8_t* p = q + (size_t)(n + r) * K + c;
      if (!(c & 63)) ahead(p);
      VF w[NV];
      if constexpr (BG > 0) {
        VF dv[NV];
        q8_scales<BG>(d + (size_t)(n + r) * (K / BG), c, dv);
        for (int v = 0; v < NV; ++v) w[v] = vmul(i8f(p + v * KV_W), dv[v]);
      } else {
        for (int v = 0; v < NV; ++v) w[v] = i8f(p + v * KV_W);
      }
      for (int t = 0; t < TB; ++t)
        for (int v = 0; v < NV; ++v) acc[r][t][v % NA] = vfma(w[v], xv[t][v], acc[r][t][v % NA]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float sc = BG > 0 ? 1.0f : bf16_to_f32(row_scale[n + r]);
    for (int t = 0; t < TB; ++t) {
      VF s = acc[r][t][0];
      for (int a = 1; a < NA; ++a) s = s + acc[r][t][a];
      y[(size_t)(t0 + t) * N + n + r] = vsum(s) * sc;
    }
  }
}

template <int RB, int BG>
static void int8_rows(const float* x, int T, int K, const int8_t* q, const uint16_t* rs,
                      const uint16_t* d, float* y, int N, int n) {
  int t = 0;
  for (; t + 4 <= T; t += 4) int8_block<RB, 4, BG>(x, K, q, rs, d, y, N, n, t);
  switch (T - t) {
    case 3: int8_block<RB, 3, BG>(x, K, q, rs, d, y, N, n, t); break;
    case 2: int8_block<RB, 2, BG>(x, K, q, rs, d, y, N, n, t); break;
    case 1: int8_block<RB, 1, BG>(x, K, q, rs, d, y, N, n, t); break;
    default: break;
  }
}

template <int BG>
static void int8_all(const float* x, int T, int K, const int8_t* q, const uint16_t* rs,
                     const uint16_t* d, int N, float* y, int n0, int n1) {
  int n = n0;
  if (BG > 0 && T > 4) {      // block batches: each weight dequantized once a chunk, then the tile product
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
      const int tn = imin(T_CHUNK, T - t0);
      for (n = n0; n < n1; n += KV_RB) {
        const int rb = imin(KV_RB, n1 - n);
        tile_rows(x + (size_t)t0 * K, tn, K, y + (size_t)t0 * N, N, n, rb, [&](int r, int k0, int kn, float* out) {
          const int8_t* p = q + (size_t)(n + r) * K + k0;
          const uint16_t* dr = d + (size_t)(n + r) * (K / BG);
          for (int c = 0; c < kn; c += 32) {
            if (!(c & 63)) ahead(p + c);
            VF dv[32 / KV_W];
            q8_scales<BG>(dr, k0 + c, dv);
            for (int v = 0; v < 32 / KV_W; ++v) vstore(out + c + v * KV_W, vmul(i8f(p + c + v * KV_W), dv[v]));
          }
        });
      }
    }
    return;
  }
  for (; n + KV_RB <= n1; n += KV_RB) int8_rows<KV_RB, BG>(x, T, K, q, rs, d, y, N, n);
  for (; n < n1; ++n) int8_rows<1, BG>(x, T, K, q, rs, d, y, N, n);
}

static void gemv_int8(const float* x, int T, int K, const int8_t* q, const uint16_t* scale, int N,
                      float* y, int n0, int n1) {
  int8_all<0>(x, T, K, q, scale, nullptr, N, y, n0, n1);
}

static void gemv_q8_0(const float* x, int T, int K, const int8_t* q, const uint16_t* d, int G, int N,
                      float* y, int n0, int n1) {
  if (G == 16)
    int8_all<16>(x, T, K, q, nullptr, d, N, y, n0, n1);
  else
    int8_all<32>(x, T, K, q, nullptr, d, N, y, n0, n1);
}

// ---- Q8_0 on integer dot products (few activation rows) ----------------------------------
// x quantized per 32 weights to int16 (xq = round(x / dx), dx = max |x| / 32767: about 2^-16 of
// the block's largest, as the int4 route's activations; llama.cpp's vec_dot_q8_0_q8_0 takes x in
// int8, 2^-8, which changes the default model's answers), each block's sum(q * xq) exact in int32,
// then y[n] += d[n, b] * dx[b] * sum(q * xq).
//   AVX-512 VNNI: x as its two bytes, xq = 256 xh + xl (xh signed, xl unsigned); vpdpbusd takes
//     unsigned x signed bytes, so sum(q * xq) = 256 (sum((q + 128) * xh) - 128 sum(xh)) +
//     sum(xl * q): (q ^ 0x80) = q + 128 unsigned, and xc [T, K/4] = -128 sum(xh) per four bytes
//     is the accumulator the first vpdpbusd starts from (every partial sum fits int32). 64 bytes:
//     two blocks, lanes 0-7 and 8-15.
//   AVX2: each weight widened to int16, vpmaddwd per 16. The portable code: int32 sums.
// Every partial sum is exact, so each ISA computes the same integers; only the float sums differ.
// BG 16 (Q6_K's sub-blocks, d [N, K/16]): each half block's sum times its own d (AVX-512: lanes
// 0-3 / 4-7 of a block's eight), x's blocks still of 32.
template <int RB, int TB, int BG>
static inline void q8_q16_rows(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc,
                               const float* dx, int K, const int8_t* q, const uint16_t* d, float* y, int N, int n) {
  const int nb = K / 32;
  constexpr int SUB = 32 / BG, WIN = 16 / SUB;      // scales a block of 32; blocks a window of 16 scales
  alignas(64) float s16[RB][TB][16];
#if KV_ISA == 512
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
#elif KV_ISA == 256
  __m256 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
#else
  float acc[RB][TB] = {};
#endif
  for (int b0 = 0; b0 < nb; b0 += WIN) {
    const int bn = imin(WIN, nb - b0);
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) {
        const uint16_t* dr = d + (size_t)(n + r) * nb * SUB + b0 * SUB;
        const float* dt = dx + (size_t)t * nb + b0;
#if KV_ISA == 512
        const __mmask16 m = (__mmask16)((1u << (bn * SUB)) - 1);
        __m512 xs = _mm512_maskz_loadu_ps((__mmask16)((1u << bn) - 1), dt);
        if (SUB == 2) xs = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), xs);
        _mm512_store_ps(s16[r][t], _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, dr)), xs));
#else
        for (int i = 0; i < 16; ++i) s16[r][t][i] = i < bn * SUB ? h2f(dr[i]) * dt[i / SUB] : 0.0f;
#endif
      }
    for (int p = 0; p < bn; ++p) {
      const size_t off = (size_t)(b0 + p) * 32;
#if KV_ISA == 512
      // two blocks a zmm, x as its two bytes: xq = 256 xh + xl (xh signed, xl unsigned), so
      // sum(q * xq) = 256 (sum((q + 128) * xh) - 128 sum(xh)) + sum(xl * q): two vpdpbusd
      if (p & 1) continue;
      const __mmask64 m = p + 1 < bn ? ~0ull : 0xFFFFFFFFull;
      const __mmask16 m4 = p + 1 < bn ? (__mmask16)0xFFFF : (__mmask16)0xFF;
      __m512i lv[TB], hv[TB], cv[TB];
      for (int t = 0; t < TB; ++t) {
        lv[t] = _mm512_maskz_loadu_epi8(m, xl + (size_t)t * K + off);
        hv[t] = _mm512_maskz_loadu_epi8(m, xh + (size_t)t * K + off);
        cv[t] = _mm512_maskz_loadu_epi32(m4, xc + ((size_t)t * K + off) / 4);
      }
      const int j = p * SUB;                // the first scale of blocks p, p + 1
      const __m512i idx = SUB == 1 ? _mm512_setr_epi32(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1)
                                   : _mm512_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 2, j + 2, j + 2, j + 2, j + 3, j + 3, j + 3, j + 3);
      for (int r = 0; r < RB; ++r) {
        ahead(q + (size_t)(n + r) * K + off);
        const __m512i w = _mm512_maskz_loadu_epi8(m, q + (size_t)(n + r) * K + off);
        const __m512i wu = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        for (int t = 0; t < TB; ++t) {
          const __m512i hi = _mm512_slli_epi32(_mm512_dpbusd_epi32(cv[t], wu, hv[t]), 8);
          const __m512i s = _mm512_dpbusd_epi32(hi, lv[t], w);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(idx, _mm512_load_ps(s16[r][t])), acc[r][t]);
        }
      }
#elif KV_ISA == 256
      __m256i xv[TB][2];
      for (int t = 0; t < TB; ++t)
        for (int h = 0; h < 2; ++h) xv[t][h] = _mm256_loadu_si256((const __m256i*)(xq + (size_t)t * K + off + 16 * h));
      for (int r = 0; r < RB; ++r) {
        const int8_t* wr = q + (size_t)(n + r) * K + off;
        if (!(p & 1)) ahead(wr);
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wr));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wr + 16)));
        for (int t = 0; t < TB; ++t) {
          if (SUB == 1) {
            const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, xv[t][0]), _mm256_madd_epi16(hi, xv[t][1]));
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&s16[r][t][p]), acc[r][t]);
          } else {
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(lo, xv[t][0])),
                                        _mm256_broadcast_ss(&s16[r][t][2 * p]), acc[r][t]);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(hi, xv[t][1])),
                                        _mm256_broadcast_ss(&s16[r][t][2 * p + 1]), acc[r][t]);
          }
        }
      }
#else
      for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t) {
          const int8_t* w = q + (size_t)(n + r) * K + off;
          const int16_t* xb = xq + (size_t)t * K + off;
          for (int h = 0; h < SUB; ++h) {
            int32_t dot = 0;
            for (int j = h * BG; j < (h + 1) * BG; ++j) dot += (int32_t)w[j] * xb[j];
            acc[r][t] += (float)dot * s16[r][t][p * SUB + h];
          }
        }
#endif
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
#if KV_ISA == 512
      y[(size_t)t * N + n + r] = _mm512_reduce_add_ps(acc[r][t]);
#elif KV_ISA == 256
      y[(size_t)t * N + n + r] = vsum(acc[r][t]);
#else
      y[(size_t)t * N + n + r] = acc[r][t];
#endif
    }
}

// x [T, K] -> the activations gemv_q8_0_q16 reads: per 32 weights xq = round(x / dx) (nearest even),
// dx = max |x| / 32767, in order [T, K], dx [T, K / 32]; on AVX-512 also xq's two bytes as planes,
// xq = 256 xh + xl (xh int8, xl uint8), and xc [T, K / 4] = -128 * the sum of each four xh (the
// other ISAs read xq alone).
static void quantize_q8(const float* x, int T, int K, int16_t* xq, uint8_t* xl, int8_t* xh, int32_t* xc, float* dx) {
  for (int t = 0; t < T; ++t)
    for (int b = 0; b < K / 32; ++b) {
      const size_t o = (size_t)t * K + (size_t)b * 32;
      alignas(64) int32_t q[32];
      dx[(size_t)t * (K / 32) + b] = q16_block(x + o, q, nullptr) / 32767.0f;
#if KV_ISA == 512
      const __m512i qa = _mm512_load_si512((const void*)q), qe = _mm512_load_si512((const void*)(q + 16));
      _mm256_storeu_si256((__m256i*)(xq + o), _mm512_cvtepi32_epi16(qa));
      _mm256_storeu_si256((__m256i*)(xq + o + 16), _mm512_cvtepi32_epi16(qe));
      _mm_storeu_si128((__m128i*)(xl + o), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(xl + o + 16), _mm512_cvtepi32_epi8(qe));
      const __m128i ha = _mm512_cvtepi32_epi8(_mm512_srai_epi32(qa, 8)), he = _mm512_cvtepi32_epi8(_mm512_srai_epi32(qe, 8));
      _mm_storeu_si128((__m128i*)(xh + o), ha);
      _mm_storeu_si128((__m128i*)(xh + o + 16), he);
      // each four xh summed (unsigned ones times signed bytes), times -128
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), _mm256_set_m128i(he, ha));
      _mm256_storeu_si256((__m256i*)(xc + o / 4), _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), sums), 7));
#else
      for (int j = 0; j < 32; ++j) xq[o + j] = (int16_t)q[j];
      (void)xl; (void)xh; (void)xc;
#endif
    }
}

template <int RB, int BG>
static void q8_q16_tb(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                      int T, int K, const int8_t* q, const uint16_t* d, float* y, int N, int n) {
  switch (T) {
    case 3: q8_q16_rows<RB, 3, BG>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
    case 2: q8_q16_rows<RB, 2, BG>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
    default: q8_q16_rows<RB, 1, BG>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
  }
}

template <int BG>
static void q8_q16_all(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                       int T, int K, const int8_t* q, const uint16_t* d, int N, float* y, int n0, int n1) {
  for (int t = 0; t < T; t += 3) {
    const int tn = imin(3, T - t);
    const size_t o = (size_t)t * K;
    int n = n0;
    for (; n + KV_RB <= n1; n += KV_RB)
      q8_q16_tb<KV_RB, BG>(xq + o, xl + o, xh + o, xc + o / 4, dx + o / 32, tn, K, q, d, y + (size_t)t * N, N, n);
    for (; n < n1; ++n) q8_q16_tb<1, BG>(xq + o, xl + o, xh + o, xc + o / 4, dx + o / 32, tn, K, q, d, y + (size_t)t * N, N, n);
  }
}

static void gemv_q8_0_q16(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                          int T, int K, const int8_t* q, const uint16_t* d, int G, int N, float* y, int n0, int n1) {
  if (G == 16)
    q8_q16_all<16>(xq, xl, xh, xc, dx, T, K, q, d, N, y, n0, n1);
  else
    q8_q16_all<32>(xq, xl, xh, xc, dx, T, K, q, d, N, y, n0, n1);
}

// ---- dequantization: rows of a weight into a dense float32 or bfloat16 matrix --------------
// (bigger steps than the kernels take: prefill chunks, mixed steps; the dense GEMM follows.)
// Each weight is its exact value ((q - 8) * s + zero, q * d) rounded once to float32, then to
// bfloat16 (common.h f32_to_bf16) when asked.

// int4 rows n0..n1 (nibbles [N, K/2], scales [N, 2, K/G], fifth bits hb [N, K/8] or null) ->
// out rows [n1 - n0, K] (f or b).
static void dequant_int4(const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int K, int G, int n0, int n1,
                         float* f, uint16_t* b) {
  const int groups = K / G;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = nib + (size_t)n * (K / 2);
    const uint16_t* srow = sz + (size_t)n * 2 * groups;
    const size_t o = (size_t)(n - n0) * K;
    for (int c = 0; c < K; c += 32) {
      VF w[32 / KV_W];
      uint32_t bits = 0;
      if (hb) __builtin_memcpy(&bits, hb + (size_t)n * (K / 8) + c / 8, 4);
      deq32(row + c / 2, bits, vset(bf16_to_f32(srow[c / G])), vset(bf16_to_f32(srow[groups + c / G])), w);
      for (int v = 0; v < 32 / KV_W; ++v) {
        if (f)
          vstore(f + o + c + v * KV_W, w[v]);
        else
          vstore_bf16(b + o + c + v * KV_W, w[v]);
      }
    }
  }
}

// Q8_0 rows n0..n1 (q [N, K] int8, d [N, K/G] float16, G 32 or 16) -> out rows [n1 - n0, K] (f or b).
static void dequant_q8_0(const int8_t* q, const uint16_t* d, int K, int G, int n0, int n1, float* f, uint16_t* b) {
  for (int n = n0; n < n1; ++n) {
    const size_t o = (size_t)(n - n0) * K;
    for (int c = 0; c < K; c += 32) {
      VF s[32 / KV_W];
      if (G == 16)
        q8_scales<16>(d + (size_t)n * (K / 16), c, s);
      else
        q8_scales<32>(d + (size_t)n * (K / 32), c, s);
      const int8_t* p = q + (size_t)n * K + c;
      for (int v = 0; v < 32 / KV_W; ++v) {
        const VF w = vmul(i8f(p + v * KV_W), s[v]);     // exact: 8 bits times float16's 11
        if (f)
          vstore(f + o + c + v * KV_W, w);
        else
          vstore_bf16(b + o + c + v * KV_W, w);
      }
    }
  }
}
