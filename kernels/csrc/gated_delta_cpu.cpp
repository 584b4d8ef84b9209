// A hybrid model's linear-attention decode step (worker/models/qwen3_5.py), on the state rows in place:
// the causal convolution's update and the gated delta rule's recurrent step for B sequences, each reading
// and writing its own row of the state tensors (no gather into a batch and scatter back, which moved the
// whole state three times more than the step needs: docs/performance.md#measurements-behind-choices-in-the-code).
// The arithmetic is worker/layers/gated_delta_rule.py's recurrent_step and causal_conv_step, in float32.
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include "cpu_common.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

void check_slots(const char* op, const at::Tensor& slots, int64_t batch, int64_t rows) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == batch, op,
              ": slots must be int64 [", batch, "], got ", slots.sizes(), " ", slots.scalar_type());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(0 <= s[b] && s[b] < rows, op, ": slot ", s[b], " is outside the state's ", rows, " rows");
}

}  // namespace

// x [B, C] -> SiLU(depthwise conv of each channel's last K - 1 inputs (state[slots[b], c]) and x[b, c] with
// weight [C, K]); the state rows shift in x. As transformers: the sum rounded to the dtype, then SiLU.
at::Tensor causal_conv_decode_(at::Tensor x, at::Tensor state, at::Tensor weight, at::Tensor slots) {
  check_one_dtype("causal_conv_decode_", {{"x", &x}, {"state", &state}, {"weight", &weight}});
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "causal_conv_decode_: x must be [B, C] with contiguous rows");
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.size(1) == x.size(1),
              "causal_conv_decode_: state must be contiguous [rows, C, K - 1], got ", state.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.size(1) == state.size(2) + 1,
              "causal_conv_decode_: weight must be contiguous [C, K], got ", weight.sizes());
  const int64_t batch = x.size(0), channels = x.size(1), width = weight.size(1), keep = width - 1;
  check_slots("causal_conv_decode_", slots, batch, state.size(0));
  auto out = at::empty({batch, channels}, x.options());
  dispatch("causal_conv_decode_", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* st = state.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t x_stride = x.stride(0);
    at::parallel_for(0, batch * channels, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / channels, c = i % channels;
        T* row = st + (slot[b] * channels + c) * keep;
        const T* wc = w + c * width;
        const T newest = xp[b * x_stride + c];
        float acc = 0.f;
        for (int64_t t = 0; t < keep; ++t) acc += load(wc[t]) * load(row[t]);
        acc += load(wc[keep]) * load(newest);
        for (int64_t t = 0; t + 1 < keep; ++t) row[t] = row[t + 1];
        if (keep > 0) row[keep - 1] = newest;
        const float y = rounded<T>(acc);
        op[b * channels + c] = to<T>(y / (1.f + exp_simd(-y)));
      }
    });
  });
  return out;
}

// One token of B sequences through the gated delta rule, each on state[slots[b]] ([heads, dk, dv] fp32,
// updated in place): q, k [B, key_heads, dk] and v [B, heads, dv] (any float dtype), g and beta [B, heads]
// fp32. q and k are L2-normalised (eps 1e-6 under the root), q scaled by dk^-0.5; key head h / (heads /
// key_heads) serves value head h. Returns the output [B, heads, dv] fp32.
at::Tensor gated_delta_decode_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                               at::Tensor state, at::Tensor slots) {
  check_one_dtype("gated_delta_decode_", {{"q", &q}, {"k", &k}, {"v", &v}});
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta_decode_: q, k must be [B, key_heads, dk] and v [B, heads, dv], got ", q.sizes(), " ",
              k.sizes(), " ", v.sizes());
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.size(1) == v.size(1) && state.size(2) == q.size(2) && state.size(3) == v.size(2),
              "gated_delta_decode_: state must be contiguous float32 [rows, heads, dk, dv], got ", state.sizes(),
              " ", state.scalar_type());
  const int64_t batch = q.size(0), key_heads = q.size(1), dk = q.size(2), heads = v.size(1), dv = v.size(2);
  TORCH_CHECK(heads % key_heads == 0, "gated_delta_decode_: ", heads, " value heads for ", key_heads, " key heads");
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == batch && t->size(1) == heads,
                "gated_delta_decode_: g and beta must be float32 [B, heads], got ", t->sizes(), " ", t->scalar_type());
  check_slots("gated_delta_decode_", slots, batch, state.size(0));
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  g = g.contiguous();
  beta = beta.contiguous();
  auto out = at::empty({batch, heads, dv}, q.options().dtype(at::kFloat));
  const int64_t group = heads / key_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  dispatch("gated_delta_decode_", q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const float* gp = g.data_ptr<float>();
    const float* bp = beta.data_ptr<float>();
    float* st = state.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qn(dk), kn(dk), read(dv);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / heads, h = i % heads, kh = h / group;
        const T* qh = qp + (b * key_heads + kh) * dk;
        const T* khp = kp + (b * key_heads + kh) * dk;
        float qq = 0.f, kk = 0.f;
        for (int64_t d = 0; d < dk; ++d) {
          qn[d] = load(qh[d]);
          kn[d] = load(khp[d]);
          qq += qn[d] * qn[d];
          kk += kn[d] * kn[d];
        }
        const float qs = scale / std::sqrt(qq + 1e-6f), ks = 1.f / std::sqrt(kk + 1e-6f);
        for (int64_t d = 0; d < dk; ++d) {
          qn[d] *= qs;
          kn[d] *= ks;
        }
        const float decay = std::exp(gp[b * heads + h]), beta_h = bp[b * heads + h];
        float* s = st + (slot[b] * heads + h) * dk * dv;
        const T* vh = vp + (b * heads + h) * dv;
        float* o = op + (b * heads + h) * dv;
        // read = k^T (decay S): what the decayed state predicts for k
        for (int64_t j = 0; j < dv; ++j) read[j] = 0.f;
        for (int64_t d = 0; d < dk; ++d) {
          const float kd = kn[d];
          const float* row = s + d * dv;
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) read[j] += row[j] * kd;
        }
        // delta = beta (v - read); S = decay S + k delta^T; o = q^T S
        for (int64_t j = 0; j < dv; ++j) {
          read[j] = (load(vh[j]) - read[j] * decay) * beta_h;  // read now holds delta
          o[j] = 0.f;
        }
        for (int64_t d = 0; d < dk; ++d) {
          const float kd = kn[d], qd = qn[d];
          float* row = s + d * dv;
#pragma omp simd
          for (int64_t j = 0; j < dv; ++j) {
            row[j] = row[j] * decay + kd * read[j];
            o[j] += row[j] * qd;
          }
        }
      }
    });
  });
  return out;
}
