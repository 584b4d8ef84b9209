// y = x W^T (+ b) with W stored as 8- or 4-bit integers in groups along the input features, each group
// with an fp16 scale s (and for 4 bits an fp16 min m): w = s * q (8 bits, q signed) or w = s * q + m
// (4 bits, q in [0, 15]). The layout is GGUF's (Q8_0, Q4_0, Q4_1 split into planes): 4-bit weights come in
// blocks of 32, byte j of a block holding weight j in its low nibble and weight 16 + j in its high one.
//
// On a CPU one decode stream is bound by reading the weights, and 4 bits read a quarter of what bf16 does.
// Each weight is widened to fp32 exactly (s * q is exact: an fp16 times an integer of at most 8 bits fits
// fp32's mantissa, so adding m rounds once, as gguf's own dequantization does), then summed in
// linear_tile.h's order. So with `exact` the result equals linear_few_rows on the dequantized float32
// weights, bit for bit, whatever the number of rows, as long as the rows are dequantized in registers or
// panels. Without it (the engine's default), on a CPU with AVX512-VNNI or AVX2, x is quantized to int8
// instead and meets the weights in integer dots (linear_int8_dots.h: within a stated bound of the exact
// product, not bit-equal) up to kDirectRows rows of 16-bit x and kPanelMaxRows of float32 x: dequantizing
// every weight to fp32 is arithmetic-bound, on AVX2 at about half the memory's rate. The exact paths:
// - up to kDirectRows (8) rows of x, weights are dequantized into registers as they are read;
// - with x in float32, up to kPanelMaxRows, each thread dequantizes a panel of kPanelRows weight rows into
//   an fp32 scratch that stays in cache, and runs the float tile over every row of x against it, six rows
//   of x against two weight rows a pass (arithmetic-bound);
// - above that (prefill, large decode batches), the whole weight is dequantized to x's dtype and PyTorch's
//   GEMM multiplies it, summing in its own order (close to the panels, not bit-equal). With 16-bit x the
//   GEMM starts right after the registers: a CPU with native bf16 runs it on AMX or AVX512_BF16, and the
//   float engine runs such batches in PyTorch's 16-bit GEMM too. What each path costs against the others:
//   docs/performance.md (Weight-only quantized matmuls, Deterministic inference).
// With batch_invariant (the engine's --deterministic) the GEMM never runs. x on a CPU with the integer
// dots, not `exact`, takes them at every row count, in tiles of 8 rows of x: a row's int8 quantization, its int32
// dots and the float work after them are the same instructions whatever the tile, so one kernel serves
// decode and prefill. Otherwise every row count takes the registers or the panels. Either way each row's
// result is the same whatever rows are beside it.
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include <ATen/Parallel.h>

#include "linear_int8_dots.h"
#include "linear_tile.h"
#include "parallel_rows.h"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;       // weights per 4-bit block (and the smallest group)
constexpr int64_t kDirectRows = 8;   // rows of x up to which weights are dequantized in registers
constexpr int64_t kPanelRows = 48;   // weight rows per fp32 panel above that (48 x K floats: L2-sized)
// A panel pass: 6 rows of x against 2 weight rows, 12 accumulators (linear_tile.h's widest tile; 8 x 1
// reloads the weights' lanes for every row). The panel is in cache: no prefetch.
constexpr int kPanelTileRows = 6, kPanelTileWeights = 2;
constexpr int64_t kPanelMaxRows = 64;  // rows of x up to which the panels run, PyTorch's GEMM above
// Bytes of weights the integer dots run every tile of x's rows over before the next (above 8 rows of x):
// a block stays in L2 while x's tiles pass, instead of coming from memory once per tile.
constexpr int64_t kDotBlockBytes = 256 * 1024;

template <int BITS>
inline QRow qrow(const uint8_t* q, const c10::Half* s, const c10::Half* m, int64_t n, int64_t K, int64_t groups) {
  return {q + n * (K * BITS / 8), s + n * groups, m == nullptr ? nullptr : m + n * groups};
}

// A packed weight's rows, each found when a tile asks for it: a table of every row's planes built per call
// was 24 bytes a row written and read again (6 MB for Qwen3.5's 248,320-row head at one row of x).
template <int BITS>
struct PackedRows {
  const uint8_t* q;
  const c10::Half* s;
  const c10::Half* m;
  int64_t K, groups;
  QRow operator[](int64_t n) const { return qrow<BITS>(q, s, m, n, K, groups); }
};

