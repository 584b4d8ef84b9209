// y = x W^T (+ b) for a few rows of x: the decoder's projections at small batch and speculative
// verification (the last token plus K proposals per sequence).
//
// With few rows a CPU matmul is bound by reading the weights, not by arithmetic, yet PyTorch's float32
// GEMM at 2 to 8 rows takes about as long as at 64 (docs/performance.md#measurements-behind-choices-in-the-code).
// Here each weight row is read once,
// from memory into registers, and serves every row of x: a tile of up to kTileRows rows of x (widened to
// fp32 once, then read from L1) against one to four weight rows at a time (linear_tile.h, which also states
// the order every sum is taken in; tile_from_memory and tile_bf16 below say how many). Two tiles (9 to 16
// rows) take each 32 KB of weight rows in turn, the second from L1, rather than a pass over all the weights
// each (docs/performance.md#projections-at-few-rows-benchcpu_kernelspy---only-projections). Under
// --deterministic it also runs prefills, every row count in the same order: above two tiles x goes in blocks
// against panels of weights that stay in L2 (linear_range_blocked): a pass over the weights from memory for
// every 8 rows ran prefills at about half PyTorch's GEMM speed
// (docs/performance.md#measurements-behind-choices-in-the-code).
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include <ATen/Parallel.h>

#include "linear_tile.h"
#include "parallel_rows.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(NANOVLLM_LINEAR_AVX2)
// Prefills under --deterministic through 16-lane registers across outputs (panel_tile_wide, below).
#define NANOVLLM_LINEAR_WIDE 1
#endif

#if defined(__AVX512BF16__) && defined(NANOVLLM_LINEAR_WIDE)
#define NANOVLLM_LINEAR_BF16 1
// bf16 x and weights where the CPU multiplies bf16 itself (AVX512-BF16). vdpbf16ps takes 32 weights and 32
// inputs as they are, no widening, and adds their exact products into 16 fp32 lanes, two per lane: a
// quarter of the AVX2 tile's instructions per weight byte, which at 3 to 8 rows of x had made that tile
// bound by its arithmetic (docs/performance.md#measurements-behind-choices-in-the-code). The order
// of every sum is again fixed whatever the number of rows: lane l adds the products k = 32j + 2l and
// 32j + 2l + 1 in order of j, the 16 lanes are added in a fixed tree, then the tail k >= K - K % 32, then
// the bias, and the result is rounded to bf16 once. It is another order than the AVX2 tile's, so a bf16
// result may differ from another machine's in its last bit; within one machine it never changes.
template <int M, int R>
void tile_rows_bf16(const c10::BFloat16* x, const c10::BFloat16* w_first, const c10::BFloat16* bias,
                    c10::BFloat16* y, int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  const int64_t k_vec = K - K % 32;
  for (int64_t n = n_begin; n < n_end; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n_end - n));
    const c10::BFloat16* w[R];
    for (int r = 0; r < R; ++r) w[r] = w_first + (n - n_begin + std::min(r, rows - 1)) * K;  // a missing row repeats the last
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_vec; k += 32) {
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kPrefetchRows * K + k), _MM_HINT_T0);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int m = 0; m < M; ++m) {
        // (lanes 0-7 + lanes 8-15), then hsum8's tree over the 8 sums.
        const __m512 v = acc[m][r];
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        float s = hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), high));
        for (int64_t k = k_vec; k < K; ++k) s += load(x[m * K + k]) * load(w[r][k]);
        if (bias != nullptr) s += load(bias[n + r]);
        y[m * N + n + r] = to<c10::BFloat16>(s);
      }
    }
  }
}

using TileBf16 = void (*)(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t,
                          int64_t, int64_t, int64_t);

// The tile for 1 to kTileRows rows of x: up to 4 rows one weight row at a time, two above. One row at a
// time each thread reads its weights as one sequential stream, and one vdpbf16ps chain per row of x keeps
// up with the memory (64 weight bytes an instruction); four rows a pass (four streams 4 KB apart) read the
// LM head's shape from memory a quarter slower at one row. From 5 rows of x, two weight rows a pass halve the
// loads of x per weight byte, which bind there (docs/performance.md, Projections at few rows).
TileBf16 tile_bf16(int64_t rows) {
  static const TileBf16 table[kTileRows] = {
      tile_rows_bf16<1, 1>, tile_rows_bf16<2, 1>, tile_rows_bf16<3, 1>, tile_rows_bf16<4, 1>,
      tile_rows_bf16<5, 2>, tile_rows_bf16<6, 2>, tile_rows_bf16<7, 2>, tile_rows_bf16<8, 2>};
  return table[rows - 1];
}
#endif

