// Batched GEMMs on Intel AMX (AMX-BF16 tiles; Sapphire Rapids and later): y = x @ W.T for a step
// of a few or more activation rows, W in any of kvserve's formats (ops.h Format: int4, int8, Q8_0,
// or a dense bfloat16 matrix). Per 32 weight rows: the rows dequantized, 32 weights at a time, to
// bfloat16 (each weight's exact value rounded once to float32, then to bfloat16 -- what
// dequantize_int4 / dequantize_q8_0 give) into a slab that stays in L1/L2 (rows of up to 2,048
// columns once for a block of x, wider ones 512 columns at a time for every 32 activation rows);
// then per 32 columns two tiles of weights (A: 16 rows x 32 bfloat16) against two tiles of x (B:
// 32 columns x 16 activation rows, in the VNNI pair layout ops.cpp packs) into four float32
// accumulator tiles (C: 16 weight rows x 16 activation rows each). A dense bfloat16 weight's
// tiles are loaded from the matrix itself. One tdpbf16ps is 8,192 multiply-adds, so a step of a
// few rows costs what its weights take to dequantize, not what it multiplies. x is taken in
// blocks that stay in L2 (XB_BYTES), each passed over by every weight row of a thread's range:
// a 2,048-row prefill chunk's packed x (2.4 MB at 576 columns) read once per 16 weight rows from
// L3 had made an int4 3072 x 576 GEMM of 2,048 rows 1.5x slower (5.9 against 4.0 ms).
#include <algorithm>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

namespace kvk {

bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tiles = (d >> 24) & 1, bf16_tiles = (d >> 22) & 1, avx512bw = (b >> 30) & 1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    const bool avx512bf16 = (a >> 5) & 1;
    if (!(tiles && bf16_tiles && avx512bw && avx512bf16)) return false;
    // Linux hands out the 8 KB tile state only to a process that asks (ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA); without it the first tile instruction faults.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ready;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16,fma,f16c")

namespace isa_amx {

constexpr int PAIR = 32;         // weight rows a step of the GEMM covers: two A tiles
constexpr int WHOLE = 2048;      // rows of at most WHOLE columns are dequantized once per block of x
constexpr int SLAB = 512;        // wider ones SLAB columns at a time for every 32 activation rows (32 KB)
constexpr int XB_BYTES = 1 << 20;       // the packed activation rows a block of x holds (half of L2)
constexpr int AHEAD = 4096;      // bytes of a weight row prefetched ahead (vec.h's KV_AHEAD: the same reason)

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static inline __m512i bf16x32(__m512 lo, __m512 hi) {   // 32 floats -> 32 bfloat16 (nearest even), lo first
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// A 16 x 16 matrix of 32-bit elements, one row a register, transposed in place (unpacks, then
// in-lane and cross-lane shuffles: 64 instructions for 256 elements).
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {                 // t[2i] lane L: r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int m = 0; m < 4; ++m) {                 // r[4m + c] lane L: rows 4m..4m+3 at column 4L + c
    r[4 * m] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
    r[4 * m + 1] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
    r[4 * m + 2] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
    r[4 * m + 3] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {                 // column 4L + c gathers lane L of r[c], r[4+c], r[8+c], r[12+c]
    const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    t[4 + c] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Row n's columns k0..k0+kn (multiples of 32) as bfloat16 into out[kn].
static void dequant_row(const AmxWeight& w, int n, int k0, int kn, uint16_t* out) {
  const int K = w.K;
  if (w.format == 1) {                      // int4: (q - 8) * scale + zero per group, nibbles 2j | 2j+1 << 4
    const int groups = K / w.G;
    const uint8_t* nib = (const uint8_t*)w.a + (size_t)n * (K / 2);
    const uint16_t* srow = (const uint16_t*)w.b + (size_t)n * 2 * groups;
    const uint8_t* hb = w.c ? (const uint8_t*)w.c + (size_t)n * (K / 8) : nullptr;
    const __m512 iota = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i m4 = _mm512_set1_epi32(15), m4h = _mm512_set1_epi32(0xF0);
    for (int c = 0; c < kn; c += 32) {
      if (!(c & 127)) __builtin_prefetch(nib + (k0 + c) / 2 + AHEAD, 0, 3);
      const int g = (k0 + c) / w.G;
      // the group's 16 values as a bfloat16 table, each weight looked up by its nibble (vpermw)
      const __m512 sv = _mm512_set1_ps(bf16_to_f32(srow[g])), zv = _mm512_set1_ps(bf16_to_f32(srow[groups + g]));
      const __m512 vals = _mm512_fmadd_ps(iota, sv, zv);
      __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(vals));
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(nib + (k0 + c) / 2)));
      // 16-bit lanes in weight order: lane 2j the low nibble of byte j, lane 2j+1 its high nibble
      __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, m4), _mm512_slli_epi32(_mm512_and_si512(bytes, m4h), 12));
      if (hb) {     // a fifth bit: the table's values 16..31 above; bit j (< 16) is 32-bit lane j's
                    // low word (weight 2j), bit 16 + j its high word (weight 2j + 1)
        const __m512 vals16 = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), sv, zv);
        table = (__m512i)_mm512_cvtne2ps_pbh(vals16, vals);
        uint32_t bits;
        __builtin_memcpy(&bits, hb + (k0 + c) / 8, 4);
        idx = _mm512_mask_add_epi32(idx, (__mmask16)(bits & 0xFFFF), idx, _mm512_set1_epi32(16));
        idx = _mm512_mask_add_epi32(idx, (__mmask16)(bits >> 16), idx, _mm512_set1_epi32(16 << 16));
      }
      _mm512_storeu_si512((void*)(out + c), _mm512_permutexvar_epi16(idx, table));
    }
  } else if (w.format == 2 || w.format == 3) {   // int8: q * scale[n]; Q8_0: q * d[n, k / G] (G 32 or 16)
    const int8_t* q = (const int8_t*)w.a + (size_t)n * K;
    const uint16_t* d = (const uint16_t*)w.b + (w.format == 3 ? (size_t)n * (K / w.G) : 0);
    for (int c = 0; c < kn; c += 32) {
      if (!(c & 63)) __builtin_prefetch(q + k0 + c + AHEAD, 0, 3);
      const float s = w.format == 2 ? bf16_to_f32(((const uint16_t*)w.b)[n]) : _cvtsh_ss(d[(k0 + c) / w.G]);
      const float s2 = w.format == 3 && w.G == 16 ? _cvtsh_ss(d[(k0 + c) / 16 + 1]) : s;
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k0 + c)))), _mm512_set1_ps(s));
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k0 + c + 16)))), _mm512_set1_ps(s2));
      _mm512_storeu_si512((void*)(out + c), bf16x32(lo, hi));
    }
  } else {                                   // dense bfloat16
    const uint16_t* r = (const uint16_t*)w.a + (size_t)n * K + k0;
    for (int c = 0; c < kn; c += 32) {
      __builtin_prefetch(r + c + AHEAD / 2, 0, 3);
      _mm512_storeu_si512((void*)(out + c), _mm512_loadu_si512((const void*)(r + c)));
    }
  }
}

