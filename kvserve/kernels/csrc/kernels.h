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
// sizes), each block's sum of q * xq exact in int32 (VNNI vpdpwssd / AVX2 vpmaddwd), then
//   y[n] += s[n, b] * dx[b] * (sum(q * xq) - 8 sum(xq)) + zero[n, b] * sum(x)
// xq layout per pair of blocks (b, b+1): their 16 even weights each, then their 16 odd ones.
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

// hb: the fifth bits (null for int4): q = nibble + 16 bit, 0..31, added to the words before the
// products (the - 8 sum(xq) term is the same).
template <int TB>
static inline void q16_row(const int16_t* xq, const float* dx, const float* xs, int K, int Bp,
                           const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int G, float* y, int N, int n) {
  const int nb = K / 32;
  const uint8_t* w = nib + (size_t)n * (K / 2);
  const uint8_t* h = hb ? hb + (size_t)n * (K / 8) : nullptr;
  const uint16_t* srow = sz + (size_t)n * 2 * (K / G);
  float acc[TB], s16[16], z16[16];
  for (int t = 0; t < TB; ++t) acc[t] = 0.0f;
#if KV_ISA == 512
  __m512 facc[TB];
  for (int t = 0; t < TB; ++t) facc[t] = _mm512_setzero_ps();
  const __m512i m4w = _mm512_set1_epi16(15);
#elif KV_ISA == 256
  __m256 facc[TB];
  for (int t = 0; t < TB; ++t) facc[t] = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(15);
#endif
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int bn = imin(16, nb - b0);
    block_scales16(srow, K, G, b0, bn, s16, z16);
#if KV_ISA == 512
    const __m512 s8 = _mm512_mul_ps(_mm512_set1_ps(-8.0f), _mm512_loadu_ps(s16)), zv = _mm512_loadu_ps(z16);
    __m512 sv[TB];
    for (int t = 0; t < TB; ++t) {
      const float* st = xs + (size_t)t * 2 * Bp + b0;
      facc[t] = _mm512_fmadd_ps(zv, _mm512_loadu_ps(st), _mm512_fmadd_ps(s8, _mm512_loadu_ps(st + Bp), facc[t]));
      sv[t] = _mm512_mul_ps(_mm512_loadu_ps(s16), _mm512_loadu_ps(dx + (size_t)t * Bp + b0));
    }
    for (int p = 0; p < bn; p += 2) {           // two blocks: 64 weights, 32 in each zmm
      if (!(p & 2)) ahead(w + (size_t)(b0 + p) * 16);
      __m256i bytes = _mm256_loadu_si256((const __m256i*)(w + (size_t)(b0 + p) * 16));
      const __m512i wb = _mm512_cvtepu8_epi16(bytes);          // a word per byte: lo | hi << 4
      __m512i lo = _mm512_and_si512(wb, m4w);                  // evens of b, b+1
      __m512i hi = _mm512_srli_epi16(wb, 4);                   // odds (the word's bits 4..7)
      if (h) {                                                 // bits 0-15 of a block: its evens, 16-31: odds
        uint32_t b2[2];
        __builtin_memcpy(b2, h + (size_t)(b0 + p) * 4, 8);
        const __m512i v16 = _mm512_set1_epi16(16);
        lo = _mm512_mask_add_epi16(lo, (__mmask32)((b2[0] & 0xFFFF) | (b2[1] << 16)), lo, v16);
        hi = _mm512_mask_add_epi16(hi, (__mmask32)((b2[0] >> 16) | (b2[1] & 0xFFFF0000u)), hi, v16);
      }
      const __m512i idx = _mm512_setr_epi32(p, p, p, p, p, p, p, p, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1);
      for (int t = 0; t < TB; ++t) {
        const int16_t* xp = xq + (size_t)t * K + (size_t)(b0 + p) * 32;
        __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void*)xp));
        d = _mm512_dpwssd_epi32(d, hi, _mm512_loadu_si512((const void*)(xp + 32)));
        facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, sv[t]), facc[t]);
      }
    }