// linear_tile.h's tile for weights of type T read from memory. fp32 weights up to 4 rows of x go one weight
// row a pass, one sequential stream a thread, faster from memory; one chain of 8-lane FMAs a row of x keeps
// up with the memory at 4 bytes a weight. 16-bit weights keep the default: widened first, one chain read
// them a third slower (docs/performance.md, Projections at few rows).
template <typename T>
TileFn<T, T> tile_from_memory(int64_t rows) {
  if constexpr (std::is_same_v<T, float>) {
    static const TileFn<float, float> table[kTileRows] = {
        tile_rows<1, float, float, 1>, tile_rows<2, float, float, 1>, tile_rows<3, float, float, 1>,
        tile_rows<4, float, float, 1>, tile_rows<5, float, float>,    tile_rows<6, float, float>,
        tile_rows<7, float, float>,    tile_rows<8, float, float>};
    return table[rows - 1];
  } else {
    return tile_fn<T, T>(rows);
  }
}

// The weight bytes a chunk when linear_range has more than one tile of x: read from memory by the first
// tile, from L1 or L2 by the others.
constexpr int64_t kTileChunkBytes = 32 * 1024;
// Up to this many tiles of x's rows read the weights once (linear_range); more go in blocks against panels.
constexpr int64_t kFewRowsTiles = 2;

// y[:, n_begin:n_end] for every tile of x's rows: bf16 through the native tile where there is one, else x
// widened to fp32 once (`xf`, filled by the caller) through linear_tile.h's.
template <typename T>
void tiles_over(const T* x, const float* xf, const T* w, const T* bias, T* y, int64_t rows, int64_t n_begin,
                int64_t n_end, int64_t N, int64_t K) {
  for (int64_t m = 0; m < rows; m += kTileRows) {
    const int64_t tile = std::min(kTileRows, rows - m);
#ifdef NANOVLLM_LINEAR_BF16
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      tile_bf16(tile)(x + m * K, w + n_begin * K, bias, y + m * N, n_begin, n_end, N, K);
      continue;
    }
#endif
    tile_from_memory<T>(tile)(xf + m * K, w + n_begin * K, bias, y + m * N, n_begin, n_end, N, K);
  }
}

// tiles_over, with more than one tile in chunks of weight rows, so that the weights are read from memory once.
template <typename T>
void linear_range(const T* x, const std::vector<float>& xf, const T* w, const T* bias, T* y, int64_t rows,
                  int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  if (rows <= kTileRows) return tiles_over(x, xf.data(), w, bias, y, rows, n_begin, n_end, N, K);
  const int64_t chunk = std::max<int64_t>(2, kTileChunkBytes / (K * static_cast<int64_t>(sizeof(T))) / 2 * 2);
  for (int64_t n = n_begin; n < n_end; n += chunk)
    tiles_over(x, xf.data(), w, bias, y, rows, n, std::min(n_end, n + chunk), N, K);
}

// x widened to fp32, for the tiles that read it so (all but the native bf16 one).
template <typename T>
std::vector<float> widened(const T* x, int64_t count) {
#ifdef NANOVLLM_LINEAR_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) return {};
#endif
  return widen(x, count);
}

// Bytes of x's fp32 rows, and of weights, that a blocked pass keeps in L2 together (a core's L2 is 512 KiB
// to 2 MiB on the CPUs this runs on).
constexpr int64_t kBlockBytes = 192 * 1024;
// Rows of x a blocked pass runs against two weight rows at once: 12 accumulators (linear_tile.h's widest).
constexpr int kBlockTileRows = 6;

#ifdef NANOVLLM_LINEAR_WIDE
// Weight rows a panel of the across-outputs tile holds: four vectors of 16 outputs.
constexpr int64_t kPanelOutputs = 64;

