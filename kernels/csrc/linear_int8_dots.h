// Integer dot products for quantized weights against a few rows of 16-bit x: each row of x is quantized to
// int8 in blocks of 32 with an fp32 scale (llama.cpp's Q8 activations) and meets the weights' bytes in
// integer multiply-adds. With AVX512-VNNI (AMD Zen 4, Intel Ice Lake and later) one VPDPBUSD multiplies 64
// weight bytes by 64 activations and adds them four by four into 16 int32 lanes; with AVX2 alone, two
// VPMADDUBSW / VPMADDWD pairs do the same for the two 32-byte halves of a chunk (llama.cpp's AVX2 path), 8
// lanes each. Dequantizing every weight to fp32 instead (8 or 16 lanes an instruction, plus the
// conversions) made the register path arithmetic-bound, twice as slow as reading the weights; the integer
// dots halve it (docs/performance.md#measurements-behind-choices-in-the-code).
//
// The price is x's rounding: |x - d q| <= d / 2 with d = max|x over the block| / 127, so a block's product
// moves by at most d / 2 * sum |w| over it (the tests check that bound). Where a block holds an outlier
// that is coarser than bf16's own rounding (SmolLM2's chats: top-5 logprobs moved by up to 1.25 nats, where
// bf16 against float32 moves them by 0.29), a trade a 16-bit engine makes as llama.cpp does; float32 x
// keeps the exact path. The integer sums are exact on both instruction sets; the float work after them
// (a lane's scale, the lanes' sum) is in 16 lanes with VNNI and 8 with AVX2, so the two round differently.
//
// Layout: a chunk is 64 weight bytes of one row: 128 4-bit weights (4 blocks, each 16 bytes with weight i
// in the low nibble of byte i and 16 + i in the high one) or 64 8-bit weights (2 blocks). x is quantized
// into the same chunks so that byte p of a weight chunk meets byte p of x's: `lo` pairs with the low
// nibbles (or the 8-bit weights), `hi` with the high nibbles. Lane l of a dot covers bytes 4l..4l+3, all
// in one block, so each lane is scaled by its block's x scale and its group's weight scale.
#pragma once

#include "linear_tile.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define NANOVLLM_INT8_DOTS 1
#define NANOVLLM_INT8_DOTS_VNNI 1
#elif defined(NANOVLLM_LINEAR_AVX2)
#define NANOVLLM_INT8_DOTS 1
#endif

