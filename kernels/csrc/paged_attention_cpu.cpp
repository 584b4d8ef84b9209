// CPU kernels for the decoder's small ops: decode attention straight from the paged KV cache, RMSNorm
// (alone and fused with the residual add), the SwiGLU gate and RoPE; and the module's bindings, which
// include the few-rows matmul of linear_cpu.cpp.
//
// Dtypes: every kernel takes float32, bfloat16 or float16; all tensors of one call share that dtype
// (the norm weight and the RoPE tables too: they are stored in the model's dtype) and the output has it.
// Arithmetic is always in fp32; 16-bit results are rounded where Hugging Face transformers (the
// reference the engine is compared with) rounds, which is also what the PyTorch path of our layers does:
//   RMSNorm     y = round(w * round(x * rsqrt(mean(x^2) + eps)))   (add_rms_norm_: residual rounded first)
//   SwiGLU      y = round(round(silu(gate)) * up)
//   RoPE        y = round(round(x * cos) + round(rotate_half(x) * sin))
//   attention   scores, softmax and the weighted sum in fp32, the output rounded once.
// In fp32 each of these roundings is the identity. The tests compare every kernel with the PyTorch path
// in each dtype: the 16-bit results are mostly equal bit for bit (RoPE always), the rest one rounding apart.
//
// Decode attention: the PyTorch reference (kernels/attention.py) first gathers every sequence's blocks
// into a padded tensor and then calls SDPA: on a CPU that copy and the padded reads cost as much as the
// attention itself. Here each (sequence, kv head) task walks its block table in place, prefetching ahead,
// so K and V are read once. The query heads that share a kv head (GQA) are handled by the same task, and
// each K/V row is loaded and converted once for all of them.
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include <ATen/Parallel.h>
#include "decode_team.h"

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// ---- decode attention. Per (sequence, kv head) task: scores of the group's query heads against every
// key, softmax, then the probability-weighted sum of the value rows, all in fp32. Each K and V row is read
// from the cache once and serves every query head of its group (GQA); the row math per dtype is one of
// the *Rows structs below, the walk over the cache (attend_group) is shared.

// Rows handled together: independent FMA chains in the scores, one pass over the output sums per kRows
// value rows. A task's last rows are padded with zero rows of probability 0, so no loop has a tail.
constexpr int64_t kRows = 8;
// Rows are prefetched ahead of use: a block holds only block_size (typically 16) tokens and the next block
// is anywhere in the cache, so the hardware prefetchers lose the stream at each block boundary, and
// without this the kernel waits on memory most of the time. Two distances, because one core has few L1
// misses in flight: far ahead into L2 (prefetcht2), then near into L1, non-temporal (each row is read
// once; the caches are better kept for the weights). Measured against one distance into L1: 3-20%
// faster; the distances are a plateau (8-24 near, 48-96 far within 3%).
constexpr int64_t kPrefetchNear = 16, kPrefetchFar = 64;

// Every 64-byte line of one row; `locality` as __builtin_prefetch's (0: non-temporal, 1: L2). On x86 an
// asm statement, because GCC 12 silently deletes a loop of __builtin_prefetch calls once it is inlined
// into some callers (a lambda here), which made the kernel 2.5x slower.
template <int locality, typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  static_assert(locality == 0 || locality == 1);
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__)
    if constexpr (locality == 0) {
      asm volatile("prefetchnta %0" : : "m"(p[i]));
    } else {
      asm volatile("prefetcht2 %0" : : "m"(p[i]));
    }
#else
    __builtin_prefetch(p + i, 0, locality);
#endif
  }
}

// One thread's buffers for one call, resized per task. T: the queries' dtype; C: the cache's, T or an FP8
// format.
template <typename T, typename C = T>
struct DecodeScratch {
  std::vector<const C*> stream;  // [2, padded len]: the task's K rows then its V rows, padded with `zeros`
  std::vector<float> scores;     // [group, padded len]: scores, then probabilities
  std::vector<float> q, acc;     // [group, dim]: fp32 queries and output sums, in the row math's order
  std::vector<float> rows;       // [kRows, dim]: widened rows
  std::vector<float> zeros;      // [dim]: the padding row (all-zero bits are 0 in every dtype)
  // An FP8 cache's scales for the task's kv head (powers of two, 1 otherwise): the key's folded into the
  // scores' scale and the value's into the output, both exact, so the rows are read without them.
  float k_scale = 1.f, v_scale = 1.f;
};

