// kvserve's CPU decode ops (torch.library namespace `kvserve`): the int4 / int8 / Q8_0 GEMVs
// reading kvserve's own packed layouts once, and paged decode attention over the block table
// split along the context (FlashDecoding). ISA chosen at run time (set_isa, from torch's
// capability), threads from ATen's pool (at::parallel_for).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "ops.h"

namespace kvk {

static int g_want = 512;   // set_isa: the widest ISA the caller allows

static bool cpu_has(int isa_bits) {
  __builtin_cpu_init();
  if (isa_bits >= 512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma");
  if (isa_bits >= 256) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

static const IsaKernels& table_for(int bits) {
  if (bits >= 512) return avx512_kernels();
  if (bits >= 256) return avx2_kernels();
  return scalar_kernels();
}

static int allowed_bits() {
  for (int bits : {512, 256}) if (g_want >= bits && cpu_has(bits)) return bits;
  return 0;
}

const IsaKernels& isa() { return table_for(allowed_bits()); }

const IsaKernels& isa_dividing(int n) {
  for (int bits : {512, 256, 0}) {
    if (bits > allowed_bits()) continue;
    const IsaKernels& k = table_for(bits);
    if (n % k.width == 0) return k;
  }
  return scalar_kernels();
}

static std::string set_isa(int64_t bits) {
  g_want = (int)bits;
  return isa().name;
}

Linear make_linear(int64_t format, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t group) {
  Linear w;
  w.format = (int)format;
  w.a = a;
  w.b = b;
  w.c = c;
  w.N = (int)a.size(0);
  w.K = (int)(format == INT4 ? 2 * a.size(1) : a.size(1));
  w.G = (int)group;
  TORCH_CHECK(a.is_contiguous() && (!b.defined() || b.is_contiguous()), "kvserve: weights must be contiguous");
  if (format == DENSE) {
    TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) && a.dim() == 2,
                "kvserve: dense weights are float32 or bfloat16 [N, K]");
  } else if (format == INT4) {
    TORCH_CHECK(a.scalar_type() == at::kByte && a.dim() == 2 && b.scalar_type() == at::kBFloat16 && w.G > 0 &&
                    w.G % 32 == 0 && w.K % w.G == 0 && b.dim() == 3 && b.size(0) == w.N && b.size(1) == 2 &&
                    b.size(2) == w.K / w.G,
                "kvserve: int4 takes nibbles [N, K/2] uint8 and scales [N, 2, K/G] bfloat16 (G a multiple of 32)");
    TORCH_CHECK(!c.defined() || c.numel() == 0 ||
                    (c.scalar_type() == at::kByte && c.is_contiguous() && c.dim() == 2 && c.size(0) == w.N &&
                     c.size(1) == w.K / 8),
                "kvserve: an int4 weight's fifth bits are [N, K/8] uint8");
  } else if (format == INT8) {
    TORCH_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kBFloat16 && w.K % 32 == 0 &&
                    b.numel() == w.N, "kvserve: int8 takes q [N, K] int8 and scale [N] bfloat16");
  } else {
    TORCH_CHECK(format == Q8_0 && a.scalar_type() == at::kChar && b.scalar_type() == at::kHalf && b.dim() == 2 &&
                    (w.G == 32 || w.G == 16) && w.K % 32 == 0 && b.size(0) == w.N && b.size(1) == w.K / w.G,
                "kvserve: Q8_0 takes q [N, K] int8 and d [N, K/G] float16, G 32 (or 16: Q6_K's sub-blocks)");
  }
  return w;
}

// Each 32 weights of x as [the 16 even ones, the 16 odd ones]: the order nib32 yields weights in.
static void int4_order(const float* x, int T, int K, float* xp) {
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < K; c += 32)
      for (int j = 0; j < 16; ++j) {
        xp[(size_t)t * K + c + j] = x[(size_t)t * K + c + 2 * j];
        xp[(size_t)t * K + c + 16 + j] = x[(size_t)t * K + c + 2 * j + 1];
      }
}