// Row `row`'s K weights as fp32 into out (the panel path and machines without AVX2).
template <int BITS>
void dequantize_row(const QRow& row, int64_t K, int64_t group, float* out) {
  for (int64_t g = 0; g < K / group; ++g) {
    const float s = load(row.s[g]), m = row.m == nullptr ? 0.f : load(row.m[g]);
    float* o = out + g * group;
    if constexpr (BITS == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row.q) + g * group;
#pragma omp simd
      for (int64_t k = 0; k < group; ++k) o[k] = s * static_cast<float>(q[k]);
    } else {
      for (int64_t b = 0; b < group; b += kBlock) {
        const uint8_t* q = row.q + (g * group + b) / 2;
#pragma omp simd
        for (int64_t j = 0; j < kBlock / 2; ++j) {
          o[b + j] = s * static_cast<float>(q[j] & 0x0F) + m;
          o[b + kBlock / 2 + j] = s * static_cast<float>(q[j] >> 4) + m;
        }
      }
    }
  }
}

#ifdef NANOVLLM_LINEAR_AVX2
// An fp16 scale or min broadcast to 8 lanes by F16C (cpu_common.h's portable conversion is a dozen scalar
// instructions, paid per group and weight row here).
inline __m256 broadcast_half(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(p->x)));
}

// Weights [8j, 8j + 8) of a 32-weight block, widened to fp32 (before scaling): for 4 bits `lo` / `hi` are
// the block's 16 bytes masked to their low / high nibbles.
template <int BITS>
inline __m256 block_part(const uint8_t* block, __m128i lo, __m128i hi, int j) {
  if constexpr (BITS == 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * j));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else {
    const __m128i half = j < 2 ? lo : hi;
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(j % 2 == 0 ? half : _mm_srli_si128(half, 8)));
  }
}

// out[m][r] = x[m] . w[r] over all of K (a multiple of 32), weights dequantized in registers, lanes
// summed as dot_tile sums them.
template <int M, int R, int BITS>
inline void qdot_tile(const float* x, int64_t K, int64_t group, const QRow* rows, float (*out)[R]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / group; ++g) {
    __m256 sv[R], mv[R];
    for (int r = 0; r < R; ++r) {
      sv[r] = broadcast_half(rows[r].s + g);
      mv[r] = BITS == 8 ? _mm256_setzero_ps() : broadcast_half(rows[r].m + g);  // 4 bits always have mins
    }
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kBlock) {
      const uint8_t* block[R];
      __m128i lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        block[r] = rows[r].q + k0 * BITS / 8;
        _mm_prefetch(reinterpret_cast<const char*>(block[r] + kPrefetchRows * K * BITS / 8), _MM_HINT_T0);
        if constexpr (BITS == 4) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[r]));
          lo[r] = _mm_and_si128(bytes, low4);
          hi[r] = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        }
      }
      for (int j = 0; j < 4; ++j) {
        __m256 wv[R];
        for (int r = 0; r < R; ++r) {
          const __m256 q = block_part<BITS>(block[r], lo[r], hi[r], j);
          wv[r] = BITS == 8 ? _mm256_mul_ps(sv[r], q) : _mm256_fmadd_ps(sv[r], q, mv[r]);
        }
        for (int m = 0; m < M; ++m) {
          const __m256 xv = _mm256_loadu_ps(x + m * K + k0 + 8 * j);
          for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum8(acc[m][r]);
}
#endif

// Output columns [n_begin, n_end) for M rows of x, R weight rows at a time: tile(w, sums) fills sums[m][r]
// with x[m] . w[r]; the bias is added and each output rounded to T once.
template <int M, int R, int BITS, typename T, typename Tile>
void for_each_tile(const PackedRows<BITS>& weights, const T* bias, T* y, int64_t n_begin, int64_t n_end, int64_t N,
                   Tile&& tile) {
  for (int64_t n = n_begin; n < n_end; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n_end - n));
    QRow w[R];
    for (int r = 0; r < R; ++r) w[r] = weights[n + std::min(r, rows - 1)];  // a missing row repeats the last
    float sums[M][R];
    tile(w, sums);
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m) {
        float s = sums[m][r];
        if (bias != nullptr) s += load(bias[n + r]);
        y[m * N + n + r] = to<T>(s);
      }
  }
}

