// Sampling at temperature > 0 with one uniform number per row (worker/sample/sampler.py calls this).
//
// The exponential race the torch path once ran drew an exponential for every vocabulary entry, and top-p sorted
// the whole row: twenty to sixty times greedy's argmax (docs/performance.md#measurements-behind-choices-in-the-code).
// Here each row is drawn by inversion: the token is the first one, in vocabulary
// order, at which the running sum of the filtered distribution passes u times its total, u ~ U[0, 1). That
// costs a max and an exp pass over the row (both vectorised) and a walk over block sums; top-k and top-p sort
// only the tokens within a factor 2^s of the most likely one, for the smallest s whose tokens hold the cut.
//
// Filters as the torch path defines them (worker/sample/sampler.py `_random_probs`): on z = x / T, the top_k
// largest (ties to the lower id), then the shortest prefix of those in descending order whose mass reaches
// top_p, then those with z >= max z + log(min_p). Sums are in double, so the inversion's own error (~1e-16 of
// the total) is far below what any test of the distribution can see.
#include "cpu_common.h"
#include "kernels_cpu.h"

#include <ATen/Parallel.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kWalkBlock = 512;  // the walk sums blocks first, then the entries of one block

struct RowFilter {
  float inv_temperature;
  int64_t top_k;     // >= vocab: no cut
  double top_p;      // >= 1: no cut
  float log_min_p;   // -inf: no cut
  double uniform;    // in [0, 1)
};

// e[i] = exp((x[i] - max) / T), zero below the min_p cut when `cut_min_p`; fills the block sums and returns
// their total. A block's sum is a float (a double reduction halves the pass's speed): its rounding, ~1e-6 of
// the block, moves at most that much probability between the tokens at a block's edges.
double exp_row(const float* x, int64_t vocab, float max, const RowFilter& f, bool cut_min_p, float* e,
               std::vector<double>& blocks) {
  const float floor = cut_min_p ? f.log_min_p : -std::numeric_limits<float>::infinity();
  double total = 0.0;
  for (int64_t b = 0, start = 0; start < vocab; ++b, start += kWalkBlock) {
    const int64_t end = std::min(vocab, start + kWalkBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = start; i < end; ++i) {
      const float z = (x[i] - max) * f.inv_temperature;
      const float v = z < floor ? 0.f : exp_simd(z);
      e[i] = v;
      sum += v;
    }
    blocks[b] = sum;
    total += sum;
  }
  return total;
}

// The last token with a positive weight in [start, end): where rounding leaves a walk's target unreached.
int64_t last_positive(const float* e, int64_t start, int64_t end) {
  for (int64_t i = end - 1; i > start; --i)
    if (e[i] > 0.f) return i;
  return start;
}

// The first token whose running sum of e passes `target`, walking block sums, then one block's entries.
int64_t draw_all(const float* e, int64_t vocab, const std::vector<double>& blocks, double target) {
  double before = 0.0;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  int64_t b = 0;
  while (b < num_blocks - 1 && before + blocks[b] <= target) before += blocks[b++];
  const int64_t start = b * kWalkBlock, end = std::min(vocab, start + kWalkBlock);
  double sum = before;
  for (int64_t i = start; i < end; ++i) {
    sum += e[i];
    if (sum > target && e[i] > 0.f) return i;
  }
  return last_positive(e, start, end);
}