// Rows 0..N in tiles of 16 over ATen's threads; a matrix too small to pay for the fork runs inline.
template <typename F>
static void parallel_rows(int N, int K, int T, const F& fn) {
  const int tiles = (N + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, 65536 / ((int64_t)16 * K * std::max(T, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t a, int64_t b) {
    fn((int)(a * 16), (int)std::min<int64_t>(b * 16, N));
  });
}

const uint8_t* high_bits(const Linear& w) {
  return w.format == INT4 && w.c.defined() && w.c.numel() > 0 ? w.c.data_ptr<uint8_t>() : nullptr;
}

bool int4_q16_route(const Linear& w, int T) { return w.format == INT4 && T <= INT4_Q16_ROWS && w.K % 64 == 0; }

bool q8_0_q16_route(const Linear& w, int T) { return w.format == Q8_0 && T <= Q8_ROWS; }

// The fewest rows a quantized step runs on AMX with the ISA now allowed (0: it does not).
static int64_t amx_rows() { return allowed_bits() >= 512 && amx_ready() ? AMX_ROWS : 0; }

bool amx_route(const Linear& w, int T) {
  if (w.K % 32 || amx_rows() == 0) return false;
  if (w.format == DENSE) return w.a.scalar_type() == at::kBFloat16 && T >= 1;   // A tiles read from W itself
  return T >= AMX_ROWS;
}

void linear_into(const float* x, int T, const Linear& w, float* y, float* xp) {
  const IsaKernels& k = isa();
  const int N = w.N, K = w.K;
  if (amx_route(w, T)) {
    const AmxWeight aw{w.format, N, K, w.G, w.a.data_ptr(), w.b.defined() ? w.b.data_ptr() : nullptr, high_bits(w)};
    const int groups = (T + 15) / 16;
    // amx_pack writes all of it; 64-byte aligned, so that no tile row straddles two cache lines
    std::unique_ptr<uint16_t, decltype(&std::free)> xb(
        (uint16_t*)std::aligned_alloc(64, ((size_t)groups * 16 * K * 2 + 63) / 64 * 64), &std::free);
    TORCH_CHECK(xb, "out of memory packing ", T, " rows for AMX");
    // packed 16 rows at a time, on every thread once a step is big enough to pay for the fork
    at::parallel_for(0, groups, std::max<int64_t>(1, 131072 / (16 * K)), [&](int64_t g0, int64_t g1) {
      amx_pack(x + (size_t)g0 * 16 * K, (int)std::min<int64_t>(T - g0 * 16, (g1 - g0) * 16), K,
               xb.get() + (size_t)g0 * 16 * K);
    });
    parallel_rows(N, K, T, [&](int n0, int n1) { amx_linear(xb.get(), T, aw, y, n0, n1); });
  } else if (w.format == DENSE) {
    at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, K}, at::kFloat);
    at::Tensor yt = at::from_blob(y, {T, N}, at::kFloat);
    if (w.a.scalar_type() == at::kBFloat16)      // a bfloat16 model: its GEMM in bfloat16, out in float32
      yt.copy_(at::mm(xt.to(at::kBFloat16), w.a.t()));
    else
      at::mm_out(yt, xt, w.a.t());
  } else if (int4_q16_route(w, T)) {
    const int Bp = (K / 32 + 15) / 16 * 16;
    std::vector<float> dx((size_t)T * Bp), xs((size_t)T * 2 * Bp);
    uint8_t* xb = (uint8_t*)xp;   // T * q16_plane_bytes(K) <= 4 T K bytes (K % 64 == 0): the float scratch
    k.quantize_planes(x, T, K, Bp, xb, dx.data(), xs.data());
    const uint8_t* nib = w.a.data_ptr<uint8_t>();
    const uint16_t* sz = (const uint16_t*)w.b.data_ptr<at::BFloat16>();
    parallel_rows(N, K, T, [&](int n0, int n1) {
      k.gemv_int4_q16(xb, dx.data(), xs.data(), T, K, Bp, nib, sz, high_bits(w), N, w.G, y, n0, n1);
    });
  } else if (w.format == INT4) {
    int4_order(x, T, K, xp);
    const uint8_t* nib = w.a.data_ptr<uint8_t>();
    const uint16_t* sz = (const uint16_t*)w.b.data_ptr<at::BFloat16>();
    parallel_rows(N, K, T, [&](int n0, int n1) { k.gemv_int4(xp, T, K, nib, sz, high_bits(w), N, w.G, y, n0, n1); });
  } else if (w.format == INT8) {
    const int8_t* q = w.a.data_ptr<int8_t>();
    const uint16_t* s = (const uint16_t*)w.b.data_ptr<at::BFloat16>();
    parallel_rows(N, K, T, [&](int n0, int n1) { k.gemv_int8(x, T, K, q, s, N, y, n0, n1); });
  } else if (q8_0_q16_route(w, T)) {
    std::vector<float> dx((size_t)T * (K / 32));
    std::vector<int32_t> xc((size_t)T * K / 4);
    int16_t* xq = (int16_t*)xp;                         // T * K int16, then the two planes, in the float scratch
    uint8_t* xl = (uint8_t*)(xq + (size_t)T * K);
    int8_t* xh = (int8_t*)(xl + (size_t)T * K);
    k.quantize_q8(x, T, K, xq, xl, xh, xc.data(), dx.data());
    const int8_t* q = w.a.data_ptr<int8_t>();
    const uint16_t* d = (const uint16_t*)w.b.data_ptr<at::Half>();
    parallel_rows(N, K, T, [&](int n0, int n1) {
      k.gemv_q8_0_q16(xq, xl, xh, xc.data(), dx.data(), T, K, q, d, w.G, N, y, n0, n1);
    });
  } else {
    const int8_t* q = w.a.data_ptr<int8_t>();
    const uint16_t* d = (const uint16_t*)w.b.data_ptr<at::Half>();
    parallel_rows(N, K, T, [&](int n0, int n1) { k.gemv_q8_0(x, T, K, q, d, w.G, N, y, n0, n1); });
  }
}