// Output columns [n_begin, n_end) for M (<= kDirectRows) rows of x, weights dequantized as they are read.
template <int M, int BITS, typename T>
void direct_rows(const float* x, const PackedRows<BITS>& weights, const T* bias, T* y, int64_t n_begin, int64_t n_end,
                 int64_t N, int64_t K, int64_t group) {
#ifdef NANOVLLM_LINEAR_AVX2
  // Two weight rows at a time up to 4 rows of x (4 measured no faster at one row), one above, where the
  // accumulators take the registers.
  constexpr int R = M <= 4 ? 2 : 1;
  for_each_tile<M, R>(weights, bias, y, n_begin, n_end, N,
                      [&](const QRow* w, float (*sums)[R]) { qdot_tile<M, R, BITS>(x, K, group, w, sums); });
#else
  (void)x, (void)weights, (void)bias, (void)y, (void)n_begin, (void)n_end, (void)N, (void)K, (void)group;
  TORCH_CHECK(false, "linear_quantized: the register path needs AVX2");
#endif
}

template <int BITS, typename T>
using DirectFn = void (*)(const float*, const PackedRows<BITS>&, const T*, T*, int64_t, int64_t, int64_t, int64_t,
                          int64_t);

template <int BITS, typename T>
DirectFn<BITS, T> direct_fn(int64_t rows) {
  static const DirectFn<BITS, T> table[kDirectRows] = {
      direct_rows<1, BITS, T>, direct_rows<2, BITS, T>, direct_rows<3, BITS, T>, direct_rows<4, BITS, T>,
      direct_rows<5, BITS, T>, direct_rows<6, BITS, T>, direct_rows<7, BITS, T>, direct_rows<8, BITS, T>};
  return table[rows - 1];
}

#ifdef NANOVLLM_INT8_DOTS
// out[r] = sums[r] (+ bias[r]) rounded to T, `count` outputs in one vectorisable pass.
template <typename T>
inline void store_rows(const float* sums, const T* bias, T* out, int64_t count) {
  if (bias == nullptr) {
#pragma omp simd
    for (int64_t r = 0; r < count; ++r) out[r] = to<T>(sums[r]);
  } else {
#pragma omp simd
    for (int64_t r = 0; r < count; ++r) out[r] = to<T>(sums[r] + load(bias[r]));
  }
}

#ifdef NANOVLLM_INT8_DOTS_VNNI
// int8 per channel (one scale a row): int8_row_scale_sums over 64 weight rows at a time, then each output's
// scale, bias and rounding to T in one vectorisable pass, as for_each_tile computes them one by one.
template <int M, typename T>
void int8_row_scale_rows(const QuantizedRow* x, const std::vector<ChunkGroups>& chunks, const PackedRows<8>& weights,
                         const T* bias, T* y, int64_t n_begin, int64_t n_end, int64_t N) {
  constexpr int64_t kRows = 64;
  float sums[M * kRows];
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int64_t count = std::min(kRows, n_end - n);
    int8_row_scale_sums<M>(x, chunks, weights.q + n * weights.K, weights.K, count, sums);
    const c10::Half* scales = weights.s + n;
    for (int m = 0; m < M; ++m) {
      const float* sum = sums + m * count;
      T* out = y + m * N + n;
      if (bias == nullptr) {
#pragma omp simd
        for (int64_t r = 0; r < count; ++r) out[r] = to<T>(sum[r] * load(scales[r]));
      } else {
#pragma omp simd
        for (int64_t r = 0; r < count; ++r) out[r] = to<T>(sum[r] * load(scales[r]) + load(bias[n + r]));
      }
    }
  }
}

// 4-bit weights in groups of 32: int4_group32_sums over 64 weight rows at a time, then the bias and each
// output's rounding to T in one vectorisable pass.
template <int M, typename T>
void int4_group32_rows(const QuantizedRow* x, const PackedRows<4>& weights, const T* bias, T* y, int64_t n_begin,
                       int64_t n_end, int64_t N) {
  constexpr int64_t kRows = 64;
  float sums[M * kRows];
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int64_t count = std::min(kRows, n_end - n);
    const QRow first = weights[n];
    int4_group32_sums<M>(x, weights.K, first.q, first.s, first.m, count, sums);
    for (int m = 0; m < M; ++m) store_rows(sums + m * count, bias == nullptr ? nullptr : bias + n, y + m * N + n, count);
  }
}

#endif