#elif KV_ISA == 256
    __m256 sv[TB][2];
    for (int h = 0; h < 2; ++h) {
      const __m256 s8 = _mm256_mul_ps(_mm256_set1_ps(-8.0f), _mm256_loadu_ps(s16 + 8 * h)), zv = _mm256_loadu_ps(z16 + 8 * h);
      for (int t = 0; t < TB; ++t) {
        const float* st = xs + (size_t)t * 2 * Bp + b0 + 8 * h;
        facc[t] = _mm256_fmadd_ps(zv, _mm256_loadu_ps(st), _mm256_fmadd_ps(s8, _mm256_loadu_ps(st + Bp), facc[t]));
        sv[t][h] = _mm256_mul_ps(_mm256_loadu_ps(s16 + 8 * h), _mm256_loadu_ps(dx + (size_t)t * Bp + b0 + 8 * h));
      }
    }
    for (int p = 0; p < bn; ++p) {              // one block: 32 weights, 16 in each ymm
      if (!(p & 3)) ahead(w + (size_t)(b0 + p) * 16);
      __m128i bytes = _mm_loadu_si128((const __m128i*)(w + (size_t)(b0 + p) * 16));
      __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, m4));
      __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4));
      if (h) {                                                 // 16 bits each as 16 word masks
        uint32_t bits;
        __builtin_memcpy(&bits, h + (size_t)(b0 + p) * 4, 4);
        const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                              16384, (short)-32768);
        const __m256i be = _mm256_and_si256(_mm256_set1_epi16((short)(bits & 0xFFFF)), sel);
        const __m256i bo = _mm256_and_si256(_mm256_set1_epi16((short)(bits >> 16)), sel);
        lo = _mm256_add_epi16(lo, _mm256_and_si256(_mm256_cmpeq_epi16(be, sel), _mm256_set1_epi16(16)));
        hi = _mm256_add_epi16(hi, _mm256_and_si256(_mm256_cmpeq_epi16(bo, sel), _mm256_set1_epi16(16)));
      }
      const __m256i idx = _mm256_set1_epi32(p & 7);
      const size_t off = (size_t)(b0 + (p & ~1)) * 32 + (p & 1) * 16;   // within the pair layout
      for (int t = 0; t < TB; ++t) {
        const int16_t* xp = xq + (size_t)t * K + off;
        __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xp)),
                                     _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xp + 32))));
        facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(sv[t][p >> 3], idx), facc[t]);
      }
    }
#else
    for (int t = 0; t < TB; ++t)
      for (int i = 0; i < 16; ++i)
        acc[t] += z16[i] * xs[(size_t)t * 2 * Bp + b0 + i] - 8.0f * s16[i] * xs[(size_t)t * 2 * Bp + Bp + b0 + i];
    for (int p = 0; p < bn; ++p) {
      const uint8_t* bw = w + (size_t)(b0 + p) * 16;
      const size_t off = (size_t)(b0 + (p & ~1)) * 32 + (p & 1) * 16;
      for (int t = 0; t < TB; ++t) {
        const int16_t* xb = xq + (size_t)t * K + off;
        int32_t d = 0;
        uint32_t bits = 0;
        if (h) __builtin_memcpy(&bits, h + (size_t)(b0 + p) * 4, 4);
        for (int j = 0; j < 16; ++j)
          d += ((bw[j] & 15) + 16 * (int)((bits >> j) & 1)) * xb[j] + ((bw[j] >> 4) + 16 * (int)((bits >> (16 + j)) & 1)) * xb[32 + j];
        acc[t] += (float)d * s16[p] * dx[(size_t)t * Bp + b0 + p];
      }
    }
#endif
  }
  for (int t = 0; t < TB; ++t) {
#if KV_ISA == 512
    acc[t] += _mm512_reduce_add_ps(facc[t]);
#elif KV_ISA == 256
    acc[t] += vsum(facc[t]);
#endif
    y[(size_t)t * N + n] = acc[t];
  }
}

