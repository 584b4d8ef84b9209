// y = x W^T (+ b) for a few rows of x: the decoder's projections at small batch and speculative
// verification (the last token plus K proposals per sequence).
//
// With few rows a CPU matmul is bound by reading the weights, not by arithmetic, yet PyTorch's float32
// GEMM at 2 to 8 rows takes about as long as at 64 (2026-11-25, AMD EPYC AVX2, SmolLM2-135M's 30 layers
// and LM head: 70 ms at 2 rows, 39 ms at 1, against 25 and 21 ms here). Here each weight row is read once,
// from memory into registers, and serves every row of x: a tile of up to kTileRows rows of x (widened to
// fp32 once, then read from L1) against two weight rows at a time (linear_tile.h, which also states the
// order every sum is taken in).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "linear_tile.h"

#include <algorithm>
#include <vector>

namespace {

template <typename T>
void linear_impl(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t N, int64_t K) {
  const std::vector<float> xf = widen(x, rows * K);
  // Contiguous ranges of weight rows, 64 at least, an even count so that row pairs never straddle.
  at::parallel_for(0, (N + 1) / 2, 32, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * 2, n_end = std::min(N, end * 2);
    for (int64_t m = 0; m < rows; m += kTileRows) {
      const int64_t tile = std::min(kTileRows, rows - m);
      tile_fn<T, T>(tile)(xf.data() + m * K, w + n_begin * K, bias, y + m * N, n_begin, n_end, N, K);
    }
  });
}

template <typename T>
void linear_grouped_impl(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& weights,
                         std::vector<torch::Tensor>& ys) {
  const int64_t groups = static_cast<int64_t>(xs.size());
  std::vector<std::vector<float>> xf(groups);
  std::vector<int64_t> first_pair(groups + 1, 0);  // group g's weight row pairs are [first_pair[g], first_pair[g + 1])
  for (int64_t g = 0; g < groups; ++g) {
    xf[g] = widen(xs[g].data_ptr<T>(), xs[g].numel());
    first_pair[g + 1] = first_pair[g] + (weights[g].size(0) + 1) / 2;
  }
  // One range over every group's weight row pairs: each thread streams its share of all the weights, one
  // parallel region for the lot instead of one per group.
  at::parallel_for(0, first_pair[groups], 32, [&](int64_t begin, int64_t end) {
    int64_t g = std::upper_bound(first_pair.begin(), first_pair.end(), begin) - first_pair.begin() - 1;
    for (; begin < end; ++g) {
      const int64_t stop = std::min(end, first_pair[g + 1]);
      const int64_t rows = xs[g].size(0), N = weights[g].size(0), K = weights[g].size(1);
      const int64_t n_begin = (begin - first_pair[g]) * 2, n_end = std::min(N, (stop - first_pair[g]) * 2);
      const T* w = weights[g].data_ptr<T>();
      T* y = ys[g].data_ptr<T>();
      for (int64_t m = 0; m < rows; m += kTileRows) {
        const int64_t tile = std::min(kTileRows, rows - m);
        tile_fn<T, T>(tile)(xf[g].data() + m * K, w + n_begin * K, nullptr, y + m * N, n_begin, n_end, N, K);
      }
      begin = stop;
    }
  });
}

}  // namespace

// xs[g] @ weights[g].T for every g, each as linear_few_rows computes it (the same sums in the same order), in
// one parallel region: a decode step's chosen experts, each a few MB of weights, read as one stream.
std::vector<torch::Tensor> linear_grouped(std::vector<torch::Tensor> xs, std::vector<torch::Tensor> weights) {
  TORCH_CHECK(xs.size() == weights.size(), "linear_grouped: ", xs.size(), " inputs for ", weights.size(),
              " weights");
  std::vector<torch::Tensor> ys;
  if (xs.empty()) return ys;
  for (size_t g = 0; g < xs.size(); ++g) {
    TORCH_CHECK(xs[g].dim() == 2 && weights[g].dim() == 2 && xs[g].size(1) == weights[g].size(1),
                "linear_grouped: x [rows, K] and weight [N, K] must share K, got x ", xs[g].sizes(), " and weight ",
                weights[g].sizes(), " in group ", g);
    check_one_dtype("linear_grouped", {{"x", &xs[0]}, {"x", &xs[g]}, {"weight", &weights[g]}});
    xs[g] = xs[g].contiguous();
    weights[g] = weights[g].contiguous();
    ys.push_back(torch::empty({xs[g].size(0), weights[g].size(0)}, xs[g].options()));
  }
  dispatch("linear_grouped", xs[0].scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    linear_grouped_impl<T>(xs, weights, ys);
  });
  return ys;
}

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
