// CPU kernels for the decoder's small ops: decode attention straight from the paged KV cache, RMSNorm
// (alone and fused with the residual add), the SwiGLU gate and RoPE.
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
// attention itself. Here each (sequence, kv head) task walks its block table in place, so K and V are read
// once. The query heads that share a kv head (GQA) are handled by the same task, so their K/V rows stay in
// cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

// ---- 16-bit loads and stores, written without branches so that GCC vectorises them inside
// `#pragma omp simd` loops: c10's own conversions are scalar (a NaN branch for bf16; F16C scalar
// intrinsics for fp16, and GCC 12 vectorises _Float16 only on CPUs with AVX512-FP16). All are exact
// (widening) or round to nearest even, as PyTorch's conversions; the tests compare them bit for bit.

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// fp16 <-> fp32: the portable conversions of the FP16 library (Maratyszcza), which c10 uses where F16C
// is missing. They rely on IEEE float rounding: never build this file with -ffast-math.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  // normal: exponent and mantissa moved into place, the exponent rebiased by a multiplication
  const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // subnormal: the mantissa in a float of exponent -1, minus that float's implicit 0.5
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_to_float(sign | float_to_bits(two_w < (1u << 27) ? subnormal : normal));
}
inline uint16_t float_to_half_bits(float f) {
  // scaling up then down lets the float rounding drop exactly the bits a half cannot hold
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));  // NaN: 0x7E00
}

inline float load(float x) { return x; }
// bf16 is the upper half of an fp32: widening is a shift.
inline float load(c10::BFloat16 x) { return bits_to_float(static_cast<uint32_t>(x.x) << 16); }
inline float load(c10::Half x) { return half_bits_to_float(x.x); }

// Round an fp32 to T.
template <typename T>
inline T to(float f);
template <>
inline float to<float>(float f) {
  return f;
}
template <>
inline c10::BFloat16 to<c10::BFloat16>(float f) {
  const uint32_t u = float_to_bits(f);
  uint16_t bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  if (f != f) bits = 0x7FC0;  // NaN stays a (quiet) NaN; a select once vectorised
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}
template <>
inline c10::Half to<c10::Half>(float f) {
  return c10::Half(float_to_half_bits(f), c10::Half::from_bits());
}

// f rounded to T's precision and back: where transformers rounds an intermediate to the model's dtype.
template <typename T>
inline float rounded(float f) {
  return load(to<T>(f));
}

// e^x in a form GCC vectorises (a call to expf keeps a loop scalar, 6x slower here: the SwiGLU gate
// lost to PyTorch's vectorised F.silu): x = k ln2 + r, |r| <= ln2/2, e^r by Cephes' expf polynomial, 2^k
// built in the exponent bits. Within 1 ulp of the exact value (glibc's expf: 0.5, PyTorch's Sleef: 1);
// results below 1.3e-38 (x < -87.3) are 0, above FLT_MAX inf.
inline float exp_simd(float x) {
  float xc = x < -87.3f ? -87.3f : x;  // keeps 2^k normal; NaN falls through both clamps
  xc = xc > 88.7228317f ? 88.7228317f : xc;
  // round(x / ln2) by the magic-number trick: std::floor would not vectorise
  const float shifted = xc * 1.44269504088896341f + 0x1.8p23f;
  const float k = shifted - 0x1.8p23f;
  const float r = xc - k * 0.693359375f + k * 2.12194440e-4f;  // ln2 in two parts (Cody-Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3333765858e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2 * 2^(k-1): k reaches 128 just below the overflow threshold
  const float y = 2.f * p * bits_to_float((float_to_bits(shifted) - float_to_bits(0x1.8p23f) + 126) << 23);
  return x > 88.7228317f ? std::numeric_limits<float>::infinity() : (x < -87.3f ? 0.f : y);
}