// 4-bit groups of 32 with rows interleaved: int4_rows16_sums over tiles [t_begin, t_end), then the bias and
// each output's rounding to T.
template <int M, typename T>
void int4_rows16_rows(const QuantizedRow* x, const uint8_t* q, const c10::Half* scales, const c10::Half* mins,
                      int64_t K, const T* bias, T* y, int64_t t_begin, int64_t t_end, int64_t N) {
  const int64_t tile_bytes = kInterleavedRows * K / 2, tile_groups = kInterleavedRows * (K / kDotBlock);
  float sums[M][kInterleavedRows];
  for (int64_t t = t_begin; t < t_end; ++t) {
    int4_rows16_sums<M>(x, K, q + t * tile_bytes, scales + t * tile_groups, mins + t * tile_groups, sums);
    const int64_t n = t * kInterleavedRows;
    for (int m = 0; m < M; ++m)
      store_rows(sums[m], bias == nullptr ? nullptr : bias + n, y + m * N + n, kInterleavedRows);
  }
}

// 8-bit weights with one scale a row, rows interleaved: int8_rows16_sums over tiles [t_begin, t_end), then each
// row's scale, the bias and each output's rounding to T.
template <int M, typename T>
void int8_rows16_rows(const QuantizedRow* x, const uint8_t* q, const c10::Half* scales, const c10::Half* mins,
                      int64_t K, const T* bias, T* y, int64_t t_begin, int64_t t_end, int64_t N) {
  (void)mins;
  const int64_t tile_bytes = kInterleavedRows * K;
  float sums[M][kInterleavedRows];
  for (int64_t t = t_begin; t < t_end; ++t) {
    int8_rows16_sums<M>(x, K, q + t * tile_bytes, sums);
    const int64_t n = t * kInterleavedRows;
    for (int m = 0; m < M; ++m) {
#pragma omp simd
      for (int64_t r = 0; r < kInterleavedRows; ++r) sums[m][r] *= load(scales[n + r]);
      store_rows(sums[m], bias == nullptr ? nullptr : bias + n, y + m * N + n, kInterleavedRows);
    }
  }
}

template <typename T>
using Rows16Fn = void (*)(const QuantizedRow*, const uint8_t*, const c10::Half*, const c10::Half*, int64_t, const T*,
                          T*, int64_t, int64_t, int64_t);

// The interleaved loop at BITS bits for 1 + M rows of x, by M (`rows` of them: table[rows - 1]).
template <int BITS, typename T, int... M>
Rows16Fn<T> rows16_fn(int64_t rows, std::integer_sequence<int, M...>) {
  static const Rows16Fn<T> table[] = {(BITS == 4 ? int4_rows16_rows<M + 1, T> : int8_rows16_rows<M + 1, T>)...};
  return table[rows - 1];
}

// Output columns [n_begin, n_end) for M (<= kDirectRows) rows of x quantized to int8 (linear_int8_dots.h).
template <int M, int BITS, typename T>
void int8_dot_rows(const QuantizedRow* x, const std::vector<ChunkGroups>& chunks, const PackedRows<BITS>& weights,
                   const T* bias, T* y, int64_t n_begin, int64_t n_end, int64_t N, int64_t K, int64_t group) {
#ifdef NANOVLLM_INT8_DOTS_VNNI
  if constexpr (BITS == 8) {
    if (group == K) return int8_row_scale_rows<M>(x, chunks, weights, bias, y, n_begin, n_end, N);
  } else {
    if (group == kDotBlock) return int4_group32_rows<M>(x, weights, bias, y, n_begin, n_end, N);
  }
#endif
  // With VNNI one weight row at a time at every row count: faster than four (two from 3 rows of x) at every
  // row count measured (docs/performance.md, Weight-only quantization). With AVX2 one at 1-2 rows of x, two
  // at 3-4 and four above, where each row of x's loads then serve several weight rows (measured faster at 8
  // rows of x, most for 4-bit weights: docs/performance.md, Measurements behind choices in the code). Which
  // rows share a pass never changes a sum.
#ifdef NANOVLLM_INT8_DOTS_VNNI
  constexpr int R = 1;
#else
  constexpr int R = M <= 2 ? 1 : M <= 4 ? 2 : 4;
#endif
  for_each_tile<M, R>(weights, bias, y, n_begin, n_end, N,
                      [&](const QRow* w, float (*sums)[R]) { int8_dot_tile<M, R, BITS>(x, chunks, w, K, group, sums); });
}

template <int BITS, typename T>
using Int8DotFn = void (*)(const QuantizedRow*, const std::vector<ChunkGroups>&, const PackedRows<BITS>&, const T*,
                           T*, int64_t, int64_t, int64_t, int64_t, int64_t);