#ifdef __AVX512F__
// The sums of a, b, c and d, in that order: a transposing tree, ~3 instructions a sum where
// _mm512_reduce_add_ps takes ~8 (GCC lowers an `omp simd` reduction worse still: lanes spilled and
// added one by one).
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d]
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), hi);
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

// out[r] = q . k[r] for four keys at once: independent accumulator chains keep the FMA units busy, where
// a single dot product would wait on its own latency.
inline void dot4(const float* q, const float* const* k, int64_t n, float* out) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 x = _mm512_loadu_ps(q + i);
      a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[0] + i), a0);
      a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[1] + i), a1);
      a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[2] + i), a2);
      a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[3] + i), a3);
    }
    _mm_storeu_ps(out, hsum4(a0, a1, a2, a3));
    return;
  }
#endif
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; ++i) {
    a0 += q[i] * k0[i];
    a1 += q[i] * k1[i];
    a2 += q[i] * k2[i];
    a3 += q[i] * k3[i];
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}

// y += p[0] v[0] + ... + p[7] v[7]: one pass over y for kRows value rows.
inline void axpy_rows(const float* p, const float* const* v, float* y, int64_t n) {
  static_assert(kRows == 8);
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3], p4 = p[4], p5 = p[5], p6 = p[6], p7 = p[7];
  const float *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3], *v4 = v[4], *v5 = v[5], *v6 = v[6], *v7 = v[7];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)  // 8 FMAs
    y[i] = y[i] + p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i] + p4 * v4[i] + p5 * v5[i] + p6 * v6[i] +
           p7 * v7[i];
}

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// dst[0..n) = an FP8 row as fp32, kFp8Factor<C> times smaller than its values: bytes to fp16 bits in
// 16-bit lanes, then the CPU's fp16 conversion, 16 (AVX-512) or 8 (F16C) at a time.
template <typename C>
inline void widen_fp8(const C* src, float* dst, int64_t n) {
  [[maybe_unused]] const auto* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
      h = _mm256_slli_epi16(h, 8);
    } else {
      h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                          _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
    }
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
  }
#elif defined(__F16C__) && defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
      h = _mm_slli_epi16(h, 8);
    } else {
      h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                       _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
    }
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = half_bits_to_float(fp8_half_bits(src[i]));
}

// Row math for any dtype and head dim: fp32 rows read in place, 16-bit and FP8 rows widened once into an
// fp32 buffer that every query head of the group then reads from L1 (widening per head cost more than the
// arithmetic it feeds).
template <typename T, typename C = T>
struct WidenedRows {
  static constexpr float kFactor = kIsFp8<C> ? kFp8Factor<C> : 1.f;  // what widened rows lack

  static void begin(const T* q, int64_t group, int64_t dim, DecodeScratch<T, C>& w) {
#pragma omp simd
    for (int64_t i = 0; i < group * dim; ++i) w.q[i] = load(q[i]);
  }

  static void widen(const C* const* in, int64_t dim, DecodeScratch<T, C>& w, const float** out) {
    for (int64_t r = 0; r < kRows; ++r) {
      if constexpr (std::is_same_v<C, float>) {
        out[r] = in[r];
      } else {
        float* dst = w.rows.data() + r * dim;
        if constexpr (kIsFp8<C>) {
          widen_fp8(in[r], dst, dim);
        } else {
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) dst[i] = load(in[r][i]);
        }
        out[r] = dst;
      }
    }
  }

  // s[g * stride + r] = q_g . k[r]
  static void scores(const T*, const C* const* k, int64_t group, int64_t dim, float* s, int64_t stride,
                     DecodeScratch<T, C>& w) {
    const float* rows[kRows];
    widen(k, dim, w, rows);
    for (int64_t g = 0; g < group; ++g) {
      dot4(w.q.data() + g * dim, rows, dim, s + g * stride);
      dot4(w.q.data() + g * dim, rows + 4, dim, s + g * stride + 4);
    }
  }

  // acc_g += sum_r p[g * stride + r] v[r]
  static void accumulate(const float* p, int64_t stride, const C* const* v, int64_t group, int64_t dim,
                         DecodeScratch<T, C>& w) {
    const float* rows[kRows];
    widen(v, dim, w, rows);
    for (int64_t g = 0; g < group; ++g) axpy_rows(p + g * stride, rows, w.acc.data() + g * dim, dim);
  }

  static void finish(int64_t group, int64_t dim, const DecodeScratch<T, C>& w, T* o) {
    const float v_scale = w.v_scale * kFactor;
#pragma omp simd
    for (int64_t i = 0; i < group * dim; ++i) o[i] = to<T>(w.acc[i] * v_scale);
  }
};