static at::Tensor linear_op(const at::Tensor& x, const Linear& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.K,
              "kvserve: x must be float32 [T, ", w.K, "]");
  at::Tensor xc = x.contiguous();
  const int T = (int)xc.size(0);
  at::Tensor y = at::empty({T, w.N}, xc.options());
  at::Tensor xp = w.format == INT4 || w.format == Q8_0 ? at::empty_like(xc) : at::Tensor();   // int4_order or xq scratch
  linear_into(xc.data_ptr<float>(), T, w, y.data_ptr<float>(), xp.defined() ? xp.data_ptr<float>() : nullptr);
  return y;
}

static at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                              int64_t group, const c10::optional<at::Tensor>& high) {
  return linear_op(x, make_linear(INT4, nibbles, scales, high.value_or(at::Tensor()), group));
}
static at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return linear_op(x, make_linear(INT8, q, scale, at::Tensor(), 0));
}
// A Q8_0-format weight's block: K / d's columns (32, or 16 for Q6_K's sub-blocks; make_linear checks).
static int64_t q8_block(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && d.dim() == 2 && d.size(1) > 0 && q.size(1) % d.size(1) == 0,
              "kvserve: Q8_0 takes q [N, K] int8 and d [N, K/G] float16");
  return q.size(1) / d.size(1);
}
static at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  return linear_op(x, make_linear(Q8_0, q, d, at::Tensor(), q8_block(q, d)));
}
static at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "kvserve: linear_bf16 takes a bfloat16 weight [N, K]");
  return linear_op(x, make_linear(DENSE, w, at::Tensor(), at::Tensor(), 0));
}