static void gemv_int4_q16(const int16_t* xq, const float* dx, const float* xs, int T, int K, int Bp,
                         const uint8_t* nib, const uint16_t* sz, const uint8_t* hb, int N, int G, float* y,
                         int n0, int n1) {
  for (int n = n0; n < n1; ++n)
    for (int t = 0; t < T; t += 4) {
      const int16_t* xt = xq + (size_t)t * K;
      const float *dt = dx + (size_t)t * Bp, *st = xs + (size_t)t * 2 * Bp;
      float* yt = y + (size_t)t * N;
      switch (imin(4, T - t)) {
        case 4: q16_row<4>(xt, dt, st, K, Bp, nib, sz, hb, G, yt, N, n); break;
        case 3: q16_row<3>(xt, dt, st, K, Bp, nib, sz, hb, G, yt, N, n); break;
        case 2: q16_row<2>(xt, dt, st, K, Bp, nib, sz, hb, G, yt, N, n); break;
        default: q16_row<1>(xt, dt, st, K, Bp, nib, sz, hb, G, yt, N, n); break;
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

// ---- int8 GEMVs: one scale per row (int8) or per 32 weights (GGUF Q8_0) -----------------
template <int RB, int TB, bool BLOCKS>
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
      if (BLOCKS) {
        VF dv = vset(h2f(d[(size_t)(n + r) * (K / 32) + c / 32]));
        for (int v = 0; v < NV; ++v) w[v] = vmul(i8f(p + v * KV_W), dv);
      } else {
        for (int v = 0; v < NV; ++v) w[v] = i8f(p + v * KV_W);
      }
      for (int t = 0; t < TB; ++t)
        for (int v = 0; v < NV; ++v) acc[r][t][v % NA] = vfma(w[v], xv[t][v], acc[r][t][v % NA]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float sc = BLOCKS ? 1.0f : bf16_to_f32(row_scale[n + r]);
    for (int t = 0; t < TB; ++t) {
      VF s = acc[r][t][0];
      for (int a = 1; a < NA; ++a) s = s + acc[r][t][a];
      y[(size_t)(t0 + t) * N + n + r] = vsum(s) * sc;
    }
  }
}

template <int RB, bool BLOCKS>
static void int8_rows(const float* x, int T, int K, const int8_t* q, const uint16_t* rs,
                      const uint16_t* d, float* y, int N, int n) {
  int t = 0;
  for (; t + 4 <= T; t += 4) int8_block<RB, 4, BLOCKS>(x, K, q, rs, d, y, N, n, t);
  switch (T - t) {
    case 3: int8_block<RB, 3, BLOCKS>(x, K, q, rs, d, y, N, n, t); break;
    case 2: int8_block<RB, 2, BLOCKS>(x, K, q, rs, d, y, N, n, t); break;
    case 1: int8_block<RB, 1, BLOCKS>(x, K, q, rs, d, y, N, n, t); break;
    default: break;
  }
}

template <bool BLOCKS>
static void int8_all(const float* x, int T, int K, const int8_t* q, const uint16_t* rs,
                     const uint16_t* d, int N, float* y, int n0, int n1) {
  int n = n0;
  if (BLOCKS && T > 4) {      // Q8_0 batches: each weight dequantized once a chunk, then the tile product
    for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
      const int tn = imin(T_CHUNK, T - t0);
      for (n = n0; n < n1; n += KV_RB) {
        const int rb = imin(KV_RB, n1 - n);
        tile_rows(x + (size_t)t0 * K, tn, K, y + (size_t)t0 * N, N, n, rb, [&](int r, int k0, int kn, float* out) {
          const int8_t* p = q + (size_t)(n + r) * K + k0;
          const uint16_t* dr = d + (size_t)(n + r) * (K / 32) + k0 / 32;
          for (int c = 0; c < kn; c += 32) {
            if (!(c & 63)) ahead(p + c);
            const VF dv = vset(h2f(dr[c / 32]));
            for (int v = 0; v < 32 / KV_W; ++v) vstore(out + c + v * KV_W, vmul(i8f(p + c + v * KV_W), dv));
          }
        });
      }
    }
    return;
  }
  for (; n + KV_RB <= n1; n += KV_RB) int8_rows<KV_RB, BLOCKS>(x, T, K, q, rs, d, y, N, n);
  for (; n < n1; ++n) int8_rows<1, BLOCKS>(x, T, K, q, rs, d, y, N, n);
}

static void gemv_int8(const float* x, int T, int K, const int8_t* q, const uint16_t* scale, int N,
                      float* y, int n0, int n1) {
  int8_all<false>(x, T, K, q, scale, nullptr, N, y, n0, n1);
}

static void gemv_q8_0(const float* x, int T, int K, const int8_t* q, const uint16_t* d, int N,
                      float* y, int n0, int n1) {
  int8_all<true>(x, T, K, q, nullptr, d, N, y, n0, n1);
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
template <int RB, int TB>
static inline void q8_q16_rows(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc,
                               const float* dx, int K, const int8_t* q, const uint16_t* d, float* y, int N, int n) {
  const int nb = K / 32;
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
  for (int b0 = 0; b0 < nb; b0 += 16) {
    const int bn = imin(16, nb - b0);
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) {
        const uint16_t* dr = d + (size_t)(n + r) * nb + b0;
        const float* dt = dx + (size_t)t * nb + b0;
#if KV_ISA == 512
        const __mmask16 m = (__mmask16)((1u << bn) - 1);
        _mm512_store_ps(s16[r][t], _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, dr)), _mm512_maskz_loadu_ps(m, dt)));
#else
        for (int i = 0; i < 16; ++i) s16[r][t][i] = i < bn ? h2f(dr[i]) * dt[i] : 0.0f;
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
      const __m512i idx = _mm512_setr_epi32(p, p, p, p, p, p, p, p, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1);
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
          const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, xv[t][0]), _mm256_madd_epi16(hi, xv[t][1]));
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&s16[r][t][p]), acc[r][t]);
        }
      }