template <int BITS, typename T>
Int8DotFn<BITS, T> int8_dot_fn(int64_t rows) {
  static const Int8DotFn<BITS, T> table[kDirectRows] = {
      int8_dot_rows<1, BITS, T>, int8_dot_rows<2, BITS, T>, int8_dot_rows<3, BITS, T>, int8_dot_rows<4, BITS, T>,
      int8_dot_rows<5, BITS, T>, int8_dot_rows<6, BITS, T>, int8_dot_rows<7, BITS, T>, int8_dot_rows<8, BITS, T>};
  return table[rows - 1];
}
#endif

// Whether the integer dots read chunk_groups' table at this group size: not int4_group32_rows (VNNI, 4-bit
// groups of 32), which spreads each chunk's scales by permutations held in registers.
template <int BITS>
bool takes_chunk_groups(int64_t group) {
#ifdef NANOVLLM_INT8_DOTS_VNNI
  return BITS == 8 || group != kDotBlock;
#else
  (void)group;
  return true;
#endif
}

template <int BITS, typename T>
void linear_quantized_impl(const T* x, const uint8_t* q, const c10::Half* scales, const c10::Half* mins,
                           const T* bias, T* y, int64_t rows, int64_t N, int64_t K, int64_t group,
                           bool batch_invariant, bool interleaved, bool exact) {
  const int64_t groups = K / group;
  const PackedRows<BITS> weights{q, scales, mins, K, groups};
  if (nanovllm::DecodeTeam* team = nanovllm::DecodeTeam::current()) {
    const nanovllm::Stream packed{reinterpret_cast<const char*>(q), N * K * BITS / 8},
        scale_rows{reinterpret_cast<const char*>(scales), N * groups * 2},
        min_rows{reinterpret_cast<const char*>(mins), mins != nullptr ? N * groups * 2 : 0};
    team->reads({packed, scale_rows, min_rows});
  }
#ifdef NANOVLLM_INT8_DOTS
  // float32 x takes them where it would take the panels, 16-bit x where it would take the registers.
  if (!exact) {
    if (rows <= (std::is_same_v<T, float> ? kPanelMaxRows : kDirectRows) || batch_invariant) {
      // A decode call's rows of x keep their memory in the calling thread from call to call; a prefill's
      // many rows (with batch_invariant) take memory of their own.
      thread_local std::vector<QuantizedRow> kept(kDirectRows);
      std::vector<QuantizedRow> own(rows > kDirectRows ? rows : 0);
      QuantizedRow* xq = rows > kDirectRows ? own.data() : kept.data();
      for (int64_t m = 0; m < rows; ++m) quantize_row<BITS>(x + m * K, K, group, xq[m]);
      if (interleaved) {  // tiles of 16 rows, a block of them read by every tile of x's rows
        const int64_t tile_bytes = kInterleavedRows * K * BITS / 8;
        const int64_t block = std::max<int64_t>(1, kDotBlockBytes / tile_bytes);
        parallel_rows(N / kInterleavedRows, std::max<int64_t>(1, kClaimBytes / tile_bytes), [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; b += block)
            for (int64_t m = 0; m < rows; m += kDirectRows)
              rows16_fn<BITS, T>(std::min(kDirectRows, rows - m), std::make_integer_sequence<int, kDirectRows>())(
                  xq + m, q, scales, mins, K, bias, y + m * N, b, std::min(end, b + block), N);
        });
        return;
      }
      const std::vector<ChunkGroups> chunks =
          takes_chunk_groups<BITS>(group) ? chunk_groups<BITS>(K, group) : std::vector<ChunkGroups>();
      // Weight rows a block: about kDotBlockBytes of them, which every tile of x rows reads from cache.
      const int64_t block = std::max<int64_t>(4, kDotBlockBytes / (K * BITS / 8) / 4 * 4);
      // Whole 4-row tiles, 64 rows and kClaimBytes of weights a claim at least.
      const int64_t grain = std::max<int64_t>(16, kClaimBytes / (4 * K * BITS / 8));
      parallel_rows((N + 3) / 4, grain, [&](int64_t begin, int64_t end) {
        const int64_t n_begin = begin * 4, n_end = std::min(N, end * 4);
        for (int64_t b = n_begin; b < n_end; b += block) {
          const int64_t b_end = std::min(n_end, b + block);
          for (int64_t m = 0; m < rows; m += kDirectRows) {
            const int64_t tile = std::min(kDirectRows, rows - m);
            int8_dot_fn<BITS, T>(tile)(xq + m, chunks, weights, bias, y + m * N, b, b_end, N, K, group);
          }
        }
      });
      return;
    }
  }