AttnArgs attn_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                   const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), "kvserve: q is float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == q.size(2),
              "kvserve: caches are [num_blocks, KV, block_size, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "kvserve: block tables are int64");
  AttnArgs a{};
  a.q = q.data_ptr<float>();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  auto kind = k_cache.scalar_type();
  TORCH_CHECK(kind == v_cache.scalar_type() && (kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar),
              "kvserve: caches are float32, bfloat16 or int8");
  a.kv_kind = kind == at::kFloat ? 0 : (kind == at::kBFloat16 ? 1 : 2);
  if (a.kv_kind == 2) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && k_scale->scalar_type() == at::kFloat &&
                    k_scale->is_contiguous() && v_scale->is_contiguous(),
                "kvserve: int8 caches need float32 scales [num_blocks, KV, block_size]");
    TORCH_CHECK(k_scale->sizes() == k_cache.sizes().slice(0, 3) && v_scale->sizes() == k_scale->sizes(),
                "kvserve: int8 cache scales are [num_blocks, KV, block_size]");
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.num_heads = (int)q.size(1);
  a.head_dim = (int)q.size(2);
  a.num_kv_heads = (int)k_cache.size(1);
  a.block_size = (int)k_cache.size(2);
  a.block_stride = k_cache.size(1) * k_cache.size(2) * k_cache.size(3);
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.table_stride = block_tables.size(1);
  a.scale = (float)scale;
  TORCH_CHECK(a.num_heads % a.num_kv_heads == 0 && a.num_heads / a.num_kv_heads <= MAX_GQA &&
                  a.head_dim <= MAX_HEAD_DIM, "kvserve: decode attention takes up to ", MAX_GQA,
              " query heads per KV head and head dims up to ", MAX_HEAD_DIM);
  return a;
}

void check_tables(const AttnArgs& a, const int64_t* lens, int B, int64_t num_blocks) {
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= a.table_stride * a.block_size, "kvserve: context length ", lens[b],
                " of sequence ", b, " outside 1..", a.table_stride * a.block_size, " (its block table)");
    const int64_t* row = a.block_tables + (size_t)b * a.table_stride;
    for (int64_t i = 0; i < (lens[b] + a.block_size - 1) / a.block_size; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "kvserve: block id ", row[i], " outside the cache's ",
                  num_blocks, " blocks");
  }
}

void attention_into(const AttnArgs& a, const int64_t* lens, int B, int64_t window, float* out) {
  const IsaKernels& k = isa_dividing(a.head_dim);
  const int KV = a.num_kv_heads, G = a.num_heads / KV, D = a.head_dim;
  int64_t longest = 0;
  for (int b = 0; b < B; ++b) longest = std::max(longest, lens[b]);
  // FlashDecoding: few (sequence, KV head) items and a long context split along the tokens.
  const int threads = at::get_num_threads();
  int splits = 1;
  if (B * KV < 4 * threads && longest >= 256)
    splits = (int)std::min<int64_t>((4 * threads + B * KV - 1) / (B * KV), longest / 128);
  auto range = [&](int b, int s, int& t0, int& t1) {     // split s of sequence b's window
    const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t per = ((len - start + splits - 1) / splits + 31) / 32 * 32;
    t0 = (int)std::min(len, start + s * per);
    t1 = (int)std::min(len, start + (s + 1) * per);
  };
  if (splits == 1) {            // each part normalised into `out` by the thread that ran it
    at::parallel_for(0, B * KV, 1, [&](int64_t i0, int64_t i1) {
      alignas(64) float part[MAX_GQA * MAX_HEAD_DIM];
      float pml[2 * MAX_GQA];
      for (int64_t i = i0; i < i1; ++i) {
        const int b = (int)(i / KV), kvh = (int)(i % KV);
        int t0, t1;
        range(b, 0, t0, t1);
        k.attn_part(a, b, kvh, t0, t1, part, pml);
        float* o = out + ((size_t)b * a.num_heads + (size_t)kvh * G) * D;
        for (int g = 0; g < G; ++g) {
          const float l = pml[2 * g + 1];
          for (int d = 0; d < D; ++d) o[g * D + d] = part[g * D + d] / l;
        }
      }
    });
    return;
  }
  const int items = B * KV * splits;
  std::vector<float> acc((size_t)items * G * D), ml((size_t)items * G * 2), wts(splits);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int b = (int)(i / (KV * splits)), kvh = (int)(i / splits % KV), s = (int)(i % splits);
      int t0, t1;
      range(b, s, t0, t1);
      k.attn_part(a, b, kvh, t0, t1, &acc[(size_t)i * G * D], &ml[(size_t)i * G * 2]);
    }
  });
  for (int b = 0; b < B; ++b)                       // the splits combined (few items: B * KV is small)
    for (int kvh = 0; kvh < KV; ++kvh)
      for (int g = 0; g < G; ++g) {
        const size_t first = ((size_t)b * KV + kvh) * splits;
        float m = -3.0e38f;
        for (int s = 0; s < splits; ++s) m = std::max(m, ml[((first + s) * G + g) * 2]);
        float l = 0.0f;
        for (int s = 0; s < splits; ++s) {
          wts[s] = std::exp(ml[((first + s) * G + g) * 2] - m);
          l += wts[s] * ml[((first + s) * G + g) * 2 + 1];
        }
        float* o = out + ((size_t)b * a.num_heads + (size_t)kvh * G + g) * D;
        for (int d = 0; d < D; ++d) {
          float v = 0.0f;
          for (int s = 0; s < splits; ++s) v += wts[s] * acc[((first + s) * G + g) * D + d];
          o[d] = v / l;
        }
      }
}