namespace {

// One output row's quantized weights: `q` its bytes, `s` / `m` its groups' scales and mins (m null for
// 8 bits).
struct QRow {
  const uint8_t* q;
  const c10::Half* s;
  const c10::Half* m;
};

// Weight rows a tile of a 4-bit weight with rows interleaved holds (int4_rows16_sums).
constexpr int64_t kInterleavedRows = 16;

#ifdef NANOVLLM_INT8_DOTS
constexpr int64_t kChunkBytes = 64;
constexpr int64_t kDotBlock = 32;  // activations per x scale; also the smallest weight group
// Bytes ahead of the chunk being read that the general VNNI tile asks the memory for (the per-channel tile asks
// for none: int8_row_scale_sums): one weight row at a time is one sequential stream a thread. kPrefetchRows' 8 rows ahead were 28 KB at the 3,584 features of
// Qwen3.5-0.8B's down projection, most of L1, which x's chunks share: that projection ran at 0.70 of the
// read bandwidth and 0.81 with a kilobyte (docs/performance.md#measurements-behind-choices-in-the-code).
constexpr int64_t kDotPrefetchBytes = 1024;
// Bytes ahead of its reads that the 4-bit group-32 loop asks into L2 (prefetcht1, one a 64-byte line of weight
// bytes): its arithmetic per byte (two dots a chunk, four scales spread) is enough that the hardware's
// stream prefetcher alone leaves the memory idle part of the time; the int8 row loop, lighter, gained nothing
// in the engine (docs/performance.md#measurements-behind-choices-in-the-code).
constexpr int64_t kL2PrefetchBytes = 8192;
// VPDPBUSD takes unsigned weight bytes: signed 8-bit weights go in offset by 128, and x's correction takes
// the 128 back. AVX2 moves w's sign onto x instead (VPMADDUBSW's pairs of |w| x would saturate int16 with
// the offset: 2 x 255 x 127 > 32767; with the sign moved, 2 x 128 x 127 fits).
#ifdef NANOVLLM_INT8_DOTS_VNNI
constexpr bool kOffsetWeights = true;
#else
constexpr bool kOffsetWeights = false;
#endif

// One row of x as the integer dots read it, chunk by chunk (zero past K).
struct QuantizedRow {
  std::vector<int8_t> lo, hi;         // kChunkBytes per chunk (hi at 4 bits only)
  std::vector<float> scale;           // 16 per chunk: the x scale of each lane's block
  std::vector<int32_t> correction;    // 8 bits with VNNI: 16 per chunk, -128 times the sum of each lane's 4 bytes
  float correction_total = 0.f;       // 8 bits with VNNI: each lane's correction times its scale, summed
  std::vector<int32_t> block_correction;  // 8 bits with VNNI: -128 times the sum of each block's 32 bytes
  std::vector<float> group_sums;      // 4 bits: x summed over each weight group (the mins' term)
  std::vector<float> block_scale;     // 4 bits: each block's x scale, 4 per chunk (0 past K)
};

template <int BITS>
constexpr int64_t blocks_per_chunk() {
  return kChunkBytes * 8 / BITS / kDotBlock;
}

template <int BITS>
int64_t chunk_count(int64_t K) {
  return (K * BITS / 8 + kChunkBytes - 1) / kChunkBytes;
}

// x's K values (float32 or 16-bit) quantized for weights of BITS bits in groups of `group`, into `q`, whose
// vectors keep their memory from call to call: a one-row call's allocations, a widened copy of x and the
// block sums added one by one were half of its work before the parallel region, paid by every projection of
// a decode step (docs/performance.md#measurements-behind-choices-in-the-code).
template <int BITS, typename T>
void quantize_row(const T* x, int64_t K, int64_t group, QuantizedRow& q) {
  const int64_t chunks = chunk_count<BITS>(K), per_chunk = blocks_per_chunk<BITS>(), lanes = 16 / per_chunk;
  q.lo.assign(chunks * kChunkBytes, 0);
  q.scale.assign(chunks * 16, 0.f);
  if constexpr (BITS == 4) {
    q.hi.assign(chunks * kChunkBytes, 0);
    q.group_sums.assign(K / group, 0.f);
    q.block_scale.assign(chunks * per_chunk, 0.f);
  }
  if constexpr (BITS == 8 && kOffsetWeights) q.correction.assign(chunks * 16, 0), q.block_correction.assign(K / kDotBlock, 0);
  for (int64_t b = 0; b < K / kDotBlock; ++b) {
    const T* xb = x + b * kDotBlock;
    float sum = 0.f;
    int8_t qb[kDotBlock];
#ifdef NANOVLLM_INT8_DOTS_VNNI
    // 16 lanes at a time, the values the scalar lines below compute: the largest |x| (exact in any order),
    // x times 127 / it rounded to the nearest integer, ties to even (the conversion's default rounding, as
    // nearbyint's); the block's sum in the vector's order.
    const __m512 low = load16(xb, 0xFFFF), high = load16(xb + 16, 0xFFFF);
    if constexpr (BITS == 4) sum = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 scale_by = _mm512_set1_ps(inverse);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(low, scale_by))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(high, scale_by))));
#else
    float xf[kDotBlock], amax = 0.f;
#pragma omp simd
    for (int64_t i = 0; i < kDotBlock; ++i) xf[i] = load(xb[i]);
    for (int64_t i = 0; i < kDotBlock; ++i) amax = std::max(amax, std::fabs(xf[i]));
    if constexpr (BITS == 4)
      for (int64_t i = 0; i < kDotBlock; ++i) sum += xf[i];
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < kDotBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xf[i] * inverse));
#endif
    const int64_t c = b / per_chunk, j = b % per_chunk;
    std::fill_n(q.scale.data() + c * 16 + j * lanes, lanes, amax / 127.f);
    if constexpr (BITS == 4) {
      q.group_sums[b * kDotBlock / group] += sum;
      q.block_scale[b] = amax / 127.f;
      std::copy_n(qb, 16, q.lo.data() + c * kChunkBytes + 16 * j);
      std::copy_n(qb + 16, 16, q.hi.data() + c * kChunkBytes + 16 * j);
    } else {
      std::copy_n(qb, kDotBlock, q.lo.data() + c * kChunkBytes + kDotBlock * j);
      if constexpr (kOffsetWeights)
        for (int64_t l = 0; l < lanes; ++l) {
          q.correction[c * 16 + j * lanes + l] = -128 * (qb[4 * l] + qb[4 * l + 1] + qb[4 * l + 2] + qb[4 * l + 3]);
          q.block_correction[b] += q.correction[c * 16 + j * lanes + l];
        }
    }
  }
  q.correction_total = 0.f;
  if constexpr (BITS == 8 && kOffsetWeights) {  // in double, rounded once: it stands for exact integer sums
    double total = 0.0;
    for (size_t l = 0; l < q.correction.size(); ++l) total += double(q.correction[l]) * double(q.scale[l]);
    q.correction_total = static_cast<float>(total);
  }
}