#else
      for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t) {
          const int8_t* w = q + (size_t)(n + r) * K + off;
          const int16_t* xb = xq + (size_t)t * K + off;
          int32_t dot = 0;
          for (int j = 0; j < 32; ++j) dot += (int32_t)w[j] * xb[j];
          acc[r][t] += (float)dot * s16[r][t][p];
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

template <int RB>
static void q8_q16_tb(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                      int T, int K, const int8_t* q, const uint16_t* d, float* y, int N, int n) {
  switch (T) {
    case 3: q8_q16_rows<RB, 3>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
    case 2: q8_q16_rows<RB, 2>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
    default: q8_q16_rows<RB, 1>(xq, xl, xh, xc, dx, K, q, d, y, N, n); break;
  }
}

static void gemv_q8_0_q16(const int16_t* xq, const uint8_t* xl, const int8_t* xh, const int32_t* xc, const float* dx,
                          int T, int K, const int8_t* q, const uint16_t* d, int N, float* y, int n0, int n1) {
  for (int t = 0; t < T; t += 3) {
    const int tn = imin(3, T - t);
    const size_t o = (size_t)t * K;
    int n = n0;
    for (; n + KV_RB <= n1; n += KV_RB)
      q8_q16_tb<KV_RB>(xq + o, xl + o, xh + o, xc + o / 4, dx + o / 32, tn, K, q, d, y + (size_t)t * N, N, n);
    for (; n < n1; ++n) q8_q16_tb<1>(xq + o, xl + o, xh + o, xc + o / 4, dx + o / 32, tn, K, q, d, y + (size_t)t * N, N, n);
  }
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

// Q8_0 rows n0..n1 (q [N, K] int8, d [N, K/32] float16) -> out rows [n1 - n0, K] (f or b).
static void dequant_q8_0(const int8_t* q, const uint16_t* d, int K, int n0, int n1, float* f, uint16_t* b) {
  for (int n = n0; n < n1; ++n) {
    const size_t o = (size_t)(n - n0) * K;
    for (int c = 0; c < K; c += 32) {
      const VF s = vset(h2f(d[(size_t)n * (K / 32) + c / 32]));
      const int8_t* p = q + (size_t)n * K + c;
      for (int v = 0; v < 32 / KV_W; ++v) {
        const VF w = vmul(i8f(p + v * KV_W), s);        // exact: 8 bits times float16's 11
        if (f)
          vstore(f + o + c + v * KV_W, w);
        else
          vstore_bf16(b + o + c + v * KV_W, w);
      }
    }
  }
}
