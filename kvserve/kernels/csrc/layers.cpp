// One call for every decoder layer of a pure-decode step (Llama family, float32 activations;
// float32 or bfloat16 weights and KV cache):
// per layer add + RMSNorm, the QKV GEMV (+ bias, + Qwen3's per-head q/k norm), RoPE, the KV
// cache write, paged decode attention, the output GEMV, add + RMSNorm, gate_up GEMV, SwiGLU and
// the down GEMV, with no Python between them and scratch buffers allocated once per step.
// A mixture-of-experts layer's MLP instead: the router GEMV, softmax, top-k (renormalised or
// not, times a scale), each chosen expert's gate_up / SwiGLU / down on the rows that chose it
// (only those experts' weights are read), weighted and summed in expert order, plus a shared
// expert (sigmoid-gated or not) -- kvserve/model/moe.py's rules.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

namespace kvk {

// Per layer (kvserve/model/fused_decode.py packs them): 17 tensors -- in_norm, post_norm,
// qkv_bias, q_norm, k_norm, 4 x (a, b, c) for qkv, o, gate_up, down -- and 12 spec ints --
// 4 x (format, group), then E (0: a dense MLP), top_k, renormalise, shared (0 none, 1 ungated,
// 2 sigmoid-gated). With E > 0 the gate_up / down slots are empty and there follow: the router
// [E, hidden] float32, the scale [1] float32, per expert (a, b, c) x (gate_up, down) with
// (format, group) x 2 in the spec, then for a shared expert (a, b, c) x 2 (+ its gate [1, hidden]).
constexpr int TENSORS_PER_LAYER = 17;
constexpr int SPEC_PER_LAYER = 12;

struct Moe {
  int E = 0, top_k = 0, shared = 0;
  bool renorm = false;
  float scale = 1.0f;
  Linear router, shared_gu, shared_down;
  const float* shared_gate = nullptr;
  std::vector<Linear> gate_up, down;
};

// The MoE MLP of B rows: h [B, hidden] -> out [B, hidden]; scratch: logits [B * E], rows /
// y [B * hidden], gu / act [B * widest], xp [B * widest].
static void moe_mlp(const float* h, int B, int hidden, const Moe& m, float* out, float* logits, float* rows,
                    float* y, float* gu, float* act, float* xp) {
  linear_into(h, B, m.router, logits, xp);
  std::vector<std::vector<std::pair<int, float>>> chosen((size_t)m.E);   // expert -> (row, weight)
  std::vector<int> order((size_t)m.E);
  for (int b = 0; b < B; ++b) {
    float* p = logits + (size_t)b * m.E;
    const float top = *std::max_element(p, p + m.E);
    float sum = 0.0f;
    for (int e = 0; e < m.E; ++e) sum += (p[e] = std::exp(p[e] - top));
    for (int e = 0; e < m.E; ++e) p[e] /= sum;
    for (int e = 0; e < m.E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + m.top_k, order.end(),
                      [p](int i, int j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
    float kept = 0.0f;
    for (int k = 0; k < m.top_k; ++k) kept += p[order[k]];
    for (int k = 0; k < m.top_k; ++k) {
      float w = m.renorm ? p[order[k]] / kept : p[order[k]];
      chosen[order[k]].push_back({b, w * m.scale});
    }
  }
  std::fill(out, out + (size_t)B * hidden, 0.0f);
  for (int e = 0; e < m.E; ++e) {
    const auto& rs = chosen[e];
    const int n = (int)rs.size();
    if (n == 0) continue;
    for (int i = 0; i < n; ++i) std::copy(h + (size_t)rs[i].first * hidden, h + (size_t)(rs[i].first + 1) * hidden,
                                          rows + (size_t)i * hidden);
    linear_into(rows, n, m.gate_up[e], gu, xp);
    isa().silu_mul(gu, n, m.gate_up[e].N / 2, act);
    linear_into(act, n, m.down[e], y, xp);
    for (int i = 0; i < n; ++i) {
      float* o = out + (size_t)rs[i].first * hidden;
      const float* yi = y + (size_t)i * hidden;
      for (int j = 0; j < hidden; ++j) o[j] += yi[j] * rs[i].second;
    }
  }
  if (m.shared) {
    linear_into(h, B, m.shared_gu, gu, xp);
    isa().silu_mul(gu, B, m.shared_gu.N / 2, act);
    linear_into(act, B, m.shared_down, y, xp);
    for (int b = 0; b < B; ++b) {
      float g = 1.0f;
      if (m.shared_gate) {
        float dot = 0.0f;
        for (int j = 0; j < hidden; ++j) dot += h[(size_t)b * hidden + j] * m.shared_gate[j];
        g = 1.0f / (1.0f + std::exp(-dot));
      }
      for (int j = 0; j < hidden; ++j) out[(size_t)b * hidden + j] += g * y[(size_t)b * hidden + j];
    }
  }
}

// The per-row work between the GEMMs (norms, RoPE, the KV write, SwiGLU) over ATen's threads
// once a step has more than ROWS_GRAIN rows (fewer run inline: a fork costs more than they do).
constexpr int64_t ROWS_GRAIN = 8;
template <typename F>
static void each_row(int B, const F& fn) {
  at::parallel_for(0, B, ROWS_GRAIN, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn((int)b);
  });
}

// x += delta (if any); out = x / sqrt(mean(x^2) + eps) * w, one row of `n`. The sum of squares is
// one chain of adds: 8 interleaved partial sums moved a Qwen3-MoE int4 model's fused step off its
// layer-by-layer twin by 1.5e-3 in a logprob (test_fused_step_with_experts), the chain by < 7e-6.
// The layer-by-layer path's float32 norms take the same arithmetic (add_rms_norm_rows below), so
// the two paths' norms of one row agree bit for bit.
// out = x / sqrt(ss / n + eps) * w: one row of `n` normed from its sum of squares `ss`.
static inline void scale_row(const float* x, float ss, const float* w, float eps, int n, float* out) {
  const float r = 1.0f / std::sqrt(ss / n + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

static void add_rms_norm(float* x, const float* delta, const float* w, float eps, int n, float* out) {
  if (delta)
    for (int i = 0; i < n; ++i) x[i] += delta[i];
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  scale_row(x, ss, w, eps, n, out);
}

void add_rms_norm_rows(const float* x, const float* delta, const float* w, float eps, int T, int n, float* xo,
                       float* out) {
  constexpr int R = 8;    // rows whose chains of adds interleave (one chain alone waits on each add)
  int t = 0;
  for (; t + R <= T; t += R) {
    float* s = xo + (size_t)t * n;
    for (size_t i = 0; i < (size_t)R * n; ++i) s[i] = x[(size_t)t * n + i] + delta[(size_t)t * n + i];
    float ss[R] = {};
    for (int i = 0; i < n; ++i)
      for (int r = 0; r < R; ++r) ss[r] += s[(size_t)r * n + i] * s[(size_t)r * n + i];
    for (int r = 0; r < R; ++r) scale_row(s + (size_t)r * n, ss[r], w, eps, n, out + (size_t)(t + r) * n);
  }
  for (; t < T; ++t) {
    for (int i = 0; i < n; ++i) xo[(size_t)t * n + i] = x[(size_t)t * n + i];
    add_rms_norm(xo + (size_t)t * n, delta + (size_t)t * n, w, eps, n, out + (size_t)t * n);
  }
}

// A K or V row quantized as attention/kv_quant.py's `quantize` does: scale = max(amax / 127,
// 1e-12), q = round(x / scale) (half to even, as torch.round) in -127..127.
static void quantize_int8_row(const float* x, int D, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = std::max(amax / 127.0f, 1e-12f);
  for (int d = 0; d < D; ++d) q[d] = (int8_t)std::max(-127.0f, std::min(127.0f, std::nearbyint(x[d] / s)));
  *scale = s;
}

// rope(x) = x * cos + roll(x, D/2) * sin with kvserve's tables (sin signed: [-sin, sin]).
static void rope_head(float* x, const float* cos, const float* sin, int D) {
  const int half = D / 2;
  for (int j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * cos[j] + b * sin[j];
    x[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

static void decode_layers(at::Tensor x, at::TensorList weights, at::IntArrayRef spec,
                          const at::Tensor& rope_cos, const at::Tensor& rope_sin, const at::Tensor& positions,
                          at::TensorList k_caches, at::TensorList v_caches, at::TensorList k_scales,
                          at::TensorList v_scales, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, const at::Tensor& slot_mapping, int64_t num_heads,
                          int64_t num_kv_heads, double eps, double scale, int64_t window) {
  const int L = (int)k_caches.size();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "kvserve: x is float32 [B, hidden]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong, "kvserve: positions, slots and lengths are int64");
  const int B = (int)x.size(0), hidden = (int)x.size(1), H = (int)num_heads, KV = (int)num_kv_heads;
  const int D = (int)k_caches[0].size(3), bs = (int)k_caches[0].size(2), qkv_n = (H + 2 * KV) * D;
  TORCH_CHECK(rope_cos.size(1) == D && rope_cos.scalar_type() == at::kFloat, "kvserve: rope tables are float32 [P, D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  TORCH_CHECK(positions.numel() >= B && slot_mapping.numel() >= B && context_lens.numel() == B &&
                  block_tables.size(0) == B, "kvserve: positions, slots, lengths and tables for ", B, " rows");
  const int64_t slots_total = k_caches[0].size(0) * bs;
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < rope_cos.size(0), "kvserve: position ", pos[b], " beyond the RoPE table");
    TORCH_CHECK(slots[b] >= 0 && slots[b] < slots_total, "kvserve: slot ", slots[b], " outside the cache");
  }
  const auto kv_type = k_caches[0].scalar_type();
  const bool int8_kv = kv_type == at::kChar;
  TORCH_CHECK(v_caches.size() == (size_t)L && (int8_kv ? k_scales.size() == (size_t)L && v_scales.size() == (size_t)L
                                                       : k_scales.empty() && v_scales.empty()),
              "kvserve: decode_layers takes a K and V cache per layer, and their scales with an int8 cache");
  for (int l = 0; l < L; ++l) {
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    (kv_type == at::kFloat || kv_type == at::kBFloat16 || int8_kv) &&
                    k_caches[l].scalar_type() == kv_type && v_caches[l].scalar_type() == kv_type &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                "kvserve: decode_layers takes float32, bfloat16 or int8 caches of one shape and type");
    if (int8_kv)
      TORCH_CHECK(k_scales[l].scalar_type() == at::kFloat && v_scales[l].scalar_type() == at::kFloat &&
                      k_scales[l].is_contiguous() && v_scales[l].is_contiguous() &&
                      k_scales[l].sizes() == k_caches[0].sizes().slice(0, 3) && v_scales[l].sizes() == k_scales[l].sizes(),
                  "kvserve: int8 cache scales are float32 [num_blocks, KV, block_size]");
  }

  std::vector<Linear> lin((size_t)L * 4);
  std::vector<Moe> moe((size_t)L);
  std::vector<size_t> first((size_t)L);      // each layer's first tensor
  int widest = hidden, most_experts = 0;
  size_t ti = 0, si = 0;
  for (int l = 0; l < L; ++l) {
    TORCH_CHECK(ti + TENSORS_PER_LAYER <= weights.size() && si + SPEC_PER_LAYER <= spec.size(),
                "kvserve: decode_layers takes ", TENSORS_PER_LAYER, " tensors and ", SPEC_PER_LAYER,
                " spec ints per layer, and its experts'");
    first[l] = ti;
    const int64_t* s = spec.data() + si;
    Moe& m = moe[l];
    m.E = (int)s[8];
    m.top_k = (int)s[9];
    m.renorm = s[10] != 0;
    m.shared = (int)s[11];
    for (int j = 0; j < (m.E ? 2 : 4); ++j) {
      const at::Tensor* abc = &weights[ti + 5 + 3 * j];
      lin[(size_t)l * 4 + j] = make_linear(s[2 * j], abc[0], abc[1], abc[2], s[2 * j + 1]);
      widest = std::max({widest, lin[(size_t)l * 4 + j].K, lin[(size_t)l * 4 + j].N});
    }
    ti += TENSORS_PER_LAYER;
    si += SPEC_PER_LAYER;
    if (m.E == 0) continue;
    TORCH_CHECK(m.E > 0 && 1 <= m.top_k && m.top_k <= m.E && m.shared >= 0 && m.shared <= 2,
                "kvserve: a layer of ", m.E, " experts, top ", m.top_k, ", shared kind ", m.shared);
    const size_t need_t = 2 + 6 * (size_t)m.E + (m.shared ? 6 + (m.shared == 2) : 0);
    const size_t need_s = 4 * (size_t)m.E + (m.shared ? 4 : 0);
    TORCH_CHECK(ti + need_t <= weights.size() && si + need_s <= spec.size(), "kvserve: layer ", l,
                " lacks its experts' tensors or spec ints");
    m.router = make_linear(DENSE, weights[ti], at::Tensor(), at::Tensor(), 0);
    TORCH_CHECK(m.router.N == m.E && m.router.K == hidden && weights[ti + 1].scalar_type() == at::kFloat &&
                    weights[ti + 1].numel() == 1, "kvserve: the router is float32 [E, hidden], its scale [1]");
    m.scale = weights[ti + 1].data_ptr<float>()[0];
    ti += 2;
    auto next = [&](void) {
      const Linear w = make_linear(spec[si], weights[ti], weights[ti + 1], weights[ti + 2], spec[si + 1]);
      ti += 3;
      si += 2;
      widest = std::max({widest, w.K, w.N});
      return w;
    };
    for (int e = 0; e < m.E; ++e) {
      m.gate_up.push_back(next());
      m.down.push_back(next());
      TORCH_CHECK(m.gate_up[e].K == hidden && m.down[e].N == hidden && m.down[e].K * 2 == m.gate_up[e].N,
                  "kvserve: expert ", e, " of layer ", l, " has shapes that disagree");
    }
    if (m.shared) {
      m.shared_gu = next();
      m.shared_down = next();
      if (m.shared == 2) {
        TORCH_CHECK(weights[ti].scalar_type() == at::kFloat && weights[ti].numel() == hidden,
                    "kvserve: the shared expert's gate is float32 [1, hidden]");
        m.shared_gate = weights[ti].data_ptr<float>();
        ti += 1;
      }
    }
    most_experts = std::max(most_experts, m.E);
  }
  TORCH_CHECK(ti == weights.size() && si == spec.size(), "kvserve: decode_layers got ", weights.size(),
              " tensors and ", spec.size(), " spec ints; its layers take ", ti, " and ", si);
  TORCH_CHECK(lin[0].N == qkv_n && lin[1].N == hidden && (moe[0].E || lin[3].N == hidden),
              "kvserve: layer shapes disagree");
  std::vector<float> h((size_t)B * widest), qkv((size_t)B * qkv_n), q((size_t)B * H * D), attn((size_t)B * H * D),
      o((size_t)B * hidden), gu((size_t)B * widest), act((size_t)B * widest), down((size_t)B * hidden),
      xp((size_t)B * widest), logits((size_t)B * most_experts), rows((size_t)B * hidden), y((size_t)B * hidden);
  float* xs = x.data_ptr<float>();
  const float* delta = nullptr;
  const float* cos = rope_cos.data_ptr<float>();
  const float* sin = rope_sin.data_ptr<float>();
  for (int l = 0; l < L; ++l) {
    const at::Tensor* t = &weights[first[l]];
    const Linear* w = &lin[(size_t)l * 4];
    const float* in_norm = t[0].data_ptr<float>();
    each_row(B, [&](int b) {
      add_rms_norm(xs + (size_t)b * hidden, delta ? delta + (size_t)b * hidden : nullptr, in_norm, (float)eps,
                   hidden, h.data() + (size_t)b * hidden);
    });
    linear_into(h.data(), B, w[0], qkv.data(), xp.data());
    each_row(B, [&](int b) {
      float* row = qkv.data() + (size_t)b * qkv_n;
      if (t[2].numel())
        for (int i = 0; i < qkv_n; ++i) row[i] += t[2].data_ptr<float>()[i];
      for (int hd = 0; hd < H + KV; ++hd) {
        float* head = row + (size_t)hd * D;
        const at::Tensor& qk_norm = hd < H ? t[3] : t[4];
        if (qk_norm.numel()) add_rms_norm(head, nullptr, qk_norm.data_ptr<float>(), (float)eps, D, head);
        rope_head(head, cos + pos[b] * D, sin + pos[b] * D, D);
      }
      std::copy(row, row + (size_t)H * D, q.data() + (size_t)b * H * D);
      const int64_t block = slots[b] / bs, off = slots[b] % bs;
      for (int kvh = 0; kvh < KV; ++kvh) {
        const size_t dst = ((size_t)(block * KV + kvh) * bs + off) * D;
        const float *k = row + (size_t)(H + kvh) * D, *v = row + (size_t)(H + KV + kvh) * D;
        if (kv_type == at::kFloat) {
          std::copy(k, k + D, k_caches[l].data_ptr<float>() + dst);
          std::copy(v, v + D, v_caches[l].data_ptr<float>() + dst);
        } else if (!int8_kv) {     // bfloat16, rounded to nearest even as torch's .to() rounds
          std::copy(k, k + D, k_caches[l].data_ptr<at::BFloat16>() + dst);
          std::copy(v, v + D, v_caches[l].data_ptr<at::BFloat16>() + dst);
        } else {                   // int8, one scale per token and KV head (attention/kv_quant.py)
          const size_t si = (size_t)(block * KV + kvh) * bs + off;
          quantize_int8_row(k, D, k_caches[l].data_ptr<int8_t>() + dst, k_scales[l].data_ptr<float>() + si);
          quantize_int8_row(v, D, v_caches[l].data_ptr<int8_t>() + dst, v_scales[l].data_ptr<float>() + si);
        }
      }
    });
    at::Tensor qt = at::from_blob(q.data(), {B, H, D}, at::kFloat);
    AttnArgs a = int8_kv ? attn_args(qt, k_caches[l], v_caches[l], k_scales[l], v_scales[l], block_tables, scale)
                         : attn_args(qt, k_caches[l], v_caches[l], c10::nullopt, c10::nullopt, block_tables, scale);
    if (l == 0) check_tables(a, context_lens.data_ptr<int64_t>(), B, k_caches[0].size(0));
    attention_into(a, context_lens.data_ptr<int64_t>(), B, window, attn.data());
    linear_into(attn.data(), B, w[1], o.data(), xp.data());
    const float* post_norm = t[1].data_ptr<float>();
    each_row(B, [&](int b) {
      add_rms_norm(xs + (size_t)b * hidden, o.data() + (size_t)b * hidden, post_norm, (float)eps, hidden,
                   h.data() + (size_t)b * hidden);
    });
    if (moe[l].E) {
      moe_mlp(h.data(), B, hidden, moe[l], down.data(), logits.data(), rows.data(), y.data(), gu.data(), act.data(),
              xp.data());
    } else {
      linear_into(h.data(), B, w[2], gu.data(), xp.data());
      const int I = w[2].N / 2;
      at::parallel_for(0, B, ROWS_GRAIN, [&](int64_t b0, int64_t b1) {
        isa().silu_mul(gu.data() + b0 * 2 * I, (int)(b1 - b0), I, act.data() + b0 * I);
      });
      linear_into(act.data(), B, w[3], down.data(), xp.data());
    }
    delta = down.data();
  }
  for (size_t i = 0; i < (size_t)B * hidden; ++i) xs[i] += delta[i];
}

}  // namespace kvk

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] weights, int[] spec, Tensor rope_cos, Tensor rope_sin, "
        "Tensor positions, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor(d!)[] k_scales, "
        "Tensor(e!)[] v_scales, Tensor block_tables, "
        "Tensor context_lens, Tensor slot_mapping, int num_heads, int num_kv_heads, float eps, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layers", &kvk::decode_layers); }