#ifdef NANOVLLM_INT8_DOTS_VNNI
// Where each chunk finds its weight scales: the groups its lanes fall in are `first` .. first + count - 1,
// and lane l takes the one at `index[l]` of those (lanes past K take the first; their products are 0).
struct ChunkGroups {
  __m512i index;
  int64_t first;
  __mmask16 count_mask;
  __mmask64 byte_mask;  // the chunk's bytes inside the row
};

template <int BITS>
std::vector<ChunkGroups> chunk_groups(int64_t K, int64_t group) {
  const int64_t per_chunk = blocks_per_chunk<BITS>(), lanes = 16 / per_chunk, row_bytes = K * BITS / 8;
  std::vector<ChunkGroups> out(chunk_count<BITS>(K));
  const int64_t blocks = K / kDotBlock;
  for (int64_t c = 0; c < static_cast<int64_t>(out.size()); ++c) {
    const int64_t first = c * per_chunk * kDotBlock / group;
    int32_t index[16];
    int64_t last = first;
    for (int64_t j = 0; j < per_chunk; ++j) {  // a division a block, not a lane: this ran once a call
      const int64_t block = c * per_chunk + j;
      const int64_t g = block < blocks ? block * kDotBlock / group : first;
      std::fill_n(index + j * lanes, lanes, static_cast<int32_t>(g - first));
      last = std::max(last, g);
    }
    const int64_t bytes = std::min(kChunkBytes, row_bytes - c * kChunkBytes);
    out[c] = {_mm512_loadu_si512(index), first, static_cast<__mmask16>((1u << (last - first + 1)) - 1),
              bytes == kChunkBytes ? ~__mmask64{0} : (__mmask64{1} << bytes) - 1};
  }
  return out;
}

// 16 fp16 values (`mask` of them, the rest 0) widened to fp32.
inline __m512 load_halves(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// 8-bit weights with one scale a row (int8 per channel): sums[m][r] = x[m] . w[r] before the row's scale,
// for `count` consecutive weight rows from `q` (`row_bytes` apart), one row at a time in one loop: each
// lane's products times its x scale, summed, and x's correction for the weights' +128 offset added once
// (it is x's alone here: `correction_total`). Per chunk that leaves the weight bytes, the integer dot, its
// conversion and one FMA, where the general tile also loads, widens and permutes the chunk's weight scales;
// no software prefetch (its instructions take load slots; the hardware's stream prefetcher follows one row
// at a time). Everything a row does not change is set up once a call: a call a row through the general
// tile's driver cost as much again as the row's own loop and held a thread's DRAM reads to 0.7 of a sum's
// (docs/performance.md#measurements-behind-choices-in-the-code). Two chunks a pass, even and odd chunks
// summed apart and added at the end (a chunk left over, whole or partial, with the even ones), with plain
// loads where a chunk is whole.
template <int M>
void int8_row_scale_sums(const QuantizedRow* x, const std::vector<ChunkGroups>& chunks, const uint8_t* q,
                         int64_t row_bytes, int64_t count, float* sums) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  const int8_t* xlo[M];
  const float* xs[M];
  for (int m = 0; m < M; ++m) xlo[m] = x[m].lo.data(), xs[m] = x[m].scale.data();
  const int64_t n = static_cast<int64_t>(chunks.size());
  const int64_t full = chunks[n - 1].byte_mask == ~__mmask64{0} ? n : n - 1;
  const __mmask64 last_mask = chunks[n - 1].byte_mask;
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* row = q + r * row_bytes;
    __m512 acc[2][M];
    for (int u = 0; u < 2; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= full; c += 2) {
      const __m512i lo[2] = {_mm512_xor_si512(_mm512_loadu_si512(row + c * kChunkBytes), sign),
                             _mm512_xor_si512(_mm512_loadu_si512(row + (c + 1) * kChunkBytes), sign)};
      for (int u = 0; u < 2; ++u)
        for (int m = 0; m < M; ++m) {
          const __m512i dot = _mm512_dpbusd_epi32(zero, lo[u], _mm512_loadu_si512(xlo[m] + (c + u) * kChunkBytes));
          acc[u][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(xs[m] + (c + u) * 16), acc[u][m]);
        }
    }
    for (; c < n; ++c) {
      const __m512i lo = _mm512_xor_si512(_mm512_maskz_loadu_epi8(c < full ? ~__mmask64{0} : last_mask, row + c * kChunkBytes), sign);
      for (int m = 0; m < M; ++m) {
        const __m512i dot = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(xlo[m] + c * kChunkBytes));
        acc[0][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(xs[m] + c * 16), acc[0][m]);
      }
    }
    for (int m = 0; m < M; ++m)
      sums[m * count + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m])) + x[m].correction_total;
  }
}

