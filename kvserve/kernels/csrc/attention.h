// Paged decode attention and SwiGLU, in vec.h's vocabulary: the rest of the kernels an ISA
// region compiles (after kernels.h, whose helpers they use).

// ---- paged decode attention: one (sequence, KV head, token range) part -------------------
// A K / V row as float32: the cache's own memory (float32) or converted into `buf`.
static inline const float* kv_row(const kvk::AttnArgs& a, const void* cache, const float* scales,
                                  int64_t slot_row, float* buf) {
  const int D = a.head_dim;
  if (a.kv_kind == 0) return (const float*)cache + slot_row * D;
  if (a.kv_kind == 1) {
    const uint16_t* p = (const uint16_t*)cache + slot_row * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) buf[d] = bf16_to_f32(p[d]);
    return buf;
  }
  const int8_t* p = (const int8_t*)cache + slot_row * D;
  const float s = scales[slot_row];
#pragma omp simd
  for (int d = 0; d < D; ++d) buf[d] = (float)p[d] * s;
  return buf;
}

// One chunk's step of the online softmax for one query head: scores s [CH] (n of them real;
// s has room for CH) become exp(s - mx) in place, mx the larger of their max and the running max
// m, zero past n; m and the running sum l move to the chunk. Returns alpha = exp(old m - mx), the
// factor the head's output accumulated so far takes. Max and sum run over whole vectors (as
// scalar loops they were chains of dependent compares and adds, 32 a chunk and head).
template <int CH>
static inline float softmax_chunk(float* s, int n, float& m, float& l) {
  static_assert(CH % KV_W == 0, "a chunk is whole vectors");
  for (int i = n; i < CH; ++i) s[i] = -3.0e38f;
  VF mv = vset(m);
  for (int c = 0; c < CH; c += KV_W) mv = vmax(mv, vload(s + c));
  const float mx = vhmax(mv);
  float alpha[1] = {m - mx};
  exp_inplace(alpha, 1);
  const VF mxv = vset(mx);
  for (int c = 0; c < CH; c += KV_W) vstore(s + c, vfma(vset(-1.0f), mxv, vload(s + c)));
  exp_inplace(s, n);
  for (int i = n; i < CH; ++i) s[i] = 0.0f;
  VF sv = vzero();
  for (int c = 0; c < CH; c += KV_W) sv = vfma(vset(1.0f), vload(s + c), sv);
  l = l * alpha[0] + vsum(sv);
  m = mx;
  return alpha[0];
}

#if KV_ISA != 0
// A float32 or bfloat16 cache row's NV vectors. bfloat16 rows are split as they are loaded:
// vectors 2c and 2c + 1 hold dims 2 KV_W c + (0, 2, 4, ...) and + (1, 3, 5, ...) (a shift and a
// mask, where widening in order costs a shuffle a vector); `row_dim` maps a lane back to its dim.
template <int NV>
static inline void kv_vecs(const void* cache, int kind, int64_t slot_row, VF* v) {
  constexpr int D = NV * KV_W;
  if (kind == 0) {
    const float* p = (const float*)cache + slot_row * D;
    for (int j = 0; j < NV; ++j) v[j] = vload(p + j * KV_W);
  } else {
    const uint16_t* p = (const uint16_t*)cache + slot_row * D;
    for (int j = 0; j < NV; j += 2) vload_bf16_split(p + j * KV_W, v[j], v[j + 1]);
  }
}

// The head dim held by lane `lane` of vector `j` of a row as kv_vecs loads it.
static inline int row_dim(int kind, int j, int lane) {
  return kind == 0 ? j * KV_W + lane : (j / 2) * 2 * KV_W + 2 * lane + (j % 2);
}