// Weight rows n0..n0+rn (rn <= PAIR), columns k0..k0+kn, dequantized into `slab` (row stride ld),
// the rows past rn up to PAIR zero.
static void fill_slab(const AmxWeight& w, int n0, int rn, int k0, int kn, uint16_t* slab, int ld) {
  for (int r = 0; r < rn; ++r) dequant_row(w, n0 + r, k0, kn, slab + (size_t)r * ld);
  for (int r = rn; r < PAIR; ++r)
    for (int c = 0; c < kn; c += 32) _mm512_storeu_si512((void*)(slab + (size_t)r * ld + c), _mm512_setzero_si512());
}

// y rows t0..t0+16G (at most T), columns n0..n0+rn (two blocks of 16 weight rows): C tile 2g + b
// += A_b (block b: 16 weight rows x 32 columns) x B_g (activation group g: 32 columns x 16 rows)
// over K, then stored. Each A and each B tile is loaded once for two multiplies (oneDNN's 2 x 2
// blocking; one A against four B tiles, as before, loaded 1.25 tiles a multiply). A is read from `a` (row
// stride lda: the matrix itself for a dense bfloat16 pair of whole blocks, or the slab the caller
// filled once), or, when `fill`, from `slab` filled here SLAB columns at a time. Tile ids are
// immediates.
template <int G>
static void chunk(const uint16_t* xb, int T, int t0, const AmxWeight& w, int n0, int rn,
                  const uint16_t* a, int lda, bool fill, uint16_t* slab, float* cbuf, float* y) {
  const int K = w.K;
  const int width = fill ? SLAB : K;                 // columns a pass over A covers
  if (fill) lda = SLAB;
  const uint16_t* xg = xb + (size_t)(t0 / 16) * (K / 2) * 32;
  _tile_zero(0);
  _tile_zero(1);
  if (G > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int k0 = 0; k0 < K; k0 += width) {
    const int kn = K - k0 < width ? K - k0 : width;
    if (fill) fill_slab(w, n0, rn, k0, kn, slab, SLAB);
    const uint16_t* a0 = fill ? slab : a + k0;
    const uint16_t* a1 = a0 + (size_t)16 * lda;
    const uint16_t* bx = xg + (size_t)k0 / 2 * 32;
    for (int kk = 0; kk < kn; kk += 32) {
      _tile_loadd(4, a0 + kk, lda * 2);
      _tile_loadd(6, bx + (size_t)kk / 2 * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a1 + kk, lda * 2);
      _tile_dpbf16ps(1, 5, 6);
      if (G > 1) {
        _tile_loadd(7, bx + (size_t)(K / 2) * 32 + (size_t)kk / 2 * 32, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, cbuf, 64);
  _tile_stored(1, cbuf + 256, 64);
  if (G > 1) {
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
  }
  // each C tile is [16 weight rows][16 activation rows]: transposed in registers into y's rows
  for (int c = 0; c < 2 * G; ++c) {
    const int g = c / 2, rb = rn - 16 * (c & 1);     // weight rows of block c & 1
    if (rb <= 0) continue;
    const __mmask16 cols = rb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rb) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(cbuf + c * 256 + i * 16);
    transpose16(r);
    for (int t = 0; t < 16 && t0 + g * 16 + t < T; ++t)
      _mm512_mask_storeu_ps(y + (size_t)(t0 + g * 16 + t) * w.N + n0 + 16 * (c & 1), cols, r[t]);
  }
}

}  // namespace isa_amx

void amx_pack(const float* x, int T, int K, uint16_t* xb) {
  using namespace isa_amx;
  for (int g = 0; g < (T + 15) / 16; ++g)
    for (int i0 = 0; i0 < K / 2; i0 += 16) {            // 16 column pairs of 16 rows: one transpose
      __m512 r[16];
      for (int t = 0; t < 16; ++t) {
        const int row = g * 16 + t;
        if (row >= T) {
          r[t] = _mm512_setzero_ps();
          continue;
        }
        const float* p = x + (size_t)row * K + 2 * i0;   // 32 floats -> 16 pairs of bfloat16
        r[t] = _mm512_castsi512_ps(bf16x32(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)));
      }
      transpose16(r);                                     // r[j]: pair i0 + j of the 16 rows
      uint16_t* o = xb + (size_t)g * (K / 2) * 32 + (size_t)i0 * 32;
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps((float*)(o + (size_t)j * 32), r[j]);
    }
}