#endif
  const std::vector<float> xf = widen(x, rows * K);
#ifdef NANOVLLM_LINEAR_AVX2
  const bool direct = rows <= kDirectRows;
#else
  const bool direct = false;
#endif
  // Weight row pairs (so that pairs never straddle), 64 rows at least a thread: the registers' pass reads the
  // weights once (parallel_rows), the panels' is bound by its arithmetic.
  if (direct) {
    const int64_t grain = std::max<int64_t>(32, kClaimBytes / (2 * K * BITS / 8));
    return parallel_rows((N + 1) / 2, grain, [&](int64_t begin, int64_t end) {
      direct_fn<BITS, T>(rows)(xf.data(), weights, bias, y, begin * 2, std::min(N, end * 2), N, K, group);
    });
  }
  nanovllm::parallel_for(0, (N + 1) / 2, 32, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * 2, n_end = std::min(N, end * 2);
    std::vector<float> panel(kPanelRows * K);
    for (int64_t p = n_begin; p < n_end; p += kPanelRows) {
      const int64_t p_end = std::min(n_end, p + kPanelRows);
      for (int64_t n = p; n < p_end; ++n)
        dequantize_row<BITS>(qrow<BITS>(q, scales, mins, n, K, groups), K, group, panel.data() + (n - p) * K);
      int64_t m = 0;
      for (; m + kPanelTileRows <= rows; m += kPanelTileRows)
        tile_rows<kPanelTileRows, float, T, kPanelTileWeights, false>(xf.data() + m * K, panel.data(), bias,
                                                                      y + m * N, p, p_end, N, K);
      if (m < rows) tile_fn<float, T>(rows - m)(xf.data() + m * K, panel.data(), bias, y + m * N, p, p_end, N, K);
    }
  });
}

#ifdef __AVX512F__
// 16 fp32 lanes rounded to nearest even in T, as to<T> rounds them (the tests compare bit for bit).
inline void store16(c10::BFloat16* out, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline void store16(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Row `row`'s K weights in 16-bit T, 16 lanes at a time, for the GEMM path: GCC's vectorisation of
// dequantize_row and the rounding loop took a fifth of a 64-row step (docs/performance.md#measurements-behind-choices-in-the-code).
template <int BITS, typename T>
void dequantize_row_16(const QRow& row, int64_t K, int64_t group, T* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / group; ++g) {
    const __m512 s = _mm512_set1_ps(load(row.s[g])), m = _mm512_set1_ps(row.m == nullptr ? 0.f : load(row.m[g]));
    for (int64_t b = g * group; b < (g + 1) * group; b += kBlock) {
      __m512 first, second;  // weights b .. b + 15 and b + 16 .. b + 31
      if constexpr (BITS == 8) {
        const auto* q = reinterpret_cast<const __m128i*>(row.q + b);
        first = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        second = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
      } else {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.q + b / 2));
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        first = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);  // s * q exact: one rounding
        second = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
      }
      store16(out + b, first);
      store16(out + b + 16, second);
    }
  }
}
#endif

// Row n of a weight with rows interleaved in the rows' own layout: at 4 bits (groups of 32) in `planes` (K / 2
// bytes, then K / 32 scales and as many mins); at 8 bits (one scale a row, which stays in place) its K bytes.
struct RowPlanes {
  std::vector<uint8_t> q;
  std::vector<c10::Half> s, m;
};
template <int BITS>
QRow interleaved_row(const uint8_t* q, const c10::Half* scales, const c10::Half* mins, int64_t n, int64_t K,
                     RowPlanes& planes) {
  const int64_t t = n / kInterleavedRows, r = n % kInterleavedRows, row_bytes = K * BITS / 8;
  planes.q.resize(row_bytes);
  const uint8_t* tile = q + t * kInterleavedRows * row_bytes;
  for (int64_t w = 0; w < row_bytes / 4; ++w)
    std::memcpy(planes.q.data() + 4 * w, tile + (w * kInterleavedRows + r) * 4, 4);
  if constexpr (BITS == 8) return {planes.q.data(), scales + n, nullptr};
  const int64_t groups = K / kBlock;
  planes.s.resize(groups), planes.m.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    planes.s[g] = scales[(t * groups + g) * kInterleavedRows + r];
    planes.m[g] = mins[(t * groups + g) * kInterleavedRows + r];
  }
  return {planes.q.data(), planes.s.data(), planes.m.data()};
}