// 4-bit weights in groups of 32 (int4, GGUF's Q4_0 and Q4_1): sums[m][r] = x[m] . w[r] for `count`
// consecutive weight rows (their bytes, scales and mins from the given rows on). A group is one of x's
// blocks, so a chunk's four blocks take four weight scales and four x scales: multiplied in a quarter
// vector and spread over the lanes by a permutation held in a register, where the general tile loads the
// chunk's lane-to-group index, 16 weight scales (widened and permuted) and 16 x scales and multiplies them
// lane by lane: at one row of x a thread of the general tile was bound by that work, not by the memory
// (docs/performance.md#measurements-behind-choices-in-the-code). One weight row at a time, its set-up
// hoisted, two chunks a pass in two accumulators (as int8_row_scale_sums) with their eight scales widened and
// multiplied by x's in one half vector (docs/performance.md#measurements-behind-choices-in-the-code), the weight
// bytes asked into L2 kL2PrefetchBytes ahead, then each group's min times x summed over the group.
template <int M>
void int4_group32_sums(const QuantizedRow* x, int64_t K, const uint8_t* q_rows, const c10::Half* scale_rows,
                       const c10::Half* min_rows, int64_t count, float* sums) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  // a chunk's four groups over its 16 lanes; the second of a pair's, from the upper four of eight scales
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_next = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  const int64_t row_bytes = K / 2, n = chunk_count<4>(K), groups = K / 32;
  const int64_t full = row_bytes % kChunkBytes == 0 ? n : n - 1;
  const __mmask64 last_bytes = static_cast<__mmask64>((__mmask64{1} << (row_bytes % kChunkBytes)) - 1);
  const __mmask8 last_groups = static_cast<__mmask8>((1u << (groups % 4)) - 1);
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* q = q_rows + r * row_bytes;
    const c10::Half* scales = scale_rows + r * groups;
    __m512 acc[2][M];
    for (int u = 0; u < 2; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
    auto dot = [&](int64_t c, __m512i lo, __m512i hi, int m) {  // chunk c's integer dot with row m of x
      const __m512i low_part = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(x[m].lo.data() + c * kChunkBytes));
      return _mm512_cvtepi32_ps(
          _mm512_dpbusd_epi32(low_part, hi, _mm512_loadu_si512(x[m].hi.data() + c * kChunkBytes)));
    };
    int64_t c = 0;
    for (; c + 2 <= full; c += 2) {  // two chunks' eight weight scales converted and multiplied by x's at once
      _mm_prefetch(reinterpret_cast<const char*>(q + c * kChunkBytes + kL2PrefetchBytes), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(q + (c + 1) * kChunkBytes + kL2PrefetchBytes), _MM_HINT_T1);
      const __m512i w0 = _mm512_loadu_si512(q + c * kChunkBytes), w1 = _mm512_loadu_si512(q + (c + 1) * kChunkBytes);
      const __m512i lo0 = _mm512_and_si512(w0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low4);
      const __m512i lo1 = _mm512_and_si512(w1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low4);
      const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 4 * c)));
      for (int m = 0; m < M; ++m) {
        const __m512 both = _mm512_castps256_ps512(_mm256_mul_ps(ws, _mm256_loadu_ps(x[m].block_scale.data() + 4 * c)));
        acc[0][m] = _mm512_fmadd_ps(dot(c, lo0, hi0, m), _mm512_permutexvar_ps(spread, both), acc[0][m]);
        acc[1][m] = _mm512_fmadd_ps(dot(c + 1, lo1, hi1, m), _mm512_permutexvar_ps(spread_next, both), acc[1][m]);
      }
    }
    auto single = [&](int64_t c, int u, __m512i w, __m128 ws) {  // a chunk left over: its four scales alone
      const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      for (int m = 0; m < M; ++m) {
        const __m128 scale = _mm_mul_ps(ws, _mm_loadu_ps(x[m].block_scale.data() + 4 * c));
        acc[u][m] = _mm512_fmadd_ps(dot(c, lo, hi, m), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale)),
                                    acc[u][m]);
      }
    };
    if (c < full)
      single(c, 0, _mm512_loadu_si512(q + c * kChunkBytes),
             _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 4 * c)))), ++c;
    if (c < n)  // a partial chunk: its bytes and its groups' scales only
      single(c, 1, _mm512_maskz_loadu_epi8(last_bytes, q + c * kChunkBytes),
             _mm_cvtph_ps(_mm_maskz_loadu_epi16(last_groups, scales + 4 * c)));
    const c10::Half* mins = min_rows + r * groups;
    for (int64_t g = 0; g < groups; g += 16) {  // plus, per group, its min times x summed over the group
      const __mmask16 mask = static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
      const __m512 min = load_halves(mins + g, mask);
      for (int m = 0; m < M; ++m)
        acc[0][m] = _mm512_fmadd_ps(min, _mm512_maskz_loadu_ps(mask, x[m].group_sums.data() + g), acc[0][m]);
    }
    for (int m = 0; m < M; ++m) sums[m * count + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
  }
}

