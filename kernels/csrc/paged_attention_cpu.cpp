// Decode attention straight from the paged KV cache, for CPUs.
//
// The PyTorch reference (kernels/attention.py) first gathers every sequence's blocks into a padded
// tensor and then calls SDPA: on a CPU that copy and the padded reads cost as much as the attention
// itself. Here each (sequence, kv head) task walks its block table in place, so K and V are read once.
// The query heads that share a kv head (GQA) are handled by the same task, so their K/V rows stay in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Scores of one query against 4 keys at once: four independent accumulator chains keep the FMA units
// busy, where a single dot product would wait on its own latency.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t n,
                 float* out) {
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

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3: one pass over y for four value rows.
inline void axpy4(const float* p, const float* v0, const float* v1, const float* v2, const float* v3, float* y,
                  int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p[0] * v0[i] + p[1] * v1[i] + p[2] * v2[i] + p[3] * v3[i];
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

// query [B, H, D], caches [num_blocks, block_size, KV, D], block_tables [B, max_blocks] (int64),
// context_lens [B] (int64). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_decode_attention: shape mismatch");
  auto out = torch::empty_like(query);

  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t token_stride = kv_heads * dim;  // between consecutive tokens of one block
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.assign(group * len, 0.f);
      // Pass 1: scores[g, t] = q_g . k_t * scale, four keys at a time.
      auto key = [&](int64_t t) {
        return kc + (table[t / block_size] * block_size + t % block_size) * token_stride + kvh * dim;
      };
      auto value = [&](int64_t t) {
        return vc + (table[t / block_size] * block_size + t % block_size) * token_stride + kvh * dim;
      };
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + (b * heads + kvh * group + g) * dim;
        float* s = scores.data() + g * len;
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) dot4(qg, key(t), key(t + 1), key(t + 2), key(t + 3), dim, s + t);
        for (; t < len; ++t) s[t] = dot(qg, key(t), dim);
        for (int64_t i = 0; i < len; ++i) s[i] *= fscale;
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float mx = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: out_g = sum_t p[g, t] * v_t, four value rows at a time.
      for (int64_t g = 0; g < group; ++g) {
        float* og = o + (b * heads + kvh * group + g) * dim;
        const float* p = scores.data() + g * len;
        std::fill_n(og, dim, 0.f);
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) axpy4(p + t, value(t), value(t + 1), value(t + 2), value(t + 3), og, dim);
        for (; t < len; ++t) axpy(p[t], value(t), og, dim);
      }
    }
  });
  return out;
}

// RMSNorm of each row of x [T, H] into out (which may alias x).
static void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * hidden;
      float* yr = out + r * hidden;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv * w[i];
    }
  });
}

// One call instead of the half-dozen ops of the PyTorch RMSNorm: at batch 1 every op launch costs more
// than its arithmetic, and a decoder layer has two norms.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm: contiguous float32 only");
  auto out = torch::empty_like(x);
  const int64_t hidden = x.size(-1);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.numel() / hidden, hidden,
                static_cast<float>(eps));
  return out;
}

// In place: residual += x, then x = RMSNorm(residual) * weight (the pre-norm residual stream update).
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && residual.is_contiguous() &&
                  weight.is_contiguous() && x.sizes() == residual.sizes(),
              "add_rms_norm_: contiguous float32 tensors of one shape only");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  at::parallel_for(0, rows * hidden, 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) rp[i] += xp[i];
  });
  rms_norm_rows(rp, weight.data_ptr<float>(), xp, rows, hidden, static_cast<float>(eps));
}

// silu(x[:, :n]) * x[:, n:] for x [T, 2n]: the SwiGLU gate in one pass instead of two ops.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: contiguous float32 [T, 2n] only");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * n;
      const float* up = gate + n;
      float* y = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// Rotate-half RoPE of x [T, heads, D] (any row stride, last dim contiguous) with per-token tables
// cos [T, 1, D] and signed sin [T, 1, D] (sin with its first half negated), into a new contiguous tensor.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "rotary: float32 [T, heads, D] with a contiguous last dimension only");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xi = xp + t * s0 + h * s1;
        float* y = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) y[i] = xi[i] * c[i] + xi[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < dim; ++i) y[i] = xi[i] * c[i] + xi[i - half] * s[i];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:] (CPU, fp32)");
  m.def("rotary", &rotary, "rotate-half RoPE with precomputed cos / signed sin rows (CPU, fp32)");
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache (CPU, fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, fp32)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual) (CPU, fp32, in place)");
}