// Runs f(T{}) for the tensor dtype's element type T; a function, not AT_DISPATCH's macros, because
// the kernels' `#pragma omp simd` lines cannot sit inside a macro argument.
template <typename F>
void dispatch(const char* op, at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only, got ", type);
  }
}

// One dtype per call: a float32 weight next to bfloat16 activations would otherwise be read as the
// wrong bits. The message names every tensor's dtype.
void check_one_dtype(const char* op, std::initializer_list<std::pair<const char*, const torch::Tensor*>> tensors) {
  const auto first = tensors.begin()->second->scalar_type();
  bool same = true;
  for (const auto& t : tensors) same = same && t.second->scalar_type() == first;
  if (same) return;
  std::string got;
  for (const auto& t : tensors)
    got += std::string(got.empty() ? "" : ", ") + t.first + " " + c10::toString(t.second->scalar_type());
  TORCH_CHECK(false, op, ": all tensors must have the same dtype, got ", got);
}

// ---- decode attention helpers: q is fp32 (converted once per task), K/V rows are the cache's type.

#ifdef __AVX512F__
// 16 elements widened to fp32 in one register.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Scores of one query against 4 keys at once: four independent accumulator chains keep the FMA units
// busy, where a single dot product would wait on its own latency.
template <typename T>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t n, float* out) {
#ifdef __AVX512F__
  // GCC lowers an `omp simd` reduction by spilling the lanes to the stack and adding them one by one,
  // which costs more than the 4-8 FMAs of a 64-128 wide head (twice the lanes, so worse, for 16-bit
  // types): register accumulators and a tree sum score keys 1.7x (fp32) to 3x (bf16) faster.
  if (n % 16 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 x = _mm512_loadu_ps(q + i);
      a0 = _mm512_fmadd_ps(x, load16(k0 + i), a0);
      a1 = _mm512_fmadd_ps(x, load16(k1 + i), a1);
      a2 = _mm512_fmadd_ps(x, load16(k2 + i), a2);
      a3 = _mm512_fmadd_ps(x, load16(k3 + i), a3);
    }
    out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
    return;
  }
#endif
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; ++i) {
    a0 += q[i] * load(k0[i]);
    a1 += q[i] * load(k1[i]);
    a2 += q[i] * load(k2[i]);
    a3 += q[i] * load(k3[i]);
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * load(b[i]);
  return acc;
}

// y += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3: one pass over y for four value rows.
template <typename T>
inline void axpy4(const float* p, const T* v0, const T* v1, const T* v2, const T* v3, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] += p[0] * load(v0[i]) + p[1] * load(v1[i]) + p[2] * load(v2[i]) + p[3] * load(v3[i]);
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * load(x[i]);
}

template <typename T>
void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* o,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           int64_t max_blocks, float scale) {
  constexpr bool fp32 = std::is_same_v<T, float>;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;  // between consecutive tokens of one block
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    // 16-bit only: the group's queries widened once, and the output accumulated in fp32 then rounded once.
    std::vector<float> qf(fp32 ? 0 : group * dim), acc(fp32 ? 0 : dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const T* qgroup = q + (b * heads + kvh * group) * dim;
      const float* qrows;
      if constexpr (fp32) {
        qrows = qgroup;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < group * dim; ++i) qf[i] = load(qgroup[i]);
        qrows = qf.data();
      }
      scores.assign(group * len, 0.f);
      auto key = [&](int64_t t) {
        return kc + (table[t / block_size] * block_size + t % block_size) * token_stride + kvh * dim;
      };
      auto value = [&](int64_t t) {
        return vc + (table[t / block_size] * block_size + t % block_size) * token_stride + kvh * dim;
      };
      // Pass 1: scores[g, t] = q_g . k_t * scale, four keys at a time.
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qrows + g * dim;
        float* s = scores.data() + g * len;
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) dot4(qg, key(t), key(t + 1), key(t + 2), key(t + 3), dim, s + t);
        for (; t < len; ++t) s[t] = dot(qg, key(t), dim);
        for (int64_t i = 0; i < len; ++i) s[i] *= scale;
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float mx = *std::max_element(s, s + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = exp_simd(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Pass 2: out_g = sum_t p[g, t] * v_t, four value rows at a time.
      for (int64_t g = 0; g < group; ++g) {
        T* og = o + (b * heads + kvh * group + g) * dim;
        float* y;
        if constexpr (fp32) {
          y = og;  // accumulate in place
        } else {
          y = acc.data();
        }
        const float* p = scores.data() + g * len;
        std::fill_n(y, dim, 0.f);
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) axpy4(p + t, value(t), value(t + 1), value(t + 2), value(t + 3), y, dim);
        for (; t < len; ++t) axpy(p[t], value(t), y, dim);
        if constexpr (!fp32) {
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) og[i] = to<T>(y[i]);
        }
      }
    }
  });
}