// Bytes ahead of its reads that the interleaved loop asks into L1 (prefetcht0), a line at a time: the fastest
// of the distances measured, and into L1 rather than L2 one large call read 8% faster where the memory was
// slow and 25% where it was fast (docs/performance.md#measurements-behind-choices-in-the-code).
constexpr int64_t kInterleavedPrefetchBytes = 4096;

// 4-bit weights in groups of 32 with kInterleavedRows (16) rows interleaved (PackedWeight.interleave_): a
// tile's bytes are [K / 8][16 rows][4 bytes], its scales and mins [K / 32][16 rows]. Lane r of a 64-byte load
// is row r's next 8 weights, so one VPDPBUSD meets 16 rows with x's 4 bytes broadcast, a group's two scales
// multiply 16 rows' sums at once and no row ends in a horizontal sum: about two thirds of the row loop's
// instructions per weight byte, which is what bounds int4_group32_sums where the memory reads fast
// (docs/performance.md#measurements-behind-choices-in-the-code). sums[m][r] = x[m] . w[r] over one tile.
template <int M>
void int4_rows16_sums(const QuantizedRow* x, int64_t K, const uint8_t* q, const c10::Half* scales,
                      const c10::Half* mins, float (*sums)[kInterleavedRows]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int32_t* xlo[M];
  const int32_t* xhi[M];
  for (int m = 0; m < M; ++m)
    xlo[m] = reinterpret_cast<const int32_t*>(x[m].lo.data()), xhi[m] = reinterpret_cast<const int32_t*>(x[m].hi.data());
  __m512 acc[M], min_acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), min_acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kDotBlock; ++g) {
    const uint8_t* group = q + g * 4 * kChunkBytes;
    __m512i lo[4], hi[4];
    for (int w = 0; w < 4; ++w) {
      _mm_prefetch(reinterpret_cast<const char*>(group + w * kChunkBytes + kInterleavedPrefetchBytes), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(group + w * kChunkBytes);
      lo[w] = _mm512_and_si512(v, low4), hi[w] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 s = load_halves(scales + g * kInterleavedRows, 0xFFFF);
    const __m512 mn = load_halves(mins + g * kInterleavedRows, 0xFFFF);
    for (int m = 0; m < M; ++m) {
      __m512i low_dot = _mm512_setzero_si512(), high_dot = _mm512_setzero_si512();
      for (int w = 0; w < 4; ++w) {
        low_dot = _mm512_dpbusd_epi32(low_dot, lo[w], _mm512_set1_epi32(xlo[m][4 * g + w]));
        high_dot = _mm512_dpbusd_epi32(high_dot, hi[w], _mm512_set1_epi32(xhi[m][4 * g + w]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(low_dot, high_dot));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(x[m].block_scale[g])), acc[m]);
      min_acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x[m].group_sums[g]), min_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(sums[m], _mm512_add_ps(acc[m], min_acc[m]));
}

// 8-bit weights with one scale a row (int8 per channel) with kInterleavedRows (16) rows interleaved: a tile's
// bytes [K / 4][16 rows][4 bytes]. Lane r of a 64-byte load is row r's next 4 weights, so one VPDPBUSD meets 16
// rows with x's 4 bytes broadcast; a block's eight dots start from its correction for the +128 offset, so each
// lane's int32 is the block's exact dot, which one FMA scales by x's block scale: about half the row loop's
// instructions a weight byte at one row of x, a third at 2-8. No software prefetch: with the hardware's alone
// the head's 254 MB read at a sum's rate where the memory was fast, 3-5% faster than with prefetcht0 2-4 KB
// ahead, and as fast where it was slow (docs/performance.md#measurements-behind-choices-in-the-code).
// sums[m][r] = x[m] . w[r] before the row's scale, over one tile.
template <int M>
void int8_rows16_sums(const QuantizedRow* x, int64_t K, const uint8_t* q, float (*sums)[kInterleavedRows]) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int32_t* xq[M];
  for (int m = 0; m < M; ++m) xq[m] = reinterpret_cast<const int32_t*>(x[m].lo.data());
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / kDotBlock; ++b) {
    const uint8_t* block = q + b * 8 * kChunkBytes;
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(block + j * kChunkBytes), sign);
    for (int m = 0; m < M; ++m) {
      __m512i dot = _mm512_set1_epi32(x[m].block_correction[b]);
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(xq[m][8 * b + j]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x[m].scale[8 * b]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(sums[m], acc[m]);
}

// out[m][r] = x[m] . w[r] for M rows of x against R weight rows. Inlined into its driver's row loop, which
// then sets up what a row does not change once (docs/performance.md#measurements-behind-choices-in-the-code).
template <int M, int R, int BITS>
__attribute__((always_inline)) inline void int8_dot_tile(const QuantizedRow* x, const std::vector<ChunkGroups>& chunks, const QRow* rows, int64_t K,
                   int64_t group, float (*out)[R]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const ChunkGroups& cg = chunks[c];
    __m512i lo[R], hi[R];
    __m512 ws[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* bytes = rows[r].q + c * kChunkBytes;
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kDotPrefetchBytes), _MM_HINT_T0);
      const __m512i w = _mm512_maskz_loadu_epi8(cg.byte_mask, bytes);
      if constexpr (BITS == 4) {
        lo[r] = _mm512_and_si512(w, low4);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      } else {
        lo[r] = _mm512_xor_si512(w, sign);  // w + 128 as unsigned; the correction takes the 128 back
      }
      ws[r] = _mm512_permutexvar_ps(cg.index, load_halves(rows[r].s + cg.first, cg.count_mask));
    }
    for (int m = 0; m < M; ++m) {
      const __m512i xlo = _mm512_loadu_si512(x[m].lo.data() + c * kChunkBytes);
      const __m512i xhi = BITS == 4 ? _mm512_loadu_si512(x[m].hi.data() + c * kChunkBytes) : xlo;
      const __m512i init = BITS == 8 ? _mm512_loadu_si512(x[m].correction.data() + c * 16) : _mm512_setzero_si512();
      const __m512 xs = _mm512_loadu_ps(x[m].scale.data() + c * 16);
      for (int r = 0; r < R; ++r) {
        __m512i dot = _mm512_dpbusd_epi32(init, lo[r], xlo);
        if constexpr (BITS == 4) dot = _mm512_dpbusd_epi32(dot, hi[r], xhi);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[r], xs), acc[m][r]);
      }
    }
  }
  if constexpr (BITS == 4) {  // plus, per group, its min times x summed over the group
    const int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = static_cast<__mmask16>(groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1);
      __m512 mins[R];
      for (int r = 0; r < R; ++r) mins[r] = load_halves(rows[r].m + g, mask);
      for (int m = 0; m < M; ++m) {
        const __m512 sums = _mm512_maskz_loadu_ps(mask, x[m].group_sums.data() + g);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(mins[r], sums, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

#else
// Where each chunk finds its weight scales: block b of the chunk (4 at 4 bits, 2 at 8) is in group
// group[b] (blocks past K take the chunk's first; their products are 0), and `bytes` of it are in the row.
struct ChunkGroups {
  int32_t group[4];
  int64_t bytes;
  __m256i mask[2];  // each half's 4-byte lanes inside the row (rows end in whole 16-byte blocks)
};

template <int BITS>
std::vector<ChunkGroups> chunk_groups(int64_t K, int64_t group) {
  const int64_t per_chunk = blocks_per_chunk<BITS>(), row_bytes = K * BITS / 8;
  std::vector<ChunkGroups> out(chunk_count<BITS>(K));
  for (int64_t c = 0; c < static_cast<int64_t>(out.size()); ++c) {
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t block = c * per_chunk + std::min(j, per_chunk - 1);
      out[c].group[j] = static_cast<int32_t>((block < K / kDotBlock ? block : c * per_chunk) * kDotBlock / group);
    }
    out[c].bytes = std::min(kChunkBytes, row_bytes - c * kChunkBytes);
    for (int h = 0; h < 2; ++h) {
      int32_t lanes[8];
      for (int l = 0; l < 8; ++l) lanes[l] = 32 * h + 4 * l < out[c].bytes ? -1 : 0;
      out[c].mask[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes));
    }
  }
  return out;
}

inline float half_to_float(c10::Half h) { return _cvtsh_ss(h.x); }

// n <= 8 values widened to fp32, zeros after them: a plain load when there are 8, a padded copy otherwise.
template <typename T>
inline __m256 load_up_to_8(const T* p, int64_t n) {
  if (n == 8) [[likely]]
    return load8(p);
  alignas(32) T part[8] = {};
  std::copy_n(p, n, part);
  return load8(part);
}

// The weight scales of a chunk's half h, lane by lane: one block a half at 8 bits, two (4 lanes each) at 4.
template <int BITS>
inline __m256 half_scales(const c10::Half* s, const ChunkGroups& cg, int h) {
  if constexpr (BITS == 8) return _mm256_set1_ps(half_to_float(s[cg.group[h]]));
  return _mm256_set_m128(_mm_set1_ps(half_to_float(s[cg.group[2 * h + 1]])),
                         _mm_set1_ps(half_to_float(s[cg.group[2 * h]])));
}

// Bytes ahead of its reads that the interleaved loops ask into L1 (prefetcht0), a line at a time: with the
// hardware's stream prefetcher alone two threads left the memory idle part of the time, at both bit widths
// (2-8 KB ahead alike; docs/performance.md#measurements-behind-choices-in-the-code).
constexpr int64_t kInterleavedPrefetchBytes = 4096;

// 4-bit weights in groups of 32 with kInterleavedRows (16) rows interleaved (PackedWeight.interleave_): a
// tile's bytes are [K / 8][16 rows][4 bytes], its scales and mins [K / 32][16 rows]. Lane r of a 32-byte load
// is row 8h + r's next 8 weights (h the load's half of the 64-byte column), so two VPMADDUBSW meet 8 rows with
// x's 4 bytes broadcast; a group's four columns add in int16 (at most 4 x 2 x 2 x 15 x 127 = 30,480), so one
// VPMADDWD, one conversion and one FMA a group and 8 rows take what the row loop does a chunk's half (for each
// 64 weights): about half its instructions a weight byte, and no row ends in a horizontal sum. H of the two
// halves a pass: both where M's accumulators leave registers for them (each 64-byte line read once), one
// otherwise (the second half's lines then come from L1/L2). sums[m][r] = x[m] . w[r] over one tile.
template <int M, int H = (M <= 2 ? 2 : 1)>
void int4_rows16_sums(const QuantizedRow* x, int64_t K, const uint8_t* q, const c10::Half* scales,
                      const c10::Half* mins, float (*sums)[kInterleavedRows]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int32_t* xlo[M];
  const int32_t* xhi[M];
  for (int m = 0; m < M; ++m)
    xlo[m] = reinterpret_cast<const int32_t*>(x[m].lo.data()), xhi[m] = reinterpret_cast<const int32_t*>(x[m].hi.data());
  for (int first = 0; first < 2; first += H) {
    __m256 acc[M][H];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) acc[m][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / kDotBlock; ++g) {
      const uint8_t* group = q + g * 4 * kChunkBytes + 32 * first;
      __m256i pairs[M][H];
      for (int w = 0; w < 4; ++w) {
        _mm_prefetch(reinterpret_cast<const char*>(group + w * kChunkBytes + kInterleavedPrefetchBytes), _MM_HINT_T0);
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + w * kChunkBytes + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          for (int m = 0; m < M; ++m) {
            const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xlo[m][4 * g + w])),
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xhi[m][4 * g + w])));
            pairs[m][h] = w == 0 ? both : _mm256_add_epi16(pairs[m][h], both);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const int64_t at = g * kInterleavedRows + 8 * (first + h);
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at)));
        for (int m = 0; m < M; ++m) {
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[m][h], ones));
          acc[m][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(x[m].block_scale[g])), acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x[m].group_sums[g]), acc[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(sums[m] + 8 * (first + h), acc[m][h]);
  }
}

