// The register tile shared by the float and the quantized linear kernels: a few rows of x (fp32) against
// one or two weight rows, 8 lanes of fp32 accumulators each.
//
// Every output element is summed in one order whatever the number of rows, the threads, or where the
// weights came from: lane l adds the products k = l mod 8 in order of k, the lanes are added in a fixed
// tree, then the tail k >= K - K%8, then the bias; the result is rounded to the dtype once. So a row's
// result does not depend on the rows beside it (a sequence decodes the same alone as in a small batch, and
// a speculative verification row equals the decode step it replaces), and a quantized weight gives exactly
// what its dequantized float32 copy gives in linear_few_rows.
#pragma once

#include "cpu_common.h"

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NANOVLLM_LINEAR_AVX2 1
#endif

namespace {

// Rows of x per pass over the weights: 2 weight rows x 6 tile rows of accumulators, two weight vectors
// and one x vector fill the 16 AVX2 registers; above 6 rows one weight row at a time (8 accumulators). At 1
// or 2 rows, 4 weight rows at a time: each accumulator is a chain of dependent FMAs (4 cycles each), and
// with 2 chains one row of x took 8 bytes of bf16 weights a cycle, about half what two cores can read
// (fp32 weights read from memory take one weight row a pass instead: linear_cpu.cpp's tile_from_memory).
// Which weight rows share a pass never changes an output's sum, only how many are in flight.
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

#ifdef __AVX512BW__
// 16 consecutive values widened to fp32 (`mask` of them; the rest 0).
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }
#endif

// The 8 lanes' sum, in a fixed order: (l0+l4 + l2+l6) + (l1+l5 + l3+l7).
inline float hsum8(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#endif

// Where the vector loop stops: K rounded down to 8 with AVX2, 0 without (then the tail loop does all of k).
inline int64_t vector_end(int64_t K) {
#ifdef NANOVLLM_LINEAR_AVX2
  return K - K % 8;
#else
  return 0;
#endif
}

// out[m][r] = x[m] . w[r] over k in [0, k_vec): the vector part.
template <int M, int R, typename T, bool kPrefetch = true>
inline void dot_tile(const float* x, int64_t K, const T* const* w, int64_t k_vec, float (*out)[R]) {
#ifdef NANOVLLM_LINEAR_AVX2
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_vec; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w[r] + k);
    if constexpr (kPrefetch) for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kPrefetchRows * K + k), _MM_HINT_T0);
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

// Output columns [n_begin, n_end) for the M rows of x (fp32, [M, K]): weight row n is w_first + (n -
// n_begin) * K; y is [rows, N], this tile's rows starting at y. R weight rows a pass: by default as many as
// keep enough FMA chains in flight with the registers M rows of x leave.
template <int M, typename T, typename Y, int R = (M <= 2 ? 4 : M <= 6 ? 2 : 1), bool kPrefetch = true>
void tile_rows(const float* x, const T* w_first, const Y* bias, Y* y, int64_t n_begin, int64_t n_end, int64_t N,
               int64_t K) {
  const int64_t k_vec = vector_end(K);
  for (int64_t n = n_begin; n < n_end; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n_end - n));
    const T* w_rows[R];
    for (int r = 0; r < R; ++r) w_rows[r] = w_first + (n - n_begin + std::min(r, rows - 1)) * K;  // a missing row repeats the last
    float sums[M][R];
    dot_tile<M, R, T, kPrefetch>(x, K, w_rows, k_vec, sums);
    for (int r = 0; r < rows; ++r) {
      const T* wr = w_rows[r];
      for (int m = 0; m < M; ++m) {
        float s = sums[m][r];
        for (int64_t k = k_vec; k < K; ++k) s += x[m * K + k] * load(wr[k]);
        if (bias != nullptr) s += load(bias[n + r]);
        y[m * N + n + r] = to<Y>(s);
      }
    }
  }
}

template <typename T, typename Y>
using TileFn = void (*)(const float*, const T*, const Y*, Y*, int64_t, int64_t, int64_t, int64_t);

// The tile function for 1 to kTileRows rows of x.
template <typename T, typename Y>
TileFn<T, Y> tile_fn(int64_t rows) {
  static const TileFn<T, Y> table[kTileRows] = {tile_rows<1, T, Y>, tile_rows<2, T, Y>, tile_rows<3, T, Y>,
                                                tile_rows<4, T, Y>, tile_rows<5, T, Y>, tile_rows<6, T, Y>,
                                                tile_rows<7, T, Y>, tile_rows<8, T, Y>};
  return table[rows - 1];
}

// x widened to fp32 once: every weight row reads it from cache.
template <typename T>
std::vector<float> widen(const T* x, int64_t count) {
  std::vector<float> xf(count);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) xf[i] = load(x[i]);
  return xf;
}

}  // namespace
