// A sampled token drawn from a row of logits (kvserve/sample/sampler.py `draw`, seed 000's
// sampler): inverse CDF over softmax(x) without writing the probabilities or their cumulative
// sums. Compiled once per ISA region after kernels.h (exp_inplace), in plain loops the compiler
// vectorises.

// x [V] logits (-inf: never drawn), u in [0, 1), e [V] scratch: the first token whose running sum
// of exp(x - max) passes u times the row's total, as `searchsorted(cumsum(softmax(x)), u * total,
// right=True)` finds it (sums in double, as torch's float32 cumsum accumulates); the row's first
// largest entry when rounding puts u * total past every sum, or when every entry is -inf.
static int64_t draw_row(const float* x, int V, float u, float* e) {
  float mx = -3.4e38f;
#pragma omp simd reduction(max : mx)
  for (int i = 0; i < V; ++i) mx = x[i] > mx ? x[i] : mx;
  int first_max = 0;
  while (first_max < V - 1 && !(x[first_max] >= mx)) ++first_max;
  if (!(x[first_max] > -3.4e38f)) return first_max;                 // every entry -inf (or NaN)
#pragma omp simd
  for (int i = 0; i < V; ++i) e[i] = x[i] - mx;
  exp_inplace(e, V);                                                  // clamps at exp(-87):
#pragma omp simd
  for (int i = 0; i < V; ++i) e[i] = x[i] >= -3.4e38f ? e[i] : 0.0f;  // -inf is exactly 0
  constexpr int B = 64;                                               // tokens summed per block
  auto block_sum = [e](int b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += e[b + i];
    return s;
  };
  double total = 0.0;
  for (int b = 0; b < V; b += B) total += block_sum(b, imin(B, V - b));
  const double target = (double)(u * (float)total);
  double run = 0.0;
  for (int b = 0; b < V; b += B) {
    const int n = imin(B, V - b);
    const float s = block_sum(b, n);
    if (run + s > target) {                                           // the token is in this block
      for (int i = 0; i < n; ++i) {
        run += e[b + i];
        if (run > target) return b + i;
      }
      continue;                                                       // rounding: the next block's
    }
    run += s;
  }
  return first_max;
}

// The index of x's first largest entry [V], as torch.argmax takes it: a NaN counts as the largest
// (the first NaN), every entry -inf gives 0. A vectorised max, then the first block of 64 that
// holds it, then the entry (torch's reduction kept an index beside every lane: 2.3 ms for 64 rows
// of 49,152 on 2 threads).
static int64_t argmax_row(const float* x, int V) {
  float mx = -__builtin_inff();
  int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (int i = 0; i < V; ++i) {
    mx = x[i] > mx ? x[i] : mx;
    nan |= x[i] != x[i];
  }
  constexpr int B = 64;
  for (int b = 0; b < V; b += B) {
    const int n = imin(B, V - b);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int i = 0; i < n; ++i) hit |= nan ? x[b + i] != x[b + i] : x[b + i] == mx;
    if (hit)
      for (int i = 0; i < n; ++i)
        if (nan ? x[b + i] != x[b + i] : x[b + i] == mx) return b + i;
  }
  return 0;
}
