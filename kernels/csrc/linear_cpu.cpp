// y = x W^T (+ b) for a few rows of x: the decoder's projections at small batch and speculative
// verification (the last token plus K proposals per sequence).
//
// With few rows a CPU matmul is bound by reading the weights, not by arithmetic, yet PyTorch's float32
// GEMM at 2 to 8 rows takes about as long as at 64 (2026-11-25, AMD EPYC AVX2, SmolLM2-135M's 30 layers
// and LM head: 70 ms at 2 rows, 39 ms at 1, against 25 and 21 ms here). Here each weight row is read once,
// from memory into registers, and serves every row of x: a tile of up to kTileRows rows of x (widened to
// fp32 once, then read from L1) against two weight rows at a time, 8 lanes of fp32 accumulators each.
//
// Every output element is summed in the same order whatever the number of rows and threads: lane l adds
// the products k = l mod 8 in order of k, the lanes are added in a fixed tree, then the tail k >= K - K%8,
// then the bias; the result is rounded to the dtype once. So a row's result does not depend on the rows
// beside it (a sequence decodes the same alone as in a small batch, and a verification row equals the
// decode step it replaces).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_common.h"

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOVLLM_LINEAR_AVX2 1
#endif

namespace {

// Rows of x per pass over the weights: 2 weight rows x 6 tile rows of accumulators, two weight vectors
// and one x vector fill the 16 AVX2 registers; above 6 rows one weight row at a time (8 accumulators).
constexpr int64_t kTileRows = 8;
// Weight rows ahead of the ones being read that the loop asks the memory for. With more than one row of x
// the arithmetic per weight is enough that the hardware prefetcher alone leaves the memory idle between
// bursts: SmolLM2-135M's projections at 5 rows took 1.45x the time of 1 row without this, about 1.05x with
// it (bench/cpu_kernels.py --only projections). A prefetch past the end of the weights is dropped, not a
// fault.
constexpr int64_t kPrefetchRows = 8;

#ifdef NANOVLLM_LINEAR_AVX2
// 8 consecutive weights widened to fp32 (exact for every dtype).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 lanes' sum, in a fixed order: (l0+l4 + l2+l6) + (l1+l5 + l3+l7).
inline float hsum8(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif

// out[m][r] = x[m] . w[r] over k in [0, k_vec): the vector part, or 0 without AVX2 (then the tail loop
// does all of k).
template <int M, int R, typename T>
inline void dot_tile(const float* x, int64_t K, const T* const* w, int64_t k_vec, float (*out)[R]) {
#ifdef NANOVLLM_LINEAR_AVX2
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_vec; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w[r] + k);
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kPrefetchRows * K + k), _MM_HINT_T0);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum8(acc[m][r]);
#else
  (void)x, (void)K, (void)w, (void)k_vec;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = 0.f;
#endif
}

// Weight rows [n_begin, n_end) against the M rows of x (fp32, [M, K]); y is [rows, N], this tile's rows
// starting at y.
template <int M, typename T>
void tile_rows(const float* x, const T* w, const T* bias, T* y, int64_t n_begin, int64_t n_end, int64_t N,
               int64_t K) {
  constexpr int R = M <= 6 ? 2 : 1;
#ifdef NANOVLLM_LINEAR_AVX2
  const int64_t k_vec = K - K % 8;
#else
  const int64_t k_vec = 0;
#endif
  for (int64_t n = n_begin; n < n_end; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n_end - n));
    const T* w_rows[R];
    for (int r = 0; r < R; ++r) w_rows[r] = w + (n + std::min(r, rows - 1)) * K;  // a missing row repeats the last
    float sums[M][R];
    dot_tile<M, R>(x, K, w_rows, k_vec, sums);
    for (int r = 0; r < rows; ++r) {
      const T* wr = w_rows[r];
      for (int m = 0; m < M; ++m) {
        float s = sums[m][r];
        for (int64_t k = k_vec; k < K; ++k) s += x[m * K + k] * load(wr[k]);
        if (bias != nullptr) s += load(bias[n + r]);
        y[m * N + n + r] = to<T>(s);
      }
    }
  }
}

template <typename T>
using TileFn = void (*)(const float*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t);

template <typename T>
TileFn<T> tile_fn(int64_t rows) {
  static const TileFn<T> table[kTileRows] = {tile_rows<1, T>, tile_rows<2, T>, tile_rows<3, T>, tile_rows<4, T>,
                                             tile_rows<5, T>, tile_rows<6, T>, tile_rows<7, T>, tile_rows<8, T>};
  return table[rows - 1];
}

template <typename T>
void linear_impl(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t N, int64_t K) {
  std::vector<float> xf(rows * K);  // x widened once; every weight row reads it from cache
#pragma omp simd
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = load(x[i]);
  // Contiguous ranges of weight rows, 64 at least, an even count so that row pairs never straddle.
  at::parallel_for(0, (N + 1) / 2, 32, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * 2, n_end = std::min(N, end * 2);
    for (int64_t m = 0; m < rows; m += kTileRows) {
      const int64_t tile = std::min(kTileRows, rows - m);
      tile_fn<T>(tile)(xf.data() + m * K, w, bias, y + m * N, n_begin, n_end, N, K);
    }
  });
}

}  // namespace

// x [rows, K], weight [N, K], bias [N] or None, one dtype; returns [rows, N] in it. Any number of rows is
// correct; the layers call it for few rows only (kernels/cpu_kernels.py FEW_ROWS_MAX), where it is faster.
torch::Tensor linear_few_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_few_rows: x [rows, K] and weight [N, K] must share K, got x ", x.sizes(), " and weight ",
              weight.sizes());
  check_one_dtype("linear_few_rows", {{"x", &x}, {"weight", &weight}});
  if (bias.has_value()) {
    check_one_dtype("linear_few_rows", {{"x", &x}, {"bias", &*bias}});
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "linear_few_rows: bias must be [",
                weight.size(0), "], got ", bias->sizes());
  }
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t rows = x.size(0), N = weight.size(0), K = x.size(1);
  auto y = torch::empty({rows, N}, x.options());
  if (rows == 0) return y;
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  dispatch("linear_few_rows", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    linear_impl(x.data_ptr<T>(), weight.data_ptr<T>(), b.defined() ? b.data_ptr<T>() : nullptr, y.data_ptr<T>(),
                rows, N, K);
  });
  return y;
}