void amx_linear(const uint16_t* xb, int T, const AmxWeight& w, float* y, int n0, int n1) {
  using namespace isa_amx;
  TileConfig cfg = {};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t slab[PAIR * WHOLE];
  alignas(64) float cbuf[4 * 256];
  // Activation rows a block of at most XB_BYTES of xb at a time (a multiple of 32), so that the
  // block stays in L2 while every weight row of the range passes over it.
  const int K = w.K, block = std::max(32, XB_BYTES / (K * 2) / 32 * 32);
  for (int tb = 0; tb < T; tb += block) {
    const int te = T - tb < block ? T : tb + block;
    for (int n = n0; n < n1; n += PAIR) {
      const int rn = n1 - n < PAIR ? n1 - n : PAIR;
      const bool direct = w.format == 0 && rn == PAIR, ready = !direct && K <= WHOLE;
      if (ready) fill_slab(w, n, rn, 0, K, slab, K);
      const uint16_t* a = direct ? (const uint16_t*)w.a + (size_t)n * K : slab;
      for (int t0 = tb; t0 < te; t0 += 32) {
        if (te - t0 > 16)
          chunk<2>(xb, te, t0, w, n, rn, a, K, !direct && !ready, slab, cbuf, y);
        else
          chunk<1>(xb, te, t0, w, n, rn, a, K, !direct && !ready, slab, cbuf, y);
      }
    }
  }
  _tile_release();
}

#pragma GCC pop_options

}  // namespace kvk