static at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const c10::optional<at::Tensor>& k_scale,
                                   const c10::optional<at::Tensor>& v_scale, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, double scale, int64_t window) {
  at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = context_lens.contiguous();
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == qc.size(0) && tables.size(0) == qc.size(0),
              "kvserve: context_lens [B] and block_tables [B, nb] int64");
  AttnArgs a = attn_args(qc, k_cache, v_cache, k_scale, v_scale, tables, scale);
  check_tables(a, lens.data_ptr<int64_t>(), (int)qc.size(0), k_cache.size(0));
  at::Tensor out = at::empty_like(qc);
  attention_into(a, lens.data_ptr<int64_t>(), (int)qc.size(0), window, out.data_ptr<float>());
  return out;
}

// SwiGLU of gate_up [T, 2I] -> [T, I], rows over ATen's threads. No out_dtype: in gate_up's dtype
// with torch's arithmetic in it (bfloat16: silu rounded, then the product). An out_dtype: the float32
// SwiGLU of gate_up's exact values, stored in out_dtype (float32, or bfloat16 rounded once) -- a
// float32 model's big steps, whose GEMMs run in bfloat16: as converting the rows to float32 first,
// and the result to the next GEMM's bfloat16 after, would give, without either copy.
static at::Tensor silu_mul_op(const at::Tensor& gate_up, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK((gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16) &&
                  gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "kvserve: gate_up is float32 or bfloat16 [T, 2I]");
  const at::ScalarType odt = out_dtype.value_or(gate_up.scalar_type());
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK(odt == gate_up.scalar_type() || (bf16 && odt == at::kFloat),
              "kvserve: silu_mul writes gate_up's dtype, or float32 from bfloat16");
  const bool once = bf16 && out_dtype.has_value();      // bfloat16 out of the float32 SwiGLU
  at::Tensor g = gate_up.contiguous();
  const int64_t T = g.size(0), I = g.size(1) / 2;
  at::Tensor out = at::empty({T, I}, g.options().dtype(odt));
  const IsaKernels& k = isa();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    if (bf16 && odt == at::kFloat)
      k.silu_mul_bf16_f32((const uint16_t*)g.data_ptr<at::BFloat16>() + t0 * 2 * I, (int)(t1 - t0), (int)I,
                          out.data_ptr<float>() + t0 * I);
    else if (bf16)
      k.silu_mul_bf16((const uint16_t*)g.data_ptr<at::BFloat16>() + t0 * 2 * I, (int)(t1 - t0), (int)I,
                      (uint16_t*)out.data_ptr<at::BFloat16>() + t0 * I, once);
    else
      k.silu_mul(g.data_ptr<float>() + t0 * 2 * I, (int)(t1 - t0), (int)I, out.data_ptr<float>() + t0 * I);
  });
  return out;
}