#ifdef __AVX512F__
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
// 32 FP8 bytes as bf16 words. Sign-extended to 16 bits, a byte's sign fills the word's top bits: shifted so
// that its exponent lands on bf16's, the top bit is the sign, and once the bits between are cleared, adding
// the difference of the biases gives the bf16 of every normal value (no carry reaches the sign): four
// instructions. Subnormal codes (exponent 0: zeros, and values under 2^-6 of a scale whose largest value
// sits near 2^5.8) are rare; when a row has any, their words come from a table.
template <typename C>
inline __m512i fp8_bf16_words(const C* p) {
  constexpr int mantissa = std::is_same_v<C, c10::Float8_e4m3fn> ? 3 : 2;
  constexpr int bias = mantissa == 3 ? 7 : 15;
  constexpr int shift = 7 - mantissa;
  // m * 2^(1 - bias - mantissa) as bf16 bits, for m < 2^mantissa
  alignas(64) static constexpr uint16_t kSubnormals[32] = {
      0, mantissa == 3 ? 0x3B00 : 0x3780, mantissa == 3 ? 0x3B80 : 0x3800, mantissa == 3 ? 0x3BC0 : 0x3840,
      0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  const __m512i kept = _mm512_set1_epi16(static_cast<int16_t>(0x8000 | (0x7F << shift)));
  __m512i bits = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, shift), kept),
                                  _mm512_set1_epi16(static_cast<int16_t>((127 - bias) << 7)));
  const __mmask32 subnormal = _mm512_testn_epi16_mask(x, _mm512_set1_epi16((0x7F >> mantissa) << mantissa));
  if (subnormal) {  // an index's low 5 bits are the mantissa where the exponent is 0
    const __m512i words = _mm512_permutexvar_epi16(x, _mm512_load_si512(kSubnormals));
    bits = _mm512_mask_mov_epi16(bits, subnormal, _mm512_or_si512(words, _mm512_and_si512(x, sign)));
  }
  return bits;
}
#endif

// Row math for bfloat16 rows, head dim a multiple of 32, read in place. A bf16 is the upper half of an
// fp32, so 64 bytes of a row, as 16 32-bit words, are its 16 odd elements once the low halves are masked
// off and its 16 even elements once shifted up: two instructions for 32 elements, where widening takes
// four shuffles and a store. The output sums are kept in that order (per 32 elements: the 16 even, then
// the 16 odd), and so are fp32 queries; `paired` maps an element to its place in it.
//
// With dpbf16 (AVX512-BF16), rows of an FP8 cache take this path too: 32 bytes become 32 bf16 words in
// registers (every FP8 value is exact in bf16), so the cache is read in place at half the bytes.
template <typename C = c10::BFloat16>
struct Bf16Rows {
  using T = c10::BFloat16;
  static constexpr float kFactor = 1.f;  // the words are the values themselves