// attn_part for G query heads of NV vectors each over a float32 or bfloat16 cache, the G output
// rows held in registers across the whole token range (in kv_vecs' lane order, as q is read),
// K and V rows read straight from the cache (no row buffers), each token's slot found by walking
// the block table (no division a token).
template <int G, int NV>
static void attn_part_regs(const kvk::AttnArgs& a, int b, int kvh, int t0, int t1, float* out, float* ml) {
  constexpr int CH = 32, D = NV * KV_W;
  static_assert(NV % 2 == 0, "bfloat16 rows split in pairs of vectors");
  const int bs = a.block_size, kind = a.kv_kind, lines = D * (kind == 0 ? 4 : 2) / 64;
  const int64_t esize = kind == 0 ? 4 : 2;
  const float* qh = a.q + ((size_t)b * a.num_heads + (size_t)kvh * G) * D;
  float q[G * D];                                    // q in kv_vecs' lane order
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j)
      for (int x = 0; x < KV_W; ++x) q[g * D + j * KV_W + x] = qh[g * D + row_dim(kind, j, x)];
  const int64_t* table = a.block_tables + (size_t)b * a.table_stride;
  VF o[G][NV];
  alignas(64) float sc[G][CH];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    m[g] = -3.0e38f;
    l[g] = 0.0f;
    for (int j = 0; j < NV; ++j) o[g][j] = vzero();
  }
  int blk = t0 / bs, off = t0 % bs;                  // the walker: the next token's block and offset
  int64_t slot[2][CH];
  auto next_slots = [&](int count, int64_t* dst) {
    for (int i = 0; i < count; ++i) {
      dst[i] = (table[blk] * a.num_kv_heads + kvh) * bs + off;
      if (++off == bs) off = 0, ++blk;
    }
  };
  auto fetch = [&](const void* cache, int64_t row) {
    for (int x = 0; x < lines; ++x) __builtin_prefetch((const char*)cache + (row * D * esize) + x * 64, 0, 3);
  };
  next_slots(imin(CH, t1 - t0), slot[0]);
  for (int c = t0, cur = 0; c < t1; c += CH, cur ^= 1) {
    const int n = imin(CH, t1 - c), nn = imin(CH, t1 - c - CH);
    const int64_t* row = slot[cur];
    if (nn > 0) next_slots(nn, slot[cur ^ 1]);
    for (int i0 = 0; i0 < n; i0 += KV_W) {         // scores, KV_W tokens at a time: their dot
      VF part[G][KV_W];                              // products' lanes, summed by one tree
      for (int u = 0; u < KV_W; ++u) {
        const int i = i0 + u;
        if (i >= n) {
          for (int g = 0; g < G; ++g) part[g][u] = vzero();
          continue;
        }
        if (i < nn) fetch(a.k_cache, slot[cur ^ 1][i]);   // the next chunk's K, this chunk's V requested
        fetch(a.v_cache, row[i]);
        VF k[NV];
        kv_vecs<NV>(a.k_cache, kind, row[i], k);
        for (int g = 0; g < G; ++g) {
          VF acc = vmul(vload(q + g * D), k[0]);
          for (int j = 1; j < NV; ++j) acc = vfma(vload(q + g * D + j * KV_W), k[j], acc);
          part[g][u] = acc;
        }
      }
      for (int g = 0; g < G; ++g) {
        vsum_many(part[g], sc[g] + i0);
        vstore(sc[g] + i0, vmul(vload(sc[g] + i0), vset(a.scale)));
      }
    }
    for (int g = 0; g < G; ++g) {                   // online softmax over the chunk
      const float alpha = softmax_chunk<CH>(sc[g], n, m[g], l[g]);
      if (alpha != 1.0f) {
        const VF av = vset(alpha);
        for (int j = 0; j < NV; ++j) o[g][j] = vmul(o[g][j], av);
      }
    }
    for (int i = 0; i < n; ++i) {
      VF v[NV];
      kv_vecs<NV>(a.v_cache, kind, row[i], v);
      for (int g = 0; g < G; ++g) {
        const VF p = vset(sc[g][i]);
        for (int j = 0; j < NV; ++j) o[g][j] = vfma(p, v[j], o[g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float row_out[D];
    for (int j = 0; j < NV; ++j) vstore(row_out + j * KV_W, o[g][j]);
    for (int j = 0; j < NV; ++j)
      for (int x = 0; x < KV_W; ++x) out[g * D + row_dim(kind, j, x)] = row_out[j * KV_W + x];
    ml[2 * g] = m[g];
    ml[2 * g + 1] = l[g];
  }
}
#endif

static void attn_part_rows(const kvk::AttnArgs& a, int b, int kvh, int t0, int t1, float* out, float* ml);

// One (sequence, KV head, token range) part: the register-resident loop where the head dim and
// GQA ratio fit the registers (float32 / bfloat16 caches), else the row-buffer loop below.
static void attn_part(const kvk::AttnArgs& a, int b, int kvh, int t0, int t1, float* out, float* ml) {
#if KV_ISA != 0
  const int G = a.num_heads / a.num_kv_heads;
  if (a.kv_kind != 2 && a.head_dim == 64) {
    constexpr int NV = 64 / KV_W;                    // head dim 64: 4 zmm or 8 ymm a row
    switch (G) {
      case 1: return attn_part_regs<1, NV>(a, b, kvh, t0, t1, out, ml);
      case 2: return attn_part_regs<2, NV>(a, b, kvh, t0, t1, out, ml);
      case 3: return attn_part_regs<3, NV>(a, b, kvh, t0, t1, out, ml);
      case 4: return attn_part_regs<4, NV>(a, b, kvh, t0, t1, out, ml);
      default: break;
    }
  }
#endif
  attn_part_rows(a, b, kvh, t0, t1, out, ml);
}

static void attn_part_rows(const kvk::AttnArgs& a, int b, int kvh, int t0, int t1, float* out,
                           float* ml) {
  constexpr int CH = 32;   // tokens scored together: one softmax rescale per chunk
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  const float* q = a.q + ((size_t)b * a.num_heads + (size_t)kvh * G) * D;
  const int64_t* table = a.block_tables + (size_t)b * a.table_stride;
  float m[kvk::MAX_GQA], l[kvk::MAX_GQA], sc[kvk::MAX_GQA][CH];
  float kbuf[CH][kvk::MAX_HEAD_DIM], vbuf[kvk::MAX_HEAD_DIM];
  const float* rows[CH];
  for (int g = 0; g < G; ++g) {
    m[g] = -3.0e38f;
    l[g] = 0.0f;
    for (int d = 0; d < D; ++d) out[g * D + d] = 0.0f;
  }
  const int esize = a.kv_kind == 0 ? 4 : (a.kv_kind == 1 ? 2 : 1);
  // each token's row of the cache [blocks, KV, bs], a chunk at a time: this chunk's, the next's
  int64_t slot[2][CH];
  auto slots_of = [&](int c, int64_t* out) {
    for (int i = 0; i < CH && c + i < t1; ++i) {
      const int t = c + i;
      out[i] = (table[t / bs] * a.num_kv_heads + kvh) * bs + t % bs;
    }
  };
  auto prefetch = [&](const void* cache, const int64_t* rows_of, int count) {
    for (int i = 0; i < count; ++i)
      for (int o = 0; o < D * esize; o += 64) __builtin_prefetch((const char*)cache + rows_of[i] * D * esize + o, 0, 3);
  };
  slots_of(t0, slot[0]);
  for (int c = t0, cur = 0; c < t1; c += CH, cur ^= 1) {
    const int n = imin(CH, t1 - c);
    const int64_t* row = slot[cur];
    // the next chunk's K rows and this chunk's V rows requested now (the cache is read once,
    // token by token through the block table: the hardware prefetcher sees short runs)
    if (c + CH < t1) {
      slots_of(c + CH, slot[cur ^ 1]);
      prefetch(a.k_cache, slot[cur ^ 1], imin(CH, t1 - c - CH));
    }
    prefetch(a.v_cache, row, n);
    for (int i = 0; i < n; ++i) rows[i] = kv_row(a, a.k_cache, a.k_scale, row[i], kbuf[i]);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      for (int i = 0; i < n; ++i) {
        VF acc = vzero();
        for (int d = 0; d < D; d += KV_W) acc = vfma(vload(qg + d), vload(rows[i] + d), acc);
        sc[g][i] = vsum(acc) * a.scale;
      }
      const float alpha = softmax_chunk<CH>(sc[g], n, m[g], l[g]);
      if (alpha != 1.0f) {
        VF av = vset(alpha);
        for (int d = 0; d < D; d += KV_W) vstore(out + g * D + d, vmul(vload(out + g * D + d), av));
      }
    }
    for (int i = 0; i < n; ++i) {
      const float* vr = kv_row(a, a.v_cache, a.v_scale, row[i], vbuf);
      for (int g = 0; g < G; ++g) {
        VF p = vset(sc[g][i]);
        for (int d = 0; d < D; d += KV_W) vstore(out + g * D + d, vfma(p, vload(vr + d), vload(out + g * D + d)));
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    ml[2 * g] = m[g];
    ml[2 * g + 1] = l[g];
  }
}

// ---- SwiGLU --------------------------------------------------------------------------------
static void silu_mul(const float* gu, int T, int I, float* out) {
  float e[256];
  for (int t = 0; t < T; ++t) {
    const float* g = gu + (size_t)t * 2 * I;
    const float* u = g + I;
    float* o = out + (size_t)t * I;
    for (int a = 0; a < I; a += 256) {
      const int n = imin(256, I - a);
      for (int i = 0; i < n; ++i) e[i] = -g[a + i] > 88.0f ? 88.0f : -g[a + i];
      exp_inplace(e, n);
#pragma omp simd
      for (int i = 0; i < n; ++i) o[a + i] = g[a + i] / (1.0f + e[i]) * u[a + i];
    }
  }
}