// A 16 x 16 block of 32-bit values transposed in registers: v[r] lane c becomes v[c] lane r.
inline void transpose16x16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // v[i + c]: rows i..i+3 of columns c, c + 4, c + 8, c + 12
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int h = 0; h < 4; ++h) {
      t[i + h] = _mm512_shuffle_i32x4(v[i + h], v[i + h + 4], 0x88);
      t[i + h + 4] = _mm512_shuffle_i32x4(v[i + h], v[i + h + 4], 0xDD);
    }
  for (int h = 0; h < 8; ++h) {
    v[h] = _mm512_shuffle_i32x4(t[h], t[h + 8], 0x88);
    v[h + 8] = _mm512_shuffle_i32x4(t[h], t[h + 8], 0xDD);
  }
}

// Bytes of packed weights a thread holds at once: with a block of x they stay in a core's L2 while the block
// goes through them (x is read again for each part: from L3, a few MB a step). Measured against 256 KB and
// 2 MB (docs/performance.md#measurements-behind-choices-in-the-code).
constexpr int64_t kPackedBytes = 512 << 10;

// hsum8's tree taken on 8 vectors lane(0..7) instead of 8 lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
template <typename Lane>
inline __m512 hsum8_tree(Lane&& lane) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(lane(0), lane(4)), _mm512_add_ps(lane(2), lane(6))),
                       _mm512_add_ps(_mm512_add_ps(lane(1), lane(5)), _mm512_add_ps(lane(3), lane(7))));
}

// The blocked prefill loop of the packed tiles: the thread's weight rows [n_begin, n_end) packed
// kPackedBytes at a time, each part once (pack(n, part_end, out): the panel of 64 rows from n, `panel_size`
// values of P), then x in blocks of x_rows against each packed panel of the part in turn, 6 rows of x a pass
// (tile6(m, panel, n, valid)), a block's last rows through rest(m, count, n, n_end) on the unpacked weights.
template <typename P, typename Pack, typename Tile, typename Rest>
void for_each_packed_panel(int64_t rows, int64_t n_begin, int64_t n_end, int64_t x_rows, int64_t panel_size,
                           Pack&& pack, Tile&& tile6, Rest&& rest) {
  const int64_t panels_at_once =
      std::max<int64_t>(1, kPackedBytes / static_cast<int64_t>(sizeof(P)) / std::max<int64_t>(panel_size, 1));
  thread_local std::vector<P> packed;  // kept: a fresh allocation a call paid its page faults again
  for (int64_t part = n_begin; part < n_end; part += panels_at_once * kPanelOutputs) {
    const int64_t part_end = std::min(n_end, part + panels_at_once * kPanelOutputs);
    const int64_t panels = (part_end - part + kPanelOutputs - 1) / kPanelOutputs;
    if (rows >= 6) {
      if (static_cast<int64_t>(packed.size()) < panels * panel_size) packed.resize(panels * panel_size);
      for (int64_t i = 0; i < panels; ++i) pack(part + i * kPanelOutputs, part_end, packed.data() + i * panel_size);
    }
    for (int64_t x0 = 0; x0 < rows; x0 += x_rows) {
      const int64_t x_end = std::min(rows, x0 + x_rows);
      for (int64_t i = 0; i < panels; ++i) {
        const int64_t p = part + i * kPanelOutputs, p_end = std::min(part_end, p + kPanelOutputs);
        int64_t m = x0;
        for (; m + 6 <= x_end; m += 6) tile6(m, packed.data() + i * panel_size, p, p_end - p);
        if (m < x_end) rest(m, x_end - m, p, p_end);
      }
    }
  }
}