// RMSNorm of each row of x [T, H] into out (which may alias x).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* yr = out + r * hidden;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += load(xr[i]) * load(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = to<T>(load(w[i]) * rounded<T>(load(xr[i]) * inv));
    }
  });
}

}  // namespace

// query [B, H, D], caches [num_blocks, block_size, KV, D], block_tables [B, max_blocks] (int64),
// context_lens [B] (int64). Returns [B, H, D] in the query's dtype.
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  check_one_dtype("paged_decode_attention", {{"query", &query}, {"k_cache", &k_cache}, {"v_cache", &v_cache}});
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_decode_attention: shape mismatch");
  auto out = torch::empty_like(query);
  dispatch("paged_decode_attention", query.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    decode_attention_impl(query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                          block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                          out.data_ptr<T>(), batch, heads, kv_heads, dim, k_cache.size(1),
                          block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// One call instead of the half-dozen ops of the PyTorch RMSNorm: at batch 1 every op launch costs more
// than its arithmetic, and a decoder layer has two norms.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_one_dtype("rms_norm", {{"x", &x}, {"weight", &weight}});
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  auto out = torch::empty_like(x);
  const int64_t hidden = x.size(-1);
  dispatch("rms_norm", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), x.numel() / hidden,
                  hidden, static_cast<float>(eps));
  });
  return out;
}

// In place: residual += x, then x = RMSNorm(residual) * weight (the pre-norm residual stream update).
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_one_dtype("add_rms_norm_", {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                  x.sizes() == residual.sizes(),
              "add_rms_norm_: x, residual and weight must be contiguous, x and residual of one shape");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  dispatch("add_rms_norm_", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    at::parallel_for(0, rows * hidden, 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) rp[i] = to<T>(load(rp[i]) + load(xp[i]));
    });
    rms_norm_rows(rp, weight.data_ptr<T>(), xp, rows, hidden, static_cast<float>(eps));
  });
}

// silu(x[:, :n]) * x[:, n:] for x [T, 2n]: the SwiGLU gate in one pass instead of two ops.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: contiguous [T, 2n] only");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  dispatch("silu_and_mul", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
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

// Rotate-half RoPE of x [T, heads, D] (any row stride, last dim contiguous) with per-token tables
// cos [T, 1, D] and signed sin [T, 1, D] (sin with its first half negated), into a new contiguous tensor.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_one_dtype("rotary", {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, D] with a contiguous last dimension");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto out = torch::empty({tokens, heads, dim}, x.options());
  dispatch("rotary", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:] (CPU; float32, bfloat16, float16)");
  m.def("rotary", &rotary, "rotate-half RoPE with precomputed cos / signed sin rows (CPU; float32, bfloat16, float16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU; float32, bfloat16, float16; fp32 accumulation)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU; float32, bfloat16, float16)");
  m.def("add_rms_norm_", &add_rms_norm_,
        "residual += x; x = RMSNorm(residual) (CPU; float32, bfloat16, float16; in place)");
}