  static bool fits(int64_t dim) { return dim % 32 == 0; }
  static int64_t paired(int64_t i) { return (i & ~int64_t{31}) + (i & 1) * 16 + ((i & 31) >> 1); }
  // 32 elements of a row as bf16 words.
  static __m512i words(const C* p) {
    if constexpr (std::is_same_v<C, T>) {
      return _mm512_loadu_si512(p);
    } else {
      return fp8_bf16_words(p);
    }
  }
  static void split(__m512i words, __m512& even, __m512& odd) {
    even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // (the parameters are unused with dpbf16, which reads the bf16 queries as they are)
  static void begin([[maybe_unused]] const T* q, [[maybe_unused]] int64_t group, [[maybe_unused]] int64_t dim,
                    [[maybe_unused]] DecodeScratch<T, C>& w) {
#ifndef __AVX512BF16__
    for (int64_t i = 0; i < group * dim; ++i) w.q[paired(i)] = load(q[i]);
#endif
  }

  // s[g * stride + r] = q_g . k[r], four keys at a time. FP8 rows are turned into bf16 words once, into
  // the scratch rows, which every query head then reads from L1.
  static void scores(const T* q, const C* const* k, int64_t group, int64_t dim, float* s, int64_t stride,
                     DecodeScratch<T, C>& w) {
    if constexpr (std::is_same_v<C, T>) {
      scores_bf16(q, k, group, dim, s, stride, w);
    } else {
      auto* words_out = reinterpret_cast<T*>(w.rows.data());  // kRows * dim bf16 in kRows * dim floats
      const T* rows[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        rows[r] = words_out + r * dim;
        for (int64_t i = 0; i < dim; i += 32) _mm512_storeu_si512(words_out + r * dim + i, words(k[r] + i));
      }
      scores_bf16(q, rows, group, dim, s, stride, w);
    }
  }

  static void scores_bf16([[maybe_unused]] const T* q, const T* const* k, int64_t group, int64_t dim, float* s,
                          int64_t stride, [[maybe_unused]] DecodeScratch<T, C>& w) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < kRows; r += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < dim; i += 32) {
#ifdef __AVX512BF16__
          // bf16 products are exact in fp32, and dpbf16 adds them in fp32: the query needs no widening
          const __m512bh x = (__m512bh)_mm512_loadu_si512(q + g * dim + i);
          a0 = _mm512_dpbf16_ps(a0, x, (__m512bh)_mm512_loadu_si512(k[r] + i));
          a1 = _mm512_dpbf16_ps(a1, x, (__m512bh)_mm512_loadu_si512(k[r + 1] + i));
          a2 = _mm512_dpbf16_ps(a2, x, (__m512bh)_mm512_loadu_si512(k[r + 2] + i));
          a3 = _mm512_dpbf16_ps(a3, x, (__m512bh)_mm512_loadu_si512(k[r + 3] + i));
#else
          const float* qg = w.q.data() + g * dim + i;
          const __m512 xe = _mm512_loadu_ps(qg), xo = _mm512_loadu_ps(qg + 16);
          __m512 e, o;
          split(_mm512_loadu_si512(k[r] + i), e, o), a0 = _mm512_fmadd_ps(xo, o, _mm512_fmadd_ps(xe, e, a0));
          split(_mm512_loadu_si512(k[r + 1] + i), e, o), a1 = _mm512_fmadd_ps(xo, o, _mm512_fmadd_ps(xe, e, a1));
          split(_mm512_loadu_si512(k[r + 2] + i), e, o), a2 = _mm512_fmadd_ps(xo, o, _mm512_fmadd_ps(xe, e, a2));
          split(_mm512_loadu_si512(k[r + 3] + i), e, o), a3 = _mm512_fmadd_ps(xo, o, _mm512_fmadd_ps(xe, e, a3));
#endif
        }
        _mm_storeu_ps(s + g * stride + r, hsum4(a0, a1, a2, a3));
      }
  }

  // acc_g += sum_r p[g * stride + r] v[r]: each 32 elements of the kRows rows split once, then used by
  // every query head.
  static void accumulate(const float* p, int64_t stride, const C* const* v, int64_t group, int64_t dim,
                         DecodeScratch<T, C>& w) {
    for (int64_t i = 0; i < dim; i += 32) {
      __m512 even[kRows], odd[kRows];
      for (int64_t r = 0; r < kRows; ++r) split(words(v[r] + i), even[r], odd[r]);
      for (int64_t g = 0; g < group; ++g) {
        float* y = w.acc.data() + g * dim + i;
        __m512 ye = _mm512_loadu_ps(y), yo = _mm512_loadu_ps(y + 16);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 pr = _mm512_set1_ps(p[g * stride + r]);
          ye = _mm512_fmadd_ps(pr, even[r], ye);
          yo = _mm512_fmadd_ps(pr, odd[r], yo);
        }
        _mm512_storeu_ps(y, ye);
        _mm512_storeu_ps(y + 16, yo);
      }
    }
  }

  static void finish(int64_t group, int64_t dim, const DecodeScratch<T, C>& w, T* o) {
    for (int64_t i = 0; i < group * dim; ++i) o[i] = to<T>(w.acc[paired(i)] * w.v_scale);
  }
};
#endif