// Weight rows [n, n + 64) (those at or past n_end repeat the last) widened to fp32 and packed as
// panel_tile_wide reads them: for each lane l of linear_tile.h's 8 and each 8-weight step j, the 64 rows'
// weight k = 8j + l side by side, [8][k_vec / 8][64] in all.
template <typename T>
void pack_panel_wide(const T* w, int64_t n, int64_t n_end, int64_t K, float* out) {
  const int64_t steps = vector_end(K) / 8;
  for (int64_t i0 = 0; i0 < kPanelOutputs; i0 += 16) {
    const T* rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = w + std::min(n + i0 + r, n_end - 1) * K;
    for (int64_t j = 0; j < steps; j += 2) {  // two steps (16 weights) a row at a time, one at the end
      const int64_t count = std::min<int64_t>(16, (steps - j) * 8);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      __m512i v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_castps_si512(load16(rows[r] + 8 * j, mask));
      transpose16x16(v);  // v[c]: weight 8j + c of each of the 16 rows
      for (int64_t c = 0; c < count; ++c)
        _mm512_storeu_si512(out + ((c % 8) * steps + j + c / 8) * kPanelOutputs + i0, v[c]);
    }
  }
}

// y[m][n + i] for M rows of x (fp32) against a packed panel (valid of its 64 outputs written): tile_rows'
// sums bit for bit, vectorised across 16 outputs a register instead of within one output's 8 lanes. Lane
// l's partial sum over the steps j is here a vector of 64 outputs' lane-l sums (the same FMAs in the same
// order, x broadcast), and hsum8's tree is taken on those vectors: with AVX-512 twice the lanes of
// linear_tile.h's AVX2 registers and no horizontal sums, where that tile ran PyTorch's float32 GEMM's
// prefills at about half its speed (docs/performance.md#measurements-behind-choices-in-the-code).
template <int M, typename T, typename Y>
void panel_tile_wide(const float* x, const float* panel, const T* w, const Y* bias, Y* y, int64_t n, int64_t valid,
                     int64_t N, int64_t K) {
  const int64_t k_vec = vector_end(K), steps = k_vec / 8;
  alignas(64) float lanes[8][M][kPanelOutputs];
  for (int l = 0; l < 8; ++l) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_setzero_ps();
    const float* p = panel + l * steps * kPanelOutputs;
    for (int64_t j = 0; j < steps; ++j) {
      __m512 wv[4];
      for (int b = 0; b < 4; ++b) wv[b] = _mm512_loadu_ps(p + j * kPanelOutputs + 16 * b);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * K + 8 * j + l]);
        for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < 4; ++b) _mm512_store_ps(lanes[l][m] + 16 * b, acc[m][b]);
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < 4 && 16 * b < valid; ++b) {
      const __m512 sum = hsum8_tree([&](int i) { return _mm512_load_ps(lanes[i][m] + 16 * b); });
      const int64_t count = std::min<int64_t>(16, valid - 16 * b);
      if constexpr (std::is_same_v<Y, float>) {
        if (k_vec == K) {
          const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
          const __m512 with_bias = bias == nullptr ? sum : _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + n + 16 * b));
          _mm512_mask_storeu_ps(y + m * N + n + 16 * b, mask, with_bias);
          continue;
        }
      }
      _mm512_store_ps(lanes[0][m] + 16 * b, sum);  // the tail in order, then the bias, one output at a time
      for (int64_t i = 16 * b; i < 16 * b + count; ++i) {
        float s = lanes[0][m][i];
        for (int64_t k = k_vec; k < K; ++k) s += x[m * K + k] * load(w[(n + i) * K + k]);
        if (bias != nullptr) s += load(bias[n + i]);
        y[m * N + n + i] = to<Y>(s);
      }
    }
}

// linear_range_blocked with AVX-512: x (widened) in blocks of 192 KB against packed panels
// (for_each_packed_panel), 6 rows of x a pass through panel_tile_wide (24 accumulators, 4 weight and 1 x
// register of the 32), a block's last rows through linear_tile.h's tile: each output's sum the same.
template <typename T>
void linear_range_blocked_wide(const std::vector<float>& xf, const T* w, const T* bias, T* y, int64_t rows,
                               int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  for_each_packed_panel<float>(
      rows, n_begin, n_end, std::max<int64_t>(6, kBlockBytes / (K * 4) / 6 * 6), kPanelOutputs * vector_end(K),
      [&](int64_t n, int64_t part_end, float* out) { pack_panel_wide(w, n, part_end, K, out); },
      [&](int64_t m, const float* panel, int64_t n, int64_t valid) {
        panel_tile_wide<6>(xf.data() + m * K, panel, w, bias, y + m * N, n, valid, N, K);
      },
      [&](int64_t m, int64_t count, int64_t n, int64_t n_stop) {
        tile_fn<T, T>(count)(xf.data() + m * K, w + n * K, bias, y + m * N, n, n_stop, N, K);
      });
}
#endif