// 8-bit weights with one scale a row (int8 per channel) with kInterleavedRows (16) rows interleaved: a tile's
// bytes [K / 4][16 rows][4 bytes]. Lane r of a 32-byte load is row 8h + r's next 4 weights, which meet x's 4
// bytes broadcast with w's sign moved onto x (int8_dot_tile's reason); each column's int16 pairs widen to int32
// (two of them could pass int16), a block's eight add in int32 and one FMA scales them by x's block scale.
// sums[m][r] = x[m] . w[r] before the row's scale, over one tile.
template <int M, int H = (M <= 2 ? 2 : 1)>
void int8_rows16_sums(const QuantizedRow* x, int64_t K, const uint8_t* q, float (*sums)[kInterleavedRows]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* xq[M];
  for (int m = 0; m < M; ++m) xq[m] = reinterpret_cast<const int32_t*>(x[m].lo.data());
  for (int first = 0; first < 2; first += H) {
    __m256 acc[M][H];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) acc[m][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / kDotBlock; ++b) {
      const uint8_t* block = q + b * 8 * kChunkBytes + 32 * first;
      __m256i dot[M][H];
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < H; ++h) {
          if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(block + j * kChunkBytes + kInterleavedPrefetchBytes), _MM_HINT_T0);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * kChunkBytes + 32 * h));
          const __m256i magnitude = _mm256_abs_epi8(w);
          for (int m = 0; m < M; ++m) {
            const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(xq[m][8 * b + j]), w);
            const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
            dot[m][h] = j == 0 ? d : _mm256_add_epi32(dot[m][h], d);
          }
        }
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < H; ++h)
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), _mm256_set1_ps(x[m].scale[8 * b]), acc[m][h]);
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(sums[m] + 8 * (first + h), acc[m][h]);
  }
}