// In place: s[0..n) = softmax(s * scale). Every loop vectorised: std::max_element is a scalar chain
// of dependent compares, which cost as much as the scores themselves.
inline void softmax(float* s, int64_t n, float scale) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) {
    s[t] *= scale;
    mx = s[t] > mx ? s[t] : mx;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_simd(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// Attention of the `group` query heads q [group, dim] that share one kv head, over the `len` tokens that
// `table` lists (kc/vc point at that kv head's first row), into o [group, dim].
template <typename Rows, typename T, typename C>
void attend_group(const T* q, const C* kc, const C* vc, const int64_t* table, int64_t len, T* o, int64_t group,
                  int64_t dim, int64_t block_size, int64_t token_stride, float scale, DecodeScratch<T, C>& w) {
  const int64_t padded = (len + kRows - 1) / kRows * kRows;
  w.zeros.assign(dim, 0.f);
  // The rows this task reads, in order, found once by walking the block table: the loops below then take
  // them kRows at a time across block boundaries, and prefetch ahead in one stream (so the first values
  // are on their way while the last scores are computed).
  w.stream.assign(2 * padded, reinterpret_cast<const C*>(w.zeros.data()));
  for (int64_t t = 0, j = 0; t < len; ++j)
    for (int64_t slot = table[j] * block_size, end = std::min(len, t + block_size); t < end; ++t, ++slot) {
      w.stream[t] = kc + slot * token_stride;
      w.stream[padded + t] = vc + slot * token_stride;
    }
  w.q.resize(group * dim);
  w.scores.resize(group * padded);
  w.acc.assign(group * dim, 0.f);
  w.rows.resize(kRows * dim);
  Rows::begin(q, group, dim, w);
  const int64_t row_bytes = dim * sizeof(C);
  auto prefetch = [&](int64_t at) {  // before the kRows rows from stream position `at` are read
    for (int64_t r = at + kPrefetchNear; r < std::min(at + kPrefetchNear + kRows, 2 * padded); ++r)
      prefetch_row<0>(w.stream[r], row_bytes);
    for (int64_t r = at + kPrefetchFar; r < std::min(at + kPrefetchFar + kRows, 2 * padded); ++r)
      prefetch_row<1>(w.stream[r], row_bytes);
  };

  // Scores [group, padded]
  for (int64_t t = 0; t < padded; t += kRows) {
    prefetch(t);
    Rows::scores(q, w.stream.data() + t, group, dim, w.scores.data() + t, padded, w);
  }
  // An FP8 cache's key scale (and what the row math's widened rows lack) scales the scores: a power of two
  const float score_scale = scale * w.k_scale * Rows::kFactor;
  for (int64_t g = 0; g < group; ++g) {
    float* s = w.scores.data() + g * padded;
    softmax(s, len, score_scale);
    std::fill(s + len, s + padded, 0.f);  // the padding rows' probability
  }

  // out_g = sum_t p[g, t] v_t
  for (int64_t t = 0; t < padded; t += kRows) {
    prefetch(padded + t);
    Rows::accumulate(w.scores.data() + t, padded, w.stream.data() + padded + t, group, dim, w);
  }
  Rows::finish(group, dim, w, o);
}

// k_scales, v_scales: an FP8 cache's per kv head, else null.
template <typename T, typename C>
void decode_attention_impl(const T* q, const C* kc, const C* vc, const int64_t* tables, const int64_t* lens, T* o,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           int64_t max_blocks, float scale, const float* k_scales, const float* v_scales) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;  // between consecutive tokens of one block
  auto attend = attend_group<WidenedRows<T, C>, T, C>;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    if (Bf16Rows<C>::fits(dim)) attend = attend_group<Bf16Rows<C>, T, C>;
  }
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && kIsFp8<C>) {
    if (Bf16Rows<C>::fits(dim)) attend = attend_group<Bf16Rows<C>, T, C>;
  }