// RMSNorm of bfloat16 rows x [T, H] (weight [H], rows_bf16.h); with `delta` [T, H], of x + delta (torch's
// bfloat16 add) instead, also returned: (x + delta, its norm). Rows over ATen's threads.
static std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor* delta,
                                                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "kvserve: rms_norm_bf16 takes bfloat16 x [T, H] and weight [H]");
  TORCH_CHECK(!delta || (delta->scalar_type() == at::kBFloat16 && delta->sizes() == x.sizes()),
              "kvserve: add_rms_norm takes x and delta of one shape [T, H] and weight [H], all bfloat16 or all float32");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor dc = delta ? delta->contiguous() : at::Tensor();
  const int64_t T = xc.size(0), H = xc.size(1);
  at::Tensor out = at::empty_like(xc), sum = delta ? at::empty_like(xc) : at::Tensor();
  const auto* xp = (const uint16_t*)xc.data_ptr<at::BFloat16>();
  const auto* dp = delta ? (const uint16_t*)dc.data_ptr<at::BFloat16>() : nullptr;
  auto* sp = delta ? (uint16_t*)sum.data_ptr<at::BFloat16>() : nullptr;
  auto* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  const IsaKernels& k = isa();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    k.rms_norm_bf16(xp + t0 * H, dp ? dp + t0 * H : nullptr, (const uint16_t*)wc.data_ptr<at::BFloat16>(),
                    (int)(t1 - t0), (int)H, (float)eps, sp ? sp + t0 * H : nullptr, op + t0 * H);
  });
  return {sum, out};
}

static at::Tensor rms_norm_bf16_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<1>(norm_rows(x, nullptr, weight, eps));
}

// x + delta and its RMSNorm: bfloat16 rows (norm_rows), or float32 rows with a float32 weight
// (add_rms_norm_rows: the fused decode step's arithmetic).
static std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const at::Tensor& delta,
                                                          const at::Tensor& weight, double eps) {
  if (x.scalar_type() != at::kFloat) return norm_rows(x, &delta, weight, eps);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat && x.dim() == 2 &&
                  delta.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "kvserve: add_rms_norm takes x and delta of one shape [T, H] and weight [H], all bfloat16 or all float32");
  at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1);
  at::Tensor out = at::empty_like(xc), sum = at::empty_like(xc);
  at::parallel_for(0, T, std::max<int64_t>(8, 16384 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    add_rms_norm_rows(xc.data_ptr<float>() + t0 * H, dc.data_ptr<float>() + t0 * H, wc.data_ptr<float>(), (float)eps,
                      (int)(t1 - t0), (int)H, sum.data_ptr<float>() + t0 * H, out.data_ptr<float>() + t0 * H);
  });
  return {sum, out};
}

// New tokens' K or V rows src [T, KV, D] into their slots of a paged pool [blocks, KV, block_size,
// D] of the same dtype (float32, bfloat16 or float16): slot s is block s / block_size, offset s %
// block_size. Row copies over ATen's threads, every slot checked against the pool first (what
// `cache[block, :, offset] = src` does through torch's generic index kernel).
static void write_slots(const at::Tensor& src, at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(src.dim() == 3 && cache.dim() == 4 && src.scalar_type() == cache.scalar_type() &&
                  (src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16 ||
                   src.scalar_type() == at::kHalf) &&
                  src.size(1) == cache.size(1) && src.size(2) == cache.size(3) && cache.is_contiguous() &&
                  src.stride(2) == 1 && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == src.size(0),
              "kvserve: write_slots takes rows [T, KV, D] and a pool [blocks, KV, block_size, D] of one "
              "float32, bfloat16 or float16 dtype, and T int64 slots");
  const at::Tensor sl = slots.contiguous();
  const int64_t T = src.size(0), KV = src.size(1), D = src.size(2), bs = cache.size(2);
  const int64_t total = cache.size(0) * bs, esize = (int64_t)src.element_size();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < total, "kvserve: slot ", sp[t], " outside the cache");
  const char* in = (const char*)src.data_ptr();
  char* out = (char*)cache.data_ptr();
  const int64_t s0 = src.stride(0) * esize, s1 = src.stride(1) * esize, row = D * esize;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(KV * D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = sp[t] / bs, o = sp[t] % bs;
      for (int64_t h = 0; h < KV; ++h)
        std::memcpy(out + (((b * KV + h) * bs + o) * D) * esize, in + t * s0 + h * s1, (size_t)row);
    }
  });
}

