// A bfloat16 model's layer-by-layer steps (prefill and mixed prefill + decode; decode steps run
// layers.cpp): SwiGLU, RMSNorm and RoPE over bfloat16 rows (RoPE over float32 rows too, at the end), computed in float32 a chunk at a time in
// L1, rounded to bfloat16 where torch's bfloat16 ops round (so the layer-by-layer path's numbers
// stay torch's), without torch's conversions and temporaries between ops. Compiled once per ISA
// region after kernels.h (exp_inplace), in loops the compiler vectorises.

static inline void rows_to_f32(const uint16_t* p, int n, float* out) {
#pragma omp simd
  for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
}

// SwiGLU of bfloat16 rows gu [T, 2I] (gate, then up) -> out [T, I], the rows widened in L1 chunks;
// `store(silu(gate), up)` gives each output element.
template <class Out, class Store>
static void silu_rows_bf16(const uint16_t* gu, int T, int I, Out* out, const Store& store) {
  float g[256], u[256], e[256];
  for (int t = 0; t < T; ++t) {
    const uint16_t* gr = gu + (size_t)t * 2 * I;
    Out* o = out + (size_t)t * I;
    for (int a = 0; a < I; a += 256) {
      const int n = imin(256, I - a);
      rows_to_f32(gr + a, n, g);
      rows_to_f32(gr + I + a, n, u);
#pragma omp simd
      for (int i = 0; i < n; ++i) e[i] = -g[i] > 88.0f ? 88.0f : -g[i];
      exp_inplace(e, n);
#pragma omp simd
      for (int i = 0; i < n; ++i) o[a + i] = store(g[i] / (1.0f + e[i]), u[i]);
    }
  }
}

// -> bfloat16: silu(gate), rounded, times up, rounded (torch's F.silu(gate) * up in bfloat16); or,
// `once`, silu_mul_bf16_f32's float32 SwiGLU rounded once (a float32 model's big steps, whose next
// GEMM takes bfloat16 rows: what rounding that float32 result would give).
static void silu_mul_bf16(const uint16_t* gu, int T, int I, uint16_t* out, bool once) {
  if (once)
    silu_rows_bf16(gu, T, I, out, [](float s, float u) { return f32_to_bf16(s * u); });
  else
    silu_rows_bf16(gu, T, I, out, [](float s, float u) { return f32_to_bf16(bf16_to_f32(f32_to_bf16(s)) * u); });
}

// -> float32: silu_mul's float32 SwiGLU of the rows' exact values (a float32 model's big steps, whose
// gate_up GEMM ran in bfloat16), the same arithmetic bit for bit.
static void silu_mul_bf16_f32(const uint16_t* gu, int T, int I, float* out) {
  silu_rows_bf16(gu, T, I, out, [](float s, float u) { return s * u; });
}

// x [T, H] -> out [T, H]: w * (x / sqrt(mean(x^2) + eps)), the normalised row rounded to bfloat16
// before the weight (bfloat16 [H]) multiplies it, as `layers.rms_norm` computes a bfloat16 row.
// With d (a residual branch's output [T, H]): x + d first, rounded to bfloat16 as torch's
// bfloat16 add rounds it, into xo [T, H], and the norm of that (`layers.add_rms_norm`).
static void rms_norm_bf16(const uint16_t* x, const uint16_t* d, const uint16_t* w, int T, int H, float eps,
                          uint16_t* xo, uint16_t* out) {
  float v[256];
  for (int t = 0; t < T; ++t) {
    const uint16_t* xr = x + (size_t)t * H;
    uint16_t* o = out + (size_t)t * H;
    if (d) {
      const uint16_t* dr = d + (size_t)t * H;
      uint16_t* sr = xo + (size_t)t * H;
#pragma omp simd
      for (int i = 0; i < H; ++i) sr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
      xr = sr;
    }
    float ss = 0.0f;
    for (int a = 0; a < H; a += 256) {
      const int n = imin(256, H - a);
      rows_to_f32(xr + a, n, v);
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < n; ++i) ss += v[i] * v[i];
    }
    const float r = 1.0f / __builtin_sqrtf(ss / (float)H + eps);
    for (int a = 0; a < H; a += 256) {
      const int n = imin(256, H - a);
      rows_to_f32(xr + a, n, v);
#pragma omp simd
      for (int i = 0; i < n; ++i) o[a + i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(v[i] * r)) * bf16_to_f32(w[a + i]));
    }
  }
}

// RoPE of x [T][heads][D] (token rows `stride` elements apart, heads D apart) with bfloat16
// cos / signed sin [T, D] (layers.rope_cos_sin's tables, gathered and rounded as `run_layers`
// rounds them) -> out [T, heads, D]: torch.addcmul(x * cos, roll(x, D/2), sin) in bfloat16 --
// x * cos rounded, plus the float32 product roll(x) * sin, rounded once (addcmul's arithmetic).
static void rope_bf16(const uint16_t* x, int64_t stride, int T, int heads, int D, const uint16_t* cos,
                      const uint16_t* sin, uint16_t* out) {
  const int half = D / 2;
  float c[kvk::MAX_HEAD_DIM], s[kvk::MAX_HEAD_DIM], a[kvk::MAX_HEAD_DIM];
  for (int t = 0; t < T; ++t) {
    rows_to_f32(cos + (size_t)t * D, D, c);
    rows_to_f32(sin + (size_t)t * D, D, s);
    for (int h = 0; h < heads; ++h) {
      const uint16_t* xr = x + (size_t)t * stride + (size_t)h * D;
      uint16_t* o = out + ((size_t)t * heads + h) * D;
      rows_to_f32(xr, D, a);
#pragma omp simd
      for (int j = 0; j < half; ++j) {
        o[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a[j] * c[j])) + a[j + half] * s[j]);
        o[j + half] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a[j + half] * c[j + half])) + a[j] * s[j + half]);
      }
    }
  }
}

// rope_bf16's RoPE over float32 heads and float32 cos / signed sin: torch.addcmul(x * cos, roll(x,
// D/2), sin) in float32, bit for bit: x * cos rounded, then roll(x) * sin added to it with one
// rounding (a fused multiply-add, as torch's vectorised addcmul computes it).
static void rope_f32(const float* x, int64_t stride, int T, int heads, int D, const float* cos,
                     const float* sin, float* out) {
  const int half = D / 2;
  for (int t = 0; t < T; ++t) {
    const float* c = cos + (size_t)t * D;
    const float* s = sin + (size_t)t * D;
    for (int h = 0; h < heads; ++h) {
      const float* a = x + (size_t)t * stride + (size_t)h * D;
      float* o = out + ((size_t)t * heads + h) * D;
#pragma omp simd
      for (int j = 0; j < half; ++j) {
        o[j] = __builtin_fmaf(a[j + half], s[j], a[j] * c[j]);
        o[j + half] = __builtin_fmaf(a[j], s[j + half], a[j + half] * c[j + half]);
      }
    }
  }
}