#endif
#endif
  // Contiguous ranges of tasks of about equal work (rows read), one per thread: at::parallel_for alone
  // splits by task count, which leaves a thread idle at the end when the long contexts sit together in
  // the batch. A task goes to the thread whose share of the total work holds its midpoint.
  const int64_t tasks = batch * kv_heads;
  std::vector<int64_t> mid(tasks);  // twice the work before a task's midpoint
  int64_t total = 0;
  for (int64_t i = 0; i < tasks; ++i) {
    const int64_t work = lens[i / kv_heads] + kRows;
    mid[i] = 2 * total + work;
    total += work;
  }
  const int64_t chunks = std::min<int64_t>(nanovllm::num_threads(), tasks);
  auto first_task = [&](int64_t chunk) {
    return std::lower_bound(mid.begin(), mid.end(), 2 * total * chunk / chunks) - mid.begin();
  };
  nanovllm::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    DecodeScratch<T, C> scratch;
    for (int64_t task = first_task(chunk_begin); task < first_task(chunk_end); ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t first = (b * heads + kvh * group) * dim;  // the group's first query row
      if (k_scales != nullptr) scratch.k_scale = k_scales[kvh], scratch.v_scale = v_scales[kvh];
      attend(q + first, kc + kvh * dim, vc + kvh * dim, tables + b * max_blocks, lens[b], o + first, group, dim,
             block_size, token_stride, scale, scratch);
    }
  });
}

// RMSNorm of each row of x [tokens, heads, hidden] into out [tokens, heads, hidden] (contiguous; may
// alias x when x is contiguous too). A token's rows are `hidden` apart, tokens `token_stride` apart (q and
// k are a column slice of the fused QKV output); head h takes w's row h when `per_head` (Qwen3's q/k norm,
// w [heads, hidden]), else w's one row.
template <typename T>
void rms_norm_rows(const T* x, int64_t token_stride, const T* w, bool per_head, T* out, int64_t tokens,
                   int64_t heads, int64_t hidden, float eps) {
  nanovllm::parallel_for(0, tokens * heads, std::max<int64_t>(16, 8192 / hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t head = r % heads;
      const T* xr = x + (r / heads) * token_stride + head * hidden;
      const T* wr = per_head ? w + head * hidden : w;
      T* yr = out + r * hidden;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += load(xr[i]) * load(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = to<T>(load(wr[i]) * rounded<T>(load(xr[i]) * inv));
    }
  });
}

}  // namespace

namespace {

bool is_fp8(at::ScalarType type) { return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2; }

// An FP8 cache's scales: float32 [kv_heads], one pair for K and V, present exactly when the cache is FP8.
void check_kv_scales(const char* op, const at::Tensor& cache, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  if (!is_fp8(cache.scalar_type())) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), op, ": scales are for an FP8 cache, this one is ",
                cache.scalar_type());
    return;
  }
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->has_value() && (*s)->scalar_type() == at::kFloat && (*s)->is_contiguous() &&
                    (*s)->numel() == cache.size(2),
                op, ": an FP8 cache needs contiguous float32 k_scale and v_scale of ", cache.size(2),
                " kv heads");
}

// Runs f(C{}) for an FP8 cache's element type, or f(T{}) for a cache in the queries' dtype T.
template <typename T, typename F>
void dispatch_cache(const char* op, at::ScalarType cache, F&& f) {
  if (cache == at::kFloat8_e4m3fn) return f(c10::Float8_e4m3fn{});
  if (cache == at::kFloat8_e5m2) return f(c10::Float8_e5m2{});
  TORCH_CHECK(cache == c10::CppTypeToScalarType<T>::value, op, ": the cache is ", cache, ", the queries ",
              c10::CppTypeToScalarType<T>::value, ": a cache holds the model's dtype or FP8");
  f(T{});
}

}  // namespace

// query [B, H, D], caches [num_blocks, block_size, KV, D], block_tables [B, max_blocks] (int64),
// context_lens [B] (int64); an FP8 cache's k_scale and v_scale [KV] (float32). Returns [B, H, D] in the
// query's dtype.
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  check_one_dtype("paged_decode_attention", {{"k_cache", &k_cache}, {"v_cache", &v_cache}});
  check_kv_scales("paged_decode_attention", k_cache, k_scale, v_scale);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_decode_attention: shape mismatch");
  auto out = at::empty_like(query);
  const float* k_scales = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  const float* v_scales = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  dispatch("paged_decode_attention", query.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    dispatch_cache<T>("paged_decode_attention", k_cache.scalar_type(), [&](auto cache_zero) {
      using C = decltype(cache_zero);
      decode_attention_impl(query.data_ptr<T>(), static_cast<const C*>(k_cache.data_ptr()),
                            static_cast<const C*>(v_cache.data_ptr()), block_tables.data_ptr<int64_t>(),
                            context_lens.data_ptr<int64_t>(), out.data_ptr<T>(), batch, heads, kv_heads, dim,
                            k_cache.size(1), block_tables.size(1), static_cast<float>(scale), k_scales, v_scales);
    });
  });
  return out;
}

