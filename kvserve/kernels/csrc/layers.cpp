// One call for every decoder layer of a pure-decode step (Llama family, float32 activations):
// per layer add + RMSNorm, the QKV GEMV (+ bias, + Qwen3's per-head q/k norm), RoPE, the KV
// cache write, paged decode attention, the output GEMV, add + RMSNorm, gate_up GEMV, SwiGLU and
// the down GEMV, with no Python between them and scratch buffers allocated once per step.
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops.h"

namespace kvk {

constexpr int TENSORS_PER_LAYER = 17;   // in_norm, post_norm, qkv_bias, q_norm, k_norm, 4 x (a, b, c)
constexpr int SPEC_PER_LAYER = 8;       // 4 x (format, group)

// x += delta (if any); out = x / sqrt(mean(x^2) + eps) * w, one row of `n`.
static void add_rms_norm(float* x, const float* delta, const float* w, float eps, int n, float* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (delta) x[i] += delta[i];
    ss += x[i] * x[i];
  }
  const float r = 1.0f / std::sqrt(ss / n + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
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
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, const at::Tensor& slot_mapping, int64_t num_heads,
                          int64_t num_kv_heads, double eps, double scale, int64_t window) {
  const int L = (int)k_caches.size();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "kvserve: x is float32 [B, hidden]");
  TORCH_CHECK((int)weights.size() == L * TENSORS_PER_LAYER && (int)spec.size() == L * SPEC_PER_LAYER &&
                  (int)v_caches.size() == L, "kvserve: decode_layers takes ", TENSORS_PER_LAYER,
              " tensors and ", SPEC_PER_LAYER, " spec ints per layer");
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
  for (int l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    k_caches[l].scalar_type() == at::kFloat && v_caches[l].scalar_type() == at::kFloat &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous(),
                "kvserve: decode_layers takes float32 caches of one shape");

  std::vector<Linear> lin((size_t)L * 4);
  int widest = hidden;
  for (int l = 0; l < L; ++l)
    for (int j = 0; j < 4; ++j) {
      const int64_t* s = spec.data() + l * SPEC_PER_LAYER + 2 * j;
      const at::Tensor* abc = &weights[l * TENSORS_PER_LAYER + 5 + 3 * j];
      lin[(size_t)l * 4 + j] = make_linear(s[0], abc[0], abc[1], abc[2], s[1]);
      widest = std::max({widest, lin[(size_t)l * 4 + j].K, lin[(size_t)l * 4 + j].N});
    }
  TORCH_CHECK(lin[0].N == qkv_n && lin[1].N == hidden && lin[3].N == hidden, "kvserve: layer shapes disagree");
  std::vector<float> h((size_t)B * widest), qkv((size_t)B * qkv_n), q((size_t)B * H * D), attn((size_t)B * H * D),
      o((size_t)B * hidden), gu((size_t)B * widest), act((size_t)B * widest), down((size_t)B * hidden),
      xp((size_t)B * widest);
  float* xs = x.data_ptr<float>();
  const float* delta = nullptr;
  const float* cos = rope_cos.data_ptr<float>();
  const float* sin = rope_sin.data_ptr<float>();
  for (int l = 0; l < L; ++l) {
    const at::Tensor* t = &weights[l * TENSORS_PER_LAYER];
    const Linear* w = &lin[(size_t)l * 4];
    const float* in_norm = t[0].data_ptr<float>();
    for (int b = 0; b < B; ++b)
      add_rms_norm(xs + (size_t)b * hidden, delta ? delta + (size_t)b * hidden : nullptr, in_norm, (float)eps,
                   hidden, h.data() + (size_t)b * hidden);
    linear_into(h.data(), B, w[0], qkv.data(), xp.data());
    for (int b = 0; b < B; ++b) {
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
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      const int64_t block = slots[b] / bs, off = slots[b] % bs;
      for (int kvh = 0; kvh < KV; ++kvh) {
        const size_t dst = ((size_t)(block * KV + kvh) * bs + off) * D;
        std::copy(row + (size_t)(H + kvh) * D, row + (size_t)(H + kvh + 1) * D, kc + dst);
        std::copy(row + (size_t)(H + KV + kvh) * D, row + (size_t)(H + KV + kvh + 1) * D, vc + dst);
      }
    }
    at::Tensor qt = at::from_blob(q.data(), {B, H, D}, at::kFloat);
    AttnArgs a = attn_args(qt, k_caches[l], v_caches[l], c10::nullopt, c10::nullopt, block_tables, scale);
    if (l == 0) check_tables(a, context_lens.data_ptr<int64_t>(), B, k_caches[0].size(0));
    attention_into(a, context_lens.data_ptr<int64_t>(), B, window, attn.data());
    linear_into(attn.data(), B, w[1], o.data(), xp.data());
    const float* post_norm = t[1].data_ptr<float>();
    for (int b = 0; b < B; ++b)
      add_rms_norm(xs + (size_t)b * hidden, o.data() + (size_t)b * hidden, post_norm, (float)eps, hidden,
                   h.data() + (size_t)b * hidden);
    linear_into(h.data(), B, w[2], gu.data(), xp.data());
    isa().silu_mul(gu.data(), B, w[2].N / 2, act.data());
    linear_into(act.data(), B, w[3], down.data(), xp.data());
    delta = down.data();
  }
  for (size_t i = 0; i < (size_t)B * hidden; ++i) xs[i] += delta[i];
}

}  // namespace kvk

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor[] weights, int[] spec, Tensor rope_cos, Tensor rope_sin, "
        "Tensor positions, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor block_tables, "
        "Tensor context_lens, Tensor slot_mapping, int num_heads, int num_kv_heads, float eps, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("decode_layers", &kvk::decode_layers); }