// A row with top-k and/or top-p: the cut is sorted among the fewest candidates that must hold it, the tokens
// with e >= 2^-shift. exp_simd's smallest positive result is above 2^-127, so the last shift takes every
// token of positive weight, and the others weigh nothing.
int64_t draw_cut(const float* x, const float* e, int64_t vocab, float max, double total, const RowFilter& f,
                 std::vector<int32_t>& candidates) {
  for (const int shift : {4, 8, 16, 32, 64, 128}) {
    const float threshold = std::ldexp(1.f, -shift);
    int64_t count = 0, positive = 0;
    float mass = 0.f;
#pragma omp simd reduction(+ : count, positive, mass)
    for (int64_t i = 0; i < vocab; ++i) {
      const bool in = e[i] >= threshold;
      count += in;
      positive += e[i] > 0.f;
      mass += in ? e[i] : 0.f;
    }
    const bool all_positive = count >= positive;
    const bool enough = f.top_k < vocab ? count >= f.top_k : mass >= f.top_p * total;
    if (!enough && !all_positive) continue;
    candidates.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if (e[i] >= threshold) candidates.push_back(static_cast<int32_t>(i));
    // Descending z, ties to the lower id: z = x / T is monotone in x, so x orders them.
    std::sort(candidates.begin(), candidates.end(),
              [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    const int64_t k = std::min<int64_t>(f.top_k, count);
    // top_p is a fraction of the top-k tokens' mass (all of them are candidates when top_k is set).
    double kept_total = total;
    if (f.top_k < vocab) {
      kept_total = 0.0;
      for (int64_t j = 0; j < k; ++j) kept_total += e[candidates[j]];
    }
    // Keep a token while the mass before it is short of top_p and it passes min_p.
    const double cut = f.top_p * kept_total;
    double before = 0.0;
    int64_t kept = 0;
    while (kept < k && before < cut && (x[candidates[kept]] - max) * f.inv_temperature >= f.log_min_p)
      before += e[candidates[kept++]];
    if (kept == count && before < cut && f.top_k >= vocab && !all_positive) continue;  // the nucleus goes on
    if (kept == 0) return candidates.empty() ? 0 : candidates[0];  // only a row of NaNs gets here
    // Draw in vocabulary order among the kept tokens.
    std::sort(candidates.begin(), candidates.begin() + kept);
    double kept_mass = 0.0;
    for (int64_t j = 0; j < kept; ++j) kept_mass += e[candidates[j]];
    const double target = f.uniform * kept_mass;
    double sum = 0.0;
    for (int64_t j = 0; j < kept; ++j) {
      sum += e[candidates[j]];
      if (sum > target) return candidates[j];
    }
    return candidates[kept - 1];
  }
  return 0;  // unreachable: the last shift holds every token of positive weight
}

// float lanes for the row scans below: max (a NaN in `a` leaves `b`), and bit masks of NaN and equal lanes.
#if defined(__AVX512F__)
struct Lanes {
  using Vec = __m512;
  static constexpr int64_t kCount = 16;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(float f) { return _mm512_set1_ps(f); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
  static uint32_t nan_bits(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  static uint32_t equal_bits(Vec v, Vec m) { return _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ); }
};
#elif defined(__AVX2__)
struct Lanes {
  using Vec = __m256;
  static constexpr int64_t kCount = 8;
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec broadcast(float f) { return _mm256_set1_ps(f); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static float reduce_max(Vec v) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    return *std::max_element(lanes, lanes + 8);
  }
  static uint32_t nan_bits(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  static uint32_t equal_bits(Vec v, Vec m) { return _mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ)); }
};
#endif

// The row's largest value, NaNs passed over (-inf for a row of NaNs), and whether it holds a NaN. GCC keeps
// `omp simd reduction(max)` to one vector's latency chain; four accumulators run ten times faster
// (docs/performance.md#measurements-behind-choices-in-the-code).
float row_max(const float* x, int64_t vocab, bool& nan) {
  float max = -std::numeric_limits<float>::infinity();
  nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  using Vec = Lanes::Vec;
  Vec acc[4] = {Lanes::broadcast(max), Lanes::broadcast(max), Lanes::broadcast(max), Lanes::broadcast(max)};
  uint32_t nans = 0;
  for (; i + 4 * Lanes::kCount <= vocab; i += 4 * Lanes::kCount)
    for (int u = 0; u < 4; ++u) {
      const Vec v = Lanes::load(x + i + u * Lanes::kCount);
      nans |= Lanes::nan_bits(v);
      acc[u] = Lanes::max(v, acc[u]);
    }
  max = Lanes::reduce_max(Lanes::max(Lanes::max(acc[0], acc[1]), Lanes::max(acc[2], acc[3])));
  nan = nans != 0;
#endif
  for (; i < vocab; ++i) {
    nan |= x[i] != x[i];
    max = std::max(max, x[i]);
  }
  return max;
}

// The first index of the row's largest value, a NaN counting as larger than any number: torch.argmax's
// pick. PyTorch's CPU argmax walks one row in scalar steps, 15-20 times slower (the same row of the docs).
int64_t argmax_row(const float* x, int64_t vocab) {
  bool nan = false;
  const float max = row_max(x, vocab, nan);
  int64_t i = 0;
#ifdef __AVX2__
  const Lanes::Vec target = Lanes::broadcast(max);
  for (; i + Lanes::kCount <= vocab; i += Lanes::kCount) {
    const Lanes::Vec v = Lanes::load(x + i);
    const uint32_t hits = nan ? Lanes::nan_bits(v) : Lanes::equal_bits(v, target);
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < vocab; ++i)
    if (nan ? x[i] != x[i] : x[i] == max) return i;
  return 0;  // unreachable: max or a NaN is one of the row's values
}

int64_t sample_row(const float* x, int64_t vocab, const RowFilter& f, std::vector<float>& e,
                   std::vector<double>& blocks, std::vector<int32_t>& candidates) {
  bool nan = false;
  const float max = row_max(x, vocab, nan);
  if (!(max > -std::numeric_limits<float>::infinity())) return 0;  // every token disallowed: argmax's pick
  const bool cut = f.top_k < vocab || f.top_p < 1.0;
  // min_p alone is a threshold on z, applied in the exp pass; with a cut it applies after top-p's mass.
  const double total = exp_row(x, vocab, max, f, !cut, e.data(), blocks);
  if (cut) return draw_cut(x, e.data(), vocab, max, total, f, candidates);
  return draw_all(e.data(), vocab, blocks, f.uniform * total);
}

}  // namespace

// tokens[i] for each row of `logits` (float32 [rows, vocab]), drawn from its filtered distribution with the
// uniform number in `spec`, a float64 [5, rows]: temperature, top_k (0: none), top_p, min_p, uniform.
at::Tensor sample_rows(at::Tensor logits, at::Tensor spec) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_rows: logits must be contiguous float32 [rows, vocab], got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(spec.dim() == 2 && spec.size(0) == 5 && spec.size(1) == rows &&
                  spec.scalar_type() == at::kDouble && spec.is_contiguous(),
              "sample_rows: spec must be contiguous float64 [5, ", rows, "], got ", spec.sizes(), " ",
              spec.scalar_type());
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "sample_rows: vocab must be in [1, 2^31), got ", vocab);
  const double* s = spec.data_ptr<double>();
  std::vector<RowFilter> filters(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const double temperature = s[r], top_k = s[rows + r], top_p = s[2 * rows + r], min_p = s[3 * rows + r],
                 uniform = s[4 * rows + r];
    TORCH_CHECK(temperature > 0.0, "sample_rows: row ", r, " has temperature ", temperature, "; it must be > 0");
    TORCH_CHECK(0.0 < top_p && 0.0 <= min_p && min_p <= 1.0 && 0.0 <= uniform && uniform < 1.0,
                "sample_rows: row ", r, " needs top_p in (0, 1], min_p in [0, 1] and uniform in [0, 1), got ",
                top_p, ", ", min_p, ", ", uniform);
    filters[r] = {static_cast<float>(1.0 / temperature),
                  top_k > 0 && top_k < static_cast<double>(vocab) ? static_cast<int64_t>(top_k) : vocab, top_p,
                  min_p > 0.0 ? std::log(static_cast<float>(min_p)) : -std::numeric_limits<float>::infinity(),
                  uniform};
  }
  auto tokens = at::empty({rows}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(vocab);
    std::vector<double> blocks((vocab + kWalkBlock - 1) / kWalkBlock);
    std::vector<int32_t> candidates;
    for (int64_t r = begin; r < end; ++r) out[r] = sample_row(x + r * vocab, vocab, filters[r], e, blocks, candidates);
  });
  return tokens;
}

// tokens[i]: the argmax of each row of `logits` (float32 [rows, vocab]), as torch.argmax(dim=-1) picks it.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: logits must be contiguous float32 [rows, vocab] with vocab > 0, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = at::empty({rows}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * vocab, vocab);
  });
  return tokens;
}