// One call instead of the half-dozen ops of the PyTorch RMSNorm: at batch 1 every op launch costs more
// than its arithmetic, and a decoder layer has two norms.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_one_dtype("rms_norm", {{"x", &x}, {"weight", &weight}});
  const int64_t hidden = x.size(-1);
  const bool per_head = weight.dim() == 2;
  // [tokens, heads, hidden] with each token's heads contiguous (a column slice of a [tokens, n] matrix is
  // fine), or anything contiguous, read as [rows, 1, hidden].
  const bool head_slice = x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == hidden;
  if (!head_slice) x = x.contiguous();
  const int64_t heads = head_slice ? x.size(1) : 1;
  const int64_t tokens = x.numel() / (heads * hidden);
  const int64_t token_stride = head_slice && tokens > 1 ? x.stride(0) : heads * hidden;
  TORCH_CHECK(weight.is_contiguous() && weight.size(-1) == hidden && (!per_head || weight.size(0) == heads),
              "rms_norm: weight must be contiguous [", hidden, "] or [heads, ", hidden, "] for x ", x.sizes(),
              ", got ", weight.sizes());
  auto out = at::empty(x.sizes(), x.options());
  dispatch("rms_norm", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows(x.data_ptr<T>(), token_stride, weight.data_ptr<T>(), per_head, out.data_ptr<T>(), tokens, heads,
                  hidden, static_cast<float>(eps));
  });
  return out;
}

// In place: residual += x, then x = RMSNorm(residual) * weight (the pre-norm residual stream update). A float32
// weight with 16-bit x (Qwen3.5's zero-centred norms, 1 + w kept in float32) multiplies in float32 and rounds
// once, as rms_norm_fp32_weight.
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  const bool fp32_weight = weight.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  if (fp32_weight)
    check_one_dtype("add_rms_norm_", {{"x", &x}, {"residual", &residual}});
  else
    check_one_dtype("add_rms_norm_", {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                  x.sizes() == residual.sizes(),
              "add_rms_norm_: x, residual and weight must be contiguous, x and residual of one shape");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  dispatch("add_rms_norm_", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    nanovllm::parallel_for(0, rows * hidden, 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) rp[i] = to<T>(load(rp[i]) + load(xp[i]));
    });
    if (!fp32_weight)
      rms_norm_rows(rp, hidden, weight.data_ptr<T>(), false, xp, rows, 1, hidden, static_cast<float>(eps));
  });
  if (fp32_weight) rms_norm_fp32_weight_into(residual, weight, eps, x);
}