// The whole weight [N, K] in `dtype`, or its rows `rows` (`count` of them) when given (each weight rounded
// from its exact fp32 value).
template <int BITS>
at::Tensor dequantize_all(const uint8_t* q, const c10::Half* scales, const c10::Half* mins, int64_t N, int64_t K,
                          int64_t group, at::ScalarType dtype, bool interleaved, const int64_t* rows = nullptr,
                          int64_t count = 0) {
  const int64_t out_rows = rows != nullptr ? count : N;
  auto w = at::empty({out_rows, K}, at::dtype(dtype));
  dispatch("linear_quantized", dtype, [&](auto zero) {
    using T = decltype(zero);
    T* out = w.data_ptr<T>();
    nanovllm::parallel_for(0, out_rows, 16, [&](int64_t begin, int64_t end) {
      RowPlanes planes;
      auto row_at = [&](int64_t i) {
        const int64_t n = rows != nullptr ? rows[i] : i;
        return interleaved ? interleaved_row<BITS>(q, scales, mins, n, K, planes) : qrow<BITS>(q, scales, mins, n, K, K / group);
      };
#ifdef __AVX512F__
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t n = begin; n < end; ++n) dequantize_row_16<BITS, T>(row_at(n), K, group, out + n * K);
        return;
      }
#endif
      std::vector<float> row(K);
      for (int64_t n = begin; n < end; ++n) {
        dequantize_row<BITS>(row_at(n), K, group, row.data());
        T* o = out + n * K;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) o[k] = to<T>(row[k]);
      }
    });
  });
  return w;
}

}  // namespace

// x [rows, K] in float32, bfloat16 or float16; qweight [N, K] int8 (bits 8) or [N, K / 2] uint8 (bits 4);
// scales and mins [N, K / group_size] float16 (mins only, and required, for 4 bits); bias [N] in x's dtype
// or None. Returns [rows, N] in x's dtype. batch_invariant: each row summed in one order at every row count.
// exact: x kept in its dtype, each weight dequantized exactly (never the integer dots).
namespace {

// Whether a weight of these bits and groups can have its rows interleaved (PackedWeight.can_interleave): 4 bits
// in groups of 32, or 8 with one scale a row; whole tiles of rows.
bool interleaves(int64_t bits, int64_t group_size, int64_t N, int64_t K) {
  return (bits == 4 ? group_size == kBlock : group_size == K) && N % kInterleavedRows == 0;
}

// A packed weight's planes for K input features (linear_quantized's and dequantize_rows' arguments).
void check_planes(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group_size, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && scales.dim() == 2, op, ": qweight and scales must be 2-d, got ", qweight.sizes(),
              ", ", scales.sizes());
  const int64_t N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0, op, ": group_size ", group_size,
              " must be a multiple of ", kBlock, " that divides the ", K, " input features");
  TORCH_CHECK(qweight.size(1) * 8 == K * bits, op, ": qweight must be [", N, ", ", K * bits / 8, "] for ", K,
              " input features at ", bits, " bits, got ", qweight.sizes());
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op, ": qweight must be ",
              bits == 8 ? "int8" : "uint8", " at ", bits, " bits, got ", qweight.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.size(0) == N && scales.size(1) == K / group_size, op,
              ": scales must be float16 [", N, ", ", K / group_size, "], got ", scales.scalar_type(), " ",
              scales.sizes());
  TORCH_CHECK(mins.has_value() == (bits == 4), op, ": mins are required at 4 bits and absent at 8");
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes(), op, ": mins must be float16 ",
                scales.sizes(), ", got ", mins->scalar_type(), " ", mins->sizes());
}

}  // namespace