// y[:, n_begin:n_end] for more rows of x than one tile (a prefill under --deterministic): x in blocks of
// rows and the weights in panels that stay in L2 together, each panel read from memory once per block of x
// instead of once per tile (the first tile's pass over a panel still reads it from memory: the weights are
// prefetched). Only the order of (row, output) pairs changes; each output's sum is the tile's.
template <typename T>
void linear_range_blocked(const std::vector<float>& xf, const T* w, const T* bias, T* y, int64_t rows,
                          int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
#ifdef NANOVLLM_LINEAR_WIDE
  linear_range_blocked_wide(xf, w, bias, y, rows, n_begin, n_end, N, K);
#else
  const int64_t x_rows = std::max<int64_t>(kBlockTileRows, kBlockBytes / (K * 4) / kBlockTileRows * kBlockTileRows);
  const int64_t panel = std::max<int64_t>(2, kBlockBytes / (K * static_cast<int64_t>(sizeof(T))) / 2 * 2);
  for (int64_t x0 = 0; x0 < rows; x0 += x_rows) {
    const int64_t x_end = std::min(rows, x0 + x_rows);
    for (int64_t p = n_begin; p < n_end; p += panel) {
      const int64_t p_end = std::min(n_end, p + panel);
      int64_t m = x0;
      for (; m + kBlockTileRows <= x_end; m += kBlockTileRows)
        tile_rows<kBlockTileRows, T, T, 2>(xf.data() + m * K, w + p * K, bias, y + m * N, p, p_end, N, K);
      if (m < x_end) tile_fn<T, T>(x_end - m)(xf.data() + m * K, w + p * K, bias, y + m * N, p, p_end, N, K);
    }
  }
#endif
}

#ifdef NANOVLLM_LINEAR_BF16
// Weight rows [n, n + 64) (those at or past n_end repeat the last) packed as panel_tile_bf16 reads them: for
// each lane l of tile_rows_bf16's accumulators and each 32-weight step j, the 64 rows' pairs (k = 32j + 2l,
// 32j + 2l + 1) side by side, [16][k_vec / 32][64] pairs in all.
void pack_panel_bf16(const c10::BFloat16* w, int64_t n, int64_t n_end, int64_t K, uint32_t* out) {
  const int64_t steps = (K - K % 32) / 32;
  for (int64_t i0 = 0; i0 < kPanelOutputs; i0 += 16) {
    const c10::BFloat16* rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = w + std::min(n + i0 + r, n_end - 1) * K;
    for (int64_t j = 0; j < steps; ++j) {
      __m512i v[16];
      for (int r = 0; r < 16; ++r) v[r] = _mm512_loadu_si512(rows[r] + 32 * j);
      transpose16x16(v);  // v[l]: lane l's pair of each of the 16 rows
      for (int l = 0; l < 16; ++l) _mm512_storeu_si512(out + (l * steps + j) * kPanelOutputs + i0, v[l]);
    }
  }
}