// New tokens' K and V into their cache slots: row t of key and value [T, kv_heads, D] (each row contiguous,
// rows any stride apart: k and v are column slices of the QKV output) to slot slot_mapping[t] of the
// caches [num_blocks, block_size, kv_heads, D]. What index_copy_ does, as one memcpy a row: PyTorch's
// index_copy_ is several times slower on a long prompt (docs/performance.md#measurements-behind-choices-in-the-code).
// Into an FP8 cache, each value is divided by its head's scale (a power of two: exact), clamped to the
// format's range and rounded to nearest even by c10's conversion, which is PyTorch's: the bytes
// kernels/fp8_kv.py's quantize stores.
void store_kv_(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
               c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  check_one_dtype("store_kv_", {{"key", &key}, {"value", &value}});
  check_one_dtype("store_kv_", {{"k_cache", &k_cache}, {"v_cache", &v_cache}});
  check_kv_scales("store_kv_", k_cache, k_scale, v_scale);
  const bool fp8 = is_fp8(k_cache.scalar_type());
  TORCH_CHECK(fp8 || key.scalar_type() == k_cache.scalar_type(), "store_kv_: key is ", key.scalar_type(),
              ", the cache ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4,
              "store_kv_: k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, D] of one shape");
  const int64_t row = k_cache.size(2) * k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) * t->size(2) == row && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "store_kv_: key and value must be [T, kv_heads, D] with contiguous rows matching the cache's ",
                k_cache.sizes(), ", got ", t->sizes(), " strides ", t->strides());
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0) &&
                  value.size(0) == key.size(0),
              "store_kv_: slot_mapping must be int64 with one slot per token, got ", slot_mapping.numel(),
              " slots for ", key.size(0), " keys and ", value.size(0), " values");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t tokens = key.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "store_kv_: slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_slots, " slots");
  const int64_t bytes = row * key.element_size();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bytes, 1));
  if (fp8) {
    const int64_t dim = k_cache.size(3);
    dispatch("store_kv_", key.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      dispatch_cache<T>("store_kv_", k_cache.scalar_type(), [&](auto cache_zero) {
        using C = decltype(cache_zero);
        const float bound = static_cast<float>(std::numeric_limits<C>::max());
        auto quantize = [&](const T* src, const float* scales, C* dst) {
          for (int64_t i = 0; i < row; ++i) {
            const float x = load(src[i]) * (1.f / scales[i / dim]);
            dst[i] = static_cast<C>(x > bound ? bound : (x < -bound ? -bound : x));  // NaN stays NaN
          }
        };
        const T *k_src = key.data_ptr<T>(), *v_src = value.data_ptr<T>();
        C *k_dst = static_cast<C*>(k_cache.data_ptr()), *v_dst = static_cast<C*>(v_cache.data_ptr());
        nanovllm::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            quantize(k_src + t * key.stride(0), k_scale->data_ptr<float>(), k_dst + slots[t] * row);
            quantize(v_src + t * value.stride(0), v_scale->data_ptr<float>(), v_dst + slots[t] * row);
          }
        });
      });
    });
    return;
  }
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  nanovllm::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_dst + slots[t] * bytes, k_src + t * k_stride, bytes);
      std::memcpy(v_dst + slots[t] * bytes, v_src + t * v_stride, bytes);
    }
  });
}

// silu(x[:, :n]) * x[:, n:] for x [T, 2n]: the SwiGLU gate in one pass instead of two ops.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: contiguous [T, 2n] only");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = at::empty({rows, n}, x.options());
  dispatch("silu_and_mul", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = xp + r * 2 * n;
        const T* up = gate + n;
        T* y = op + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float g = load(gate[i]);
          y[i] = to<T>(rounded<T>(g / (1.f + exp_simd(-g))) * load(up[i]));
        }
      }
    });
  });
  return out;
}

// GELU's tanh form (transformers' gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715
// x^3), computed as x / (1 + e^(-2u)), the same function, on the kernels' own exp: PyTorch's CPU tanh is
// about 3x slower than its exp, which made the activation 5% of Qwen3.5's vision tower. In float32, rounded
// once to x's dtype, as PyTorch's 16-bit GELU rounds.
at::Tensor gelu_tanh(at::Tensor x) {
  x = x.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  dispatch("gelu_tanh", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        const float v = load(xp[i]);
        const float two_u = v * (1.5957691216057308f + 0.0713548162726f * v * v);  // 2 sqrt(2/pi) (v + 0.044715 v^3)
        op[i] = to<T>(v / (1.f + exp_simd(-two_u)));
      }
    });
  });
  return out;
}

// Rotate-half RoPE of x [T, heads, D] (any row stride, last dim contiguous) with per-token tables
// cos [T, 1, D] and signed sin [T, 1, D] (sin with its first half negated), into a new contiguous tensor.
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_one_dtype("rotary", {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, D] with a contiguous last dimension");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto out = at::empty({tokens, heads, dim}, x.options());
  dispatch("rotary", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cp + t * dim;
        const T* s = sp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const T* xi = xp + t * s0 + h * s1;
          T* y = op + (t * heads + h) * dim;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i)
            y[i] = to<T>(rounded<T>(load(xi[i]) * load(c[i])) + rounded<T>(load(xi[i + half]) * load(s[i])));
#pragma omp simd
          for (int64_t i = half; i < dim; ++i)
            y[i] = to<T>(rounded<T>(load(xi[i]) * load(c[i])) + rounded<T>(load(xi[i - half]) * load(s[i])));
        }
      }
    });
  });
  return out;
}