at::Tensor linear_quantized(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                            c10::optional<at::Tensor> mins, int64_t bits, int64_t group_size,
                            c10::optional<at::Tensor> bias, bool batch_invariant, bool interleaved, bool exact) {
  TORCH_CHECK(x.dim() == 2, "linear_quantized: x must be 2-d, got ", x.sizes());
  const int64_t rows = x.size(0), K = x.size(1), N = qweight.size(0);
  check_planes("linear_quantized", qweight, scales, mins, bits, group_size, K);
  if (bias.has_value()) {
    check_one_dtype("linear_quantized", {{"x", &x}, {"bias", &*bias}});
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_quantized: bias must be [", N, "], got ",
                bias->sizes());
  }
  if (interleaved)
    TORCH_CHECK(linear_quantized_interleaved() && interleaves(bits, group_size, N, K) && !exact,
                "linear_quantized: rows interleaved need 4 bits in groups of ", kBlock, " or 8 bits with one scale a "
                "row, a multiple of ", kInterleavedRows, " rows and the integer dots (not exact) on a CPU with "
                "AVX512-VNNI or AVX2; got ", bits, " bits, groups of ", group_size, " over ", K, " input features, ", N,
                " rows, exact ", exact, linear_quantized_interleaved() ? "" : " (this build has no integer dots)");
  x = x.contiguous();
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  const at::Tensor m = mins.has_value() ? mins->contiguous() : at::Tensor();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  const auto* mn = m.defined() ? m.data_ptr<c10::Half>() : nullptr;
  if (!batch_invariant && rows > (x.scalar_type() == at::kFloat ? kPanelMaxRows : kDirectRows)) {
    const at::Tensor w = bits == 8 ? dequantize_all<8>(q, s, mn, N, K, group_size, x.scalar_type(), interleaved)
                                      : dequantize_all<4>(q, s, mn, N, K, group_size, x.scalar_type(), interleaved);
    return at::linear(x, w, b.defined() ? b : at::Tensor());
  }
  auto y = at::empty({rows, N}, x.options());
  if (rows == 0) return y;
  dispatch("linear_quantized", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* bp = b.defined() ? b.data_ptr<T>() : nullptr;
    if (bits == 8)
      linear_quantized_impl<8, T>(x.data_ptr<T>(), q, s, mn, bp, y.data_ptr<T>(), rows, N, K, group_size,
                                  batch_invariant, interleaved, exact);
    else
      linear_quantized_impl<4, T>(x.data_ptr<T>(), q, s, mn, bp, y.data_ptr<T>(), rows, N, K, group_size,
                                  batch_invariant, interleaved, exact);
  });
  return y;
}

// Rows `rows` (int64 [n], each in [0, N)) of a packed weight (linear_quantized's planes) in `dtype`: an
// embedding's lookup in one call, each weight rounded from its exact fp32 value as PackedWeight.dequantize
// computes it (in a decode step PyTorch's six operations for one row took 130 us, their code and data cold
// after the head's weights streamed: docs/performance.md#qwen35-08b-shape-what-a-token-reads-benchquantizationpy---shape-qwen35-08b).
at::Tensor dequantize_rows(at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t bits,
                           int64_t group_size, at::Tensor rows, at::ScalarType dtype, bool interleaved) {
  TORCH_CHECK(qweight.dim() == 2, "dequantize_rows: qweight must be 2-d, got ", qweight.sizes());
  const int64_t K = qweight.size(1) * 8 / bits, N = qweight.size(0);
  check_planes("dequantize_rows", qweight, scales, mins, bits, group_size, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "dequantize_rows: rows must be int64 [n], got ",
              rows.scalar_type(), " ", rows.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dequantize_rows: float32, bfloat16 or float16 only, got ", dtype);
  if (interleaved)
    TORCH_CHECK(interleaves(bits, group_size, N, K), "dequantize_rows: rows interleaved need 4 bits in groups of ",
                kBlock, " or 8 bits with one scale a row, and a multiple of ", kInterleavedRows, " rows");
  rows = rows.contiguous();
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= ids[i] && ids[i] < N, "dequantize_rows: row ", ids[i], " is outside the weight's ", N, " rows");
  qweight = qweight.contiguous();
  scales = scales.contiguous();
  const at::Tensor m = mins.has_value() ? mins->contiguous() : at::Tensor();
  const auto* q = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  const auto* mn = m.defined() ? m.data_ptr<c10::Half>() : nullptr;
  return bits == 8 ? dequantize_all<8>(q, s, mn, N, K, group_size, dtype, interleaved, ids, rows.size(0))
                   : dequantize_all<4>(q, s, mn, N, K, group_size, dtype, interleaved, ids, rows.size(0));
}

int64_t linear_quantized_direct_rows() { return kDirectRows; }

bool linear_quantized_int8_dots() {
#ifdef NANOVLLM_INT8_DOTS
  return true;
#else
  return false;
#endif
}

bool linear_quantized_interleaved() {
#ifdef NANOVLLM_INT8_DOTS
  return true;
#else
  return false;
#endif
}