// y[m][n + i] for M rows of x against a packed panel (valid of its 64 outputs written): the sums of
// tile_rows_bf16 bit for bit, vectorised across outputs instead of within one. Lane l's partial sum over
// the steps j, which tile_rows_bf16 keeps in lane l of one accumulator, is here a vector of 64 outputs'
// lane-l sums (the same VDPBF16PS steps in the same order, x's pair broadcast), and its tree over the 16
// lanes (lanes l + 8 first, then hsum8's) is taken on those vectors: no horizontal sums, which at 6 x 4 per
// tile had held tile_rows_bf16 to 0.8x of PyTorch's GEMM (docs/performance.md#measurements-behind-choices-in-the-code).
template <int M>
void panel_tile_bf16(const c10::BFloat16* x, const uint32_t* panel, const c10::BFloat16* w, const c10::BFloat16* bias,
                     c10::BFloat16* y, int64_t n, int64_t valid, int64_t N, int64_t K) {
  const int64_t k_vec = K - K % 32, steps = k_vec / 32;
  alignas(64) float lanes[8][M][kPanelOutputs];  // lane l + lane l + 8, as tile_rows_bf16's first add
  for (int l = 0; l < 16; ++l) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_setzero_ps();
    const uint32_t* p = panel + l * steps * kPanelOutputs;
    for (int64_t j = 0; j < steps; ++j) {
      __m512bh wv[4];
      for (int b = 0; b < 4; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(p + j * kPanelOutputs + 16 * b);
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 32 * j + 2 * l, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < 4; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < 4; ++b) {
        float* dst = lanes[l & 7][m] + 16 * b;
        _mm512_store_ps(dst, l < 8 ? acc[m][b] : _mm512_add_ps(_mm512_load_ps(dst), acc[m][b]));
      }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < 4 && 16 * b < valid; ++b) {
      __m512 sum = hsum8_tree([&](int i) { return _mm512_load_ps(lanes[i][m] + 16 * b); });
      const int64_t count = std::min<int64_t>(16, valid - 16 * b);
      if (k_vec < K) {  // the tail in order, then the bias, one output at a time
        _mm512_store_ps(lanes[0][m] + 16 * b, sum);
        for (int64_t i = 16 * b; i < 16 * b + count; ++i) {
          float s = lanes[0][m][i];
          for (int64_t k = k_vec; k < K; ++k) s += load(x[m * K + k]) * load(w[(n + i) * K + k]);
          if (bias != nullptr) s += load(bias[n + i]);
          y[m * N + n + i] = to<c10::BFloat16>(s);
        }
        continue;
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      if (bias != nullptr) {
        const __m256i bits = _mm256_maskz_loadu_epi16(mask, bias + n + 16 * b);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
      }
      // to<c10::BFloat16>'s rounding, 16 lanes at a time: to nearest even, a NaN the quiet 0x7FC0
      const __m512i u = _mm512_castps_si512(sum);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(y + m * N + n + 16 * b, mask, _mm512_cvtepi32_epi16(bits));
    }
}

// linear_range_blocked for the native bf16 tile, which reads x as it is: x in blocks of 384 KB against
// packed panels (for_each_packed_panel), 6 rows of x a pass through panel_tile_bf16, a block's last rows
// through tile_rows_bf16: each output's sum the same, tile_rows_bf16's steps in its order. Without the blocks
// every 8 rows of x streamed the weights from memory again: an LM head at 64 rows ran at 0.45x PyTorch's
// GEMM, 1.0x with them (docs/performance.md#deterministic-inference-benchdeterministicpy).
void linear_range_blocked_bf16(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                               c10::BFloat16* y, int64_t rows, int64_t n_begin, int64_t n_end, int64_t N, int64_t K) {
  for_each_packed_panel<uint32_t>(
      rows, n_begin, n_end, std::max<int64_t>(6, 2 * kBlockBytes / (K * 2) / 6 * 6), kPanelOutputs * ((K - K % 32) / 2),
      [&](int64_t n, int64_t part_end, uint32_t* out) { pack_panel_bf16(w, n, part_end, K, out); },
      [&](int64_t m, const uint32_t* panel, int64_t n, int64_t valid) {
        panel_tile_bf16<6>(x + m * K, panel, w, bias, y + m * N, n, valid, N, K);
      },
      [&](int64_t m, int64_t count, int64_t n, int64_t n_stop) {
        tile_bf16(count)(x + m * K, w + n * K, bias, y + m * N, n, n_stop, N, K);
      });
}
#endif

template <typename T>
void linear_impl(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t N, int64_t K) {
  if (nanovllm::DecodeTeam* team = nanovllm::DecodeTeam::current())
    team->reads({{reinterpret_cast<const char*>(w), N * K * static_cast<int64_t>(sizeof(T))}});
  const std::vector<float> xf = widened(x, rows * K);
  // Weight row pairs (so that pairs never straddle), 64 rows at least a thread: a few rows of x read the
  // weights once (parallel_rows), more are bound by their arithmetic.
  if (rows <= kFewRowsTiles * kTileRows) {
    const int64_t grain = std::max<int64_t>(32, kClaimBytes / (2 * K * static_cast<int64_t>(sizeof(T))));
    return parallel_rows((N + 1) / 2, grain, [&](int64_t begin, int64_t end) {
      linear_range(x, xf, w, bias, y, rows, begin * 2, std::min(N, end * 2), N, K);
    });
  }
  nanovllm::parallel_for(0, (N + 1) / 2, 32, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * 2, n_end = std::min(N, end * 2);
#ifdef NANOVLLM_LINEAR_BF16
    if constexpr (std::is_same_v<T, c10::BFloat16>) return linear_range_blocked_bf16(x, w, bias, y, rows, n_begin, n_end, N, K);
#endif
    linear_range_blocked(xf, w, bias, y, rows, n_begin, n_end, N, K);
  });
}