// RoPE of bfloat16 or float32 heads x [T, heads, D] (rows may be strided: q and k heads viewed in the
// fused QKV output) with cos / signed sin [T, D] of x's dtype -> a new [T, heads, D], rows over ATen's threads.
static at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && cos.scalar_type() == dt && sin.scalar_type() == dt &&
                  x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "kvserve: rope takes bfloat16 or float32 x [T, heads, D], cos and sin [T, D] of its dtype");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == D && D % 2 == 0 && D <= MAX_HEAD_DIM && x.stride(2) == 1 &&
                  (heads == 1 || x.stride(1) == D) && x.stride(0) >= heads * D,
              "kvserve: rope takes heads of an even dim up to ", MAX_HEAD_DIM,
              " side by side in each row, and cos / sin of one row a token");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const IsaKernels& k = isa();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * D, 1)), [&](int64_t t0, int64_t t1) {
    if (dt == at::kFloat) {
      k.rope_f32(x.data_ptr<float>() + t0 * x.stride(0), x.stride(0), (int)(t1 - t0), (int)heads, (int)D,
                 c.data_ptr<float>() + t0 * D, s.data_ptr<float>() + t0 * D, out.data_ptr<float>() + t0 * heads * D);
      return;
    }
    k.rope_bf16((const uint16_t*)x.data_ptr<at::BFloat16>() + t0 * x.stride(0), x.stride(0), (int)(t1 - t0),
                (int)heads, (int)D, (const uint16_t*)c.data_ptr<at::BFloat16>() + t0 * D,
                (const uint16_t*)s.data_ptr<at::BFloat16>() + t0 * D,
                (uint16_t*)out.data_ptr<at::BFloat16>() + t0 * heads * D);
  });
  return out;
}

// The greedy token of every row of logits x [S, V] float32 (torch.argmax(x, -1), first
// largest, NaN the largest), rows over ATen's threads.
static at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 &&
                  (x.stride(1) == 1 || x.size(1) == 1 || x.size(0) == 0),
              "kvserve: argmax_rows takes float32 logits [S, V] with contiguous rows");
  const int64_t S = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({S}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const IsaKernels& k = isa();
  at::parallel_for(0, S, std::max<int64_t>(1, 16384 / V), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) o[j] = k.argmax_row(xp + j * ld, (int)V);
  });
  return out;
}

// One token per listed row of logits x [S, V] float32 (rows [R] int64 into S, u [R] float32 in
// [0, 1)), drawn by inverse CDF (sampling.h): no probabilities, cumulative sums or row copies
// written, rows over ATen's threads.
static at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& u) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "kvserve: draw_rows takes float32 logits [S, V] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && u.scalar_type() == at::kFloat &&
                  u.dim() == 1 && u.size(0) == rows.size(0), "kvserve: rows [R] int64 and u [R] float32");
  const at::Tensor r = rows.contiguous(), uc = u.contiguous();
  const int64_t R = r.size(0), S = x.size(0), V = x.size(1), ld = x.stride(0);
  const int64_t* ri = r.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j) TORCH_CHECK(ri[j] >= 0 && ri[j] < S, "kvserve: row ", ri[j], " outside 0..", S - 1);
  at::Tensor out = at::empty({R}, r.options());
  int64_t* o = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float* up = uc.data_ptr<float>();
  const IsaKernels& k = isa();
  at::parallel_for(0, R, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> e(V);
    for (int64_t j = j0; j < j1; ++j) o[j] = k.draw_row(xp + ri[j] * ld, (int)V, up[j], e.data());
  });
  return out;
}