// out[m][r] = x[m] . w[r] for M rows of x against R weight rows.
template <int M, int R, int BITS>
void int8_dot_tile(const QuantizedRow* x, const std::vector<ChunkGroups>& chunks, const QRow* rows, int64_t K,
                   int64_t group, float (*out)[R]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xlo_rows[M];
  const int8_t* xhi_rows[M];
  const float* xs_rows[M];
  for (int m = 0; m < M; ++m) {
    xlo_rows[m] = x[m].lo.data();
    xhi_rows[m] = BITS == 4 ? x[m].hi.data() : nullptr;
    xs_rows[m] = x[m].scale.data();
  }
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const ChunkGroups& cg = chunks[c];
    for (int h = 0; h < 2; ++h) {
      __m256i lo[R], hi[R];
      __m256 ws[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* bytes = rows[r].q + c * kChunkBytes + 32 * h;
        if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchRows * K * BITS / 8), _MM_HINT_T0);
        __m256i w;
        if (cg.bytes == kChunkBytes) [[likely]]
          w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
        else
          w = _mm256_maskload_epi32(reinterpret_cast<const int*>(bytes), cg.mask[h]);
        if constexpr (BITS == 4) {
          lo[r] = _mm256_and_si256(w, low4);
          hi[r] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        } else {
          lo[r] = w;
          hi[r] = _mm256_abs_epi8(w);  // at 8 bits `hi` holds |w|, which meets x with w's sign
        }
        ws[r] = half_scales<BITS>(rows[r].s, cg, h);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo_rows[m] + c * kChunkBytes + 32 * h));
        const __m256 xs = _mm256_loadu_ps(xs_rows[m] + c * 16 + 8 * h);
        for (int r = 0; r < R; ++r) {
          __m256i pairs;  // int16 sums of two products: at most 2 x 15 x 127 (4 bits, twice) or 2 x 128 x 127
          if constexpr (BITS == 4) {
            const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xhi_rows[m] + c * kChunkBytes + 32 * h));
            pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xlo), _mm256_maddubs_epi16(hi[r], xhi));
          } else {
            pairs = _mm256_maddubs_epi16(hi[r], _mm256_sign_epi8(xlo, lo[r]));  // |w| x (sign w) x
          }
          const __m256i dot = _mm256_madd_epi16(pairs, ones);
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[r], xs), acc[m][r]);
        }
      }
    }
  }
  if constexpr (BITS == 4) {  // plus, per group, its min times x summed over the group
    const int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g += 8) {
      const int64_t n = std::min<int64_t>(8, groups - g);
      __m256 mins[R];
      for (int r = 0; r < R; ++r) mins[r] = load_up_to_8(rows[r].m + g, n);
      for (int m = 0; m < M; ++m) {
        const __m256 sums = load_up_to_8(x[m].group_sums.data() + g, n);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(mins[r], sums, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum8(acc[m][r]);
}
#endif  // NANOVLLM_INT8_DOTS_VNNI
#endif  // NANOVLLM_INT8_DOTS

}  // namespace
