// y += each row's LoRA adapter applied to x, for a step's rows grouped by adapter slot: one call per
// projection instead of a gather, two matmuls per part and a scatter per adapter (with 8 adapters in a
// W64 decode step that was about 30 small PyTorch calls per projection, a third of the step's LoRA cost).
//
// A group's rows go through linear_tile.h's register tiles, up to kTileRows at a time: the shrink
// s = x A_p^T per part p (fp32, never rounded), then the expand s B_p^T of that part's output features,
// added to y and rounded to its dtype once. Every sum is taken in the tile's fixed order, so a row's result
// never depends on the rows beside it (batch-invariant, as --deterministic needs).
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include <ATen/Parallel.h>
#include "decode_team.h"

#include "linear_tile.h"

#include <algorithm>
#include <vector>

namespace {

template <typename T>
void lora_add_impl(T* y, const T* x, const T* a, const T* b, const int64_t* rows, const int64_t* starts,
                   const int64_t* slots, const std::vector<int64_t>& parts, int64_t groups, int64_t rank, int64_t K,
                   int64_t N) {
  const int64_t num_parts = static_cast<int64_t>(parts.size()) - 1;
  // Tasks: (group, tile of up to kTileRows of its rows); each writes only its own rows of y.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = starts[g]; r < starts[g + 1]; r += kTileRows) tasks.emplace_back(g, r);
  nanovllm::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kTileRows * K), s(kTileRows * rank), delta(kTileRows * N);
    for (int64_t t = begin; t < end; ++t) {
      const auto [g, first] = tasks[t];
      const int64_t tile = std::min(kTileRows, starts[g + 1] - first);
      for (int64_t m = 0; m < tile; ++m) {
        const T* row = x + rows[first + m] * K;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) xf[m * K + k] = load(row[k]);
      }
      const T* a_slot = a + slots[g] * num_parts * rank * K;
      const T* b_slot = b + slots[g] * N * rank;
      for (int64_t p = 0; p < num_parts; ++p) {
        tile_fn<T, float>(tile)(xf.data(), a_slot + p * rank * K, nullptr, s.data(), 0, rank, rank, K);
        tile_fn<T, float>(tile)(s.data(), b_slot + parts[p] * rank, nullptr, delta.data(), parts[p], parts[p + 1], N,
                                rank);
      }
      for (int64_t m = 0; m < tile; ++m) {
        T* out = y + rows[first + m] * N;
        const float* d = delta.data() + m * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) out[n] = to<T>(load(out[n]) + d[n]);
      }
    }
  });
}

}  // namespace

// y [rows, N] += for each group g (rows[starts[g]:starts[g + 1]], adapter slot slots[g]) and part p (output
// features parts[p]:parts[p + 1]): (x A[slot, p*rank:(p+1)*rank]^T) B[slot, parts[p]:parts[p+1]]^T.
// x [rows, K], a [slots, parts * rank, K], b [slots, N, rank], one dtype; rows, starts, slots int64.
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor rows,
               at::Tensor starts, at::Tensor slots, std::vector<int64_t> parts) {
  check_one_dtype("lora_add_", {{"y", &y}, {"x", &x}, {"a", &a}, {"b", &b}});
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && x.dim() == 2 && x.size(0) == y.size(0), "lora_add_: y [rows, N] "
              "(contiguous) and x [rows, K] must share rows, got ", y.sizes(), " and ", x.sizes());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(2) == x.size(1) && b.size(1) == y.size(1) &&
                  a.size(0) == b.size(0) && parts.size() >= 2 && a.size(1) == b.size(2) * (int64_t)(parts.size() - 1),
              "lora_add_: a [slots, parts * rank, K] and b [slots, N, rank] do not fit x ", x.sizes(), " and y ",
              y.sizes(), ": got ", a.sizes(), " and ", b.sizes(), " for ", parts.size() - 1, " parts");
  TORCH_CHECK(parts.front() == 0 && parts.back() == y.size(1), "lora_add_: parts must span [0, ", y.size(1), "]");
  for (const auto* t : {&rows, &starts, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1, "lora_add_: rows, starts and slots are int64 vectors");
  TORCH_CHECK(starts.size(0) == slots.size(0) + 1, "lora_add_: starts must have one more entry than slots");
  x = x.contiguous();
  a = a.contiguous();
  b = b.contiguous();
  rows = rows.contiguous();
  const int64_t groups = slots.size(0), rank = b.size(2), K = x.size(1), N = y.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[groups] == rows.size(0), "lora_add_: starts must run from 0 to the rows' count");
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(start[g] <= start[g + 1] && slot[g] >= 0 && slot[g] < a.size(0), "lora_add_: group ", g, " has slot ",
                slot[g], " of ", a.size(0), " or decreasing starts");
  for (int64_t r = 0; r < rows.size(0); ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < y.size(0), "lora_add_: row ", row[r], " outside [0, ", y.size(0), ")");
  dispatch("lora_add_", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    lora_add_impl(y.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<T>(), b.data_ptr<T>(), rows.data_ptr<int64_t>(),
                  starts.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), parts, groups, rank, K, N);
  });
}