// Rows of an int4 or Q8_0 weight as a dense float32 or bfloat16 matrix [N, K] (over ATen's threads).
static at::Tensor dequantize_op(const Linear& w, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "kvserve: dequantizes to float32 or bfloat16");
  at::Tensor out = at::empty({w.N, w.K}, at::TensorOptions().dtype(dtype));
  float* f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  uint16_t* b = dtype == at::kBFloat16 ? (uint16_t*)out.data_ptr<at::BFloat16>() : nullptr;
  const IsaKernels& k = isa();
  at::parallel_for(0, w.N, std::max<int64_t>(1, 65536 / w.K), [&](int64_t n0, int64_t n1) {
    const size_t o = (size_t)n0 * w.K;
    if (w.format == INT4)
      k.dequant_int4(w.a.data_ptr<uint8_t>(), (const uint16_t*)w.b.data_ptr<at::BFloat16>(),
                     high_bits(w), w.K, w.G, (int)n0,
                     (int)n1, f ? f + o : nullptr, b ? b + o : nullptr);
    else
      k.dequant_q8_0(w.a.data_ptr<int8_t>(), (const uint16_t*)w.b.data_ptr<at::Half>(), w.K, w.G, (int)n0, (int)n1, f ? f + o : nullptr,
                     b ? b + o : nullptr);
  });
  return out;
}

static at::Tensor dequantize_int4(const at::Tensor& nibbles, const at::Tensor& scales, int64_t group,
                                  at::ScalarType dtype, const c10::optional<at::Tensor>& high) {
  return dequantize_op(make_linear(INT4, nibbles, scales, high.value_or(at::Tensor()), group), dtype);
}
static at::Tensor dequantize_q8_0(const at::Tensor& q, const at::Tensor& d, at::ScalarType dtype) {
  return dequantize_op(make_linear(Q8_0, q, d, at::Tensor(), q8_block(q, d)), dtype);
}

}  // namespace kvk

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("set_isa(int bits) -> str", &kvk::set_isa);
  m.def("amx_rows() -> int", &kvk::amx_rows);
  m.def("linear_int4(Tensor x, Tensor nibbles, Tensor scales, int group_size, Tensor? high=None) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor q, Tensor d) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor context_lens, float scale, int window) -> Tensor");
  m.def("silu_mul(Tensor gate_up, ScalarType? out_dtype=None) -> Tensor");
  m.def("draw_rows(Tensor x, Tensor rows, Tensor u) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("write_slots(Tensor src, Tensor(a!) cache, Tensor slots) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("dequantize_int4(Tensor nibbles, Tensor scales, int group_size, ScalarType dtype, Tensor? high=None) -> Tensor");
  m.def("dequantize_q8_0(Tensor q, Tensor d, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("linear_int4", &kvk::linear_int4);
  m.impl("linear_int8", &kvk::linear_int8);
  m.impl("linear_q8_0", &kvk::linear_q8_0);
  m.impl("linear_bf16", &kvk::linear_bf16);
  m.impl("decode_attention", &kvk::decode_attention);
  m.impl("silu_mul", &kvk::silu_mul_op);
  m.impl("draw_rows", &kvk::draw_rows);
  m.impl("argmax_rows", &kvk::argmax_rows);
  m.impl("rms_norm_bf16", &kvk::rms_norm_bf16_op);
  m.impl("add_rms_norm", &kvk::add_rms_norm_op);
  m.impl("write_slots", &kvk::write_slots);
  m.impl("rope", &kvk::rope_op);
  m.impl("dequantize_int4", &kvk::dequantize_int4);
  m.impl("dequantize_q8_0", &kvk::dequantize_q8_0);
}