template <typename T>
void linear_grouped_impl(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& weights,
                         std::vector<at::Tensor>& ys) {
  const int64_t groups = static_cast<int64_t>(xs.size());
  std::vector<std::vector<float>> xf(groups);
  std::vector<int64_t> first_pair(groups + 1, 0);  // group g's weight row pairs are [first_pair[g], first_pair[g + 1])
  for (int64_t g = 0; g < groups; ++g) {
    xf[g] = widened(xs[g].data_ptr<T>(), xs[g].numel());
    first_pair[g + 1] = first_pair[g] + (weights[g].size(0) + 1) / 2;
  }
  // One range over every group's weight row pairs: each thread streams its share of all the weights, one
  // parallel region for the lot instead of one per group.
  nanovllm::parallel_for(0, first_pair[groups], 32, [&](int64_t begin, int64_t end) {
    int64_t g = std::upper_bound(first_pair.begin(), first_pair.end(), begin) - first_pair.begin() - 1;
    for (; begin < end; ++g) {
      const int64_t stop = std::min(end, first_pair[g + 1]);
      const int64_t rows = xs[g].size(0), N = weights[g].size(0), K = weights[g].size(1);
      const int64_t n_begin = (begin - first_pair[g]) * 2, n_end = std::min(N, (stop - first_pair[g]) * 2);
      linear_range(xs[g].data_ptr<T>(), xf[g], weights[g].data_ptr<T>(), static_cast<const T*>(nullptr),
                   ys[g].data_ptr<T>(), rows, n_begin, n_end, N, K);
      begin = stop;
    }
  });
}

}  // namespace

// xs[g] @ weights[g].T for every g, each as linear_few_rows computes it (the same sums in the same order), in
// one parallel region: a decode step's chosen experts, each a few MB of weights, read as one stream.
std::vector<at::Tensor> linear_grouped(std::vector<at::Tensor> xs, std::vector<at::Tensor> weights) {
  TORCH_CHECK(xs.size() == weights.size(), "linear_grouped: ", xs.size(), " inputs for ", weights.size(),
              " weights");
  std::vector<at::Tensor> ys;
  if (xs.empty()) return ys;
  for (size_t g = 0; g < xs.size(); ++g) {
    TORCH_CHECK(xs[g].dim() == 2 && weights[g].dim() == 2 && xs[g].size(1) == weights[g].size(1),
                "linear_grouped: x [rows, K] and weight [N, K] must share K, got x ", xs[g].sizes(), " and weight ",
                weights[g].sizes(), " in group ", g);
    check_one_dtype("linear_grouped", {{"x", &xs[0]}, {"x", &xs[g]}, {"weight", &weights[g]}});
    xs[g] = xs[g].contiguous();
    weights[g] = weights[g].contiguous();
    ys.push_back(at::empty({xs[g].size(0), weights[g].size(0)}, xs[g].options()));
  }
  dispatch("linear_grouped", xs[0].scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    linear_grouped_impl<T>(xs, weights, ys);
  });
  return ys;
}

// x [rows, K], weight [N, K], bias [N] or None, one dtype; returns [rows, N] in it. Any number of rows is
// correct; the layers call it for few rows only (kernels/cpu_kernels.py FEW_ROWS_MAX), where it is faster.
at::Tensor linear_few_rows(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
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
  auto y = at::empty({rows, N}, x.options());
  if (rows == 0) return y;
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  dispatch("linear_few_rows", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    linear_impl(x.data_ptr<T>(), weight.data_ptr<T>(), b.defined() ? b.data_ptr<T>() : nullptr, y.data_ptr<T>(),
                rows, N, K);
  });
  return y;
}
