// A hybrid model's linear-attention decode step (worker/models/qwen3_5.py), on the state rows in place:
// the causal convolution's update and the gated delta rule's recurrent step for B sequences, each reading
// and writing its own row of the state tensors (no gather into a batch and scatter back, which moved the
// whole state three times more than the step needs: docs/performance.md#measurements-behind-choices-in-the-code).
// The arithmetic is worker/layers/gated_delta_rule.py's recurrent_step and causal_conv_step, in float32.
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include "cpu_common.h"
#include <ATen/Parallel.h>
#include "decode_team.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// A block of up to kConvLanes channels' convolution step for one token: each channel's dot of weight [KEEP + 1]
// with its last KEEP inputs (its row of the state) and `newest`, the rows shifted to take `newest`; the sum
// rounded to T, then SiLU, as transformers rounds. The channels go side by side in vector lanes (one at a
// time, the exponential and the division made a decode step's convolution 50 us a layer on the 0.8B shape,
// a tenth of its step: docs/performance.md#measurements-behind-choices-in-the-code); each channel's sum is
// taken in the same order whatever its block, so a token's result does not depend on the step it is in.
constexpr int64_t kConvLanes = 16;

template <typename T, int KEEP>
inline void conv_block(T* rows, const T* weight, const T* newest, T* out, int64_t lanes) {
  float acc[kConvLanes];
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t j = 0; j < lanes; ++j) {
      const float* w = weight + j * (KEEP + 1);
      float* row = rows + j * KEEP;
      float sum = 0.f;
      for (int t = 0; t < KEEP; ++t) sum += w[t] * row[t];
      sum += w[KEEP] * newest[j];
      for (int t = 0; t + 1 < KEEP; ++t) row[t] = row[t + 1];
      if constexpr (KEEP > 0) row[KEEP - 1] = newest[j];
      acc[j] = sum;
    }
  } else {
    // 16-bit taps widened into float arrays tap by tap (tap t of lane j at [t][j]), the lanes' arithmetic
    // then on whole vectors, the shifted rows narrowed back (exactly: they are T's values). Read lane by
    // lane with a stride of KEEP or KEEP + 1 elements, as float32's loop reads them, the 0.8B shape's step
    // took 20 us a layer in bf16, 11 this way (docs/performance.md#measurements-behind-choices-in-the-code).
    float taps[KEEP + 1][kConvLanes], state[KEEP + 1][kConvLanes];
    for (int64_t j = 0; j < lanes; ++j) {
      for (int t = 0; t <= KEEP; ++t) taps[t][j] = load(weight[j * (KEEP + 1) + t]);
      for (int t = 0; t < KEEP; ++t) state[t][j] = load(rows[j * KEEP + t]);
      state[KEEP][j] = load(newest[j]);
    }
#pragma omp simd
    for (int64_t j = 0; j < lanes; ++j) {
      float sum = 0.f;
      for (int t = 0; t <= KEEP; ++t) sum += taps[t][j] * state[t][j];
      acc[j] = sum;
    }
    for (int64_t j = 0; j < lanes; ++j)
      for (int t = 0; t < KEEP; ++t) rows[j * KEEP + t] = to<T>(state[t + 1][j]);
  }
#pragma omp simd
  for (int64_t j = 0; j < lanes; ++j) {
    const float y = rounded<T>(acc[j]);
    out[j] = to<T>(y / (1.f + exp_simd(-y)));
  }
}

// Channels [0, n) of one token through the convolution, kConvLanes at a time: rows (the state's, KEEP a
// channel), weight, newest and out point at the first channel's; keep is the width less one (1 to 5).
template <typename T>
void conv_channels(T* rows, const T* weight, const T* newest, T* out, int64_t n, int64_t keep) {
  for (int64_t c = 0; c < n; c += kConvLanes) {
    const int64_t lanes = std::min(kConvLanes, n - c);
    T* r = rows + c * keep;
    const T* w = weight + c * (keep + 1);
    switch (keep) {  // Qwen3.5's kernels are 4 wide; any width runs
      case 3: conv_block<T, 3>(r, w, newest + c, out + c, lanes); break;
      case 2: conv_block<T, 2>(r, w, newest + c, out + c, lanes); break;
      case 1: conv_block<T, 1>(r, w, newest + c, out + c, lanes); break;
      case 4: conv_block<T, 4>(r, w, newest + c, out + c, lanes); break;
      default: conv_block<T, 5>(r, w, newest + c, out + c, lanes);  // width 6, checked by the callers
    }
  }
}

// One token of one value head: q, k (dk) normalised here, v (dv), the head's state s [dk, dv] updated in
// place, the output into o (dv); `work` holds 2 dk + dv floats. Every kernel below runs a token through
// this, so a token's arithmetic is the same in a decode step and in a prompt chunk.
template <typename T>
inline void delta_step(const T* q, const T* k, const T* v, float g, float beta, float* s, float* o, int64_t dk,
                       int64_t dv, float scale, float* work) {
  float* qn = work;
  float* kn = work + dk;
  float* delta = work + 2 * dk;
  float qq = 0.f, kk = 0.f;
  for (int64_t d = 0; d < dk; ++d) {
    qn[d] = load(q[d]);
    kn[d] = load(k[d]);
    qq += qn[d] * qn[d];
    kk += kn[d] * kn[d];
  }
  const float qs = scale / std::sqrt(qq + 1e-6f), ks = 1.f / std::sqrt(kk + 1e-6f);
  for (int64_t d = 0; d < dk; ++d) {
    qn[d] *= qs;
    kn[d] *= ks;
  }
  const float decay = std::exp(g);
  // read = k^T S: what the state predicts for k (decayed below)
  for (int64_t j = 0; j < dv; ++j) delta[j] = 0.f;
  for (int64_t d = 0; d < dk; ++d) {
    const float kd = kn[d];
    const float* row = s + d * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) delta[j] += row[j] * kd;
  }
  // delta = beta (v - decay read); S = decay S + k delta^T; o = q^T S
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = (load(v[j]) - delta[j] * decay) * beta;
    o[j] = 0.f;
  }
  for (int64_t d = 0; d < dk; ++d) {
    const float kd = kn[d], qd = qn[d];
    float* row = s + d * dv;
#pragma omp simd
    for (int64_t j = 0; j < dv; ++j) {
      row[j] = row[j] * decay + kd * delta[j];
      o[j] += row[j] * qd;
    }
  }
}

void check_slots(const char* op, const at::Tensor& slots, int64_t batch, int64_t rows) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == batch, op,
              ": slots must be int64 [", batch, "], got ", slots.sizes(), " ", slots.scalar_type());
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(0 <= s[b] && s[b] < rows, op, ": slot ", s[b], " is outside the state's ", rows, " rows");
}

struct DeltaShape {
  int64_t rows, key_heads, dk, heads, dv;  // rows: B sequences (decode) or T tokens (a chunk)
};

// The rule's inputs checked (q, k [rows, key_heads, dk] and v [rows, heads, dv] of one dtype; g, beta
// float32 [rows, heads]; state contiguous float32 [slots, heads, dk, dv]) and made contiguous.
DeltaShape delta_inputs(const char* op, at::Tensor& q, at::Tensor& k, at::Tensor& v, at::Tensor& g,
                        at::Tensor& beta, const at::Tensor& state) {
  check_one_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}});
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) % q.size(1) == 0,
              op, ": q, k must be [rows, key_heads, dk] and v [rows, heads, dv] with heads a multiple of "
              "key_heads, got ", q.sizes(), " ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.size(1) == v.size(1) && state.size(2) == q.size(2) && state.size(3) == v.size(2),
              op, ": state must be contiguous float32 [slots, heads, dk, dv], got ", state.sizes(), " ",
              state.scalar_type());
  const DeltaShape shape{q.size(0), q.size(1), q.size(2), v.size(1), v.size(2)};
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == shape.rows &&
                    t->size(1) == shape.heads,
                op, ": g and beta must be float32 [rows, heads], got ", t->sizes(), " ", t->scalar_type());
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  g = g.contiguous();
  beta = beta.contiguous();
  return shape;
}


// The sequences' tokens through the convolution: sequence i's `tokens` consecutive rows of x [rows, C]
// (contiguous rows), in order, on state row slots[i]; the sequences and channels in parallel.
at::Tensor conv_rows(const char* op, at::Tensor x, at::Tensor state, at::Tensor weight, const int64_t* slots,
                     int64_t sequences, int64_t tokens) {
  check_one_dtype(op, {{"x", &x}, {"state", &state}, {"weight", &weight}});
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && state.dim() == 3 && state.is_contiguous() &&
                  state.size(1) == x.size(1) && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && weight.size(1) == state.size(2) + 1,
              op, ": x [rows, C] with contiguous rows, state contiguous [slots, C, K - 1], weight contiguous [C, K], "
              "got ", x.sizes(), " ", state.sizes(), " ", weight.sizes());
  const int64_t channels = x.size(1), width = weight.size(1), keep = width - 1;
  TORCH_CHECK(2 <= width && width <= 6, op, ": the convolution is ", width, " wide; the kernel runs 2 to 6");
  auto out = at::empty({sequences * tokens, channels}, x.options());
  dispatch(op, x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* st = state.data_ptr<T>();
    T* out_p = out.data_ptr<T>();
    const int64_t x_stride = x.stride(0);
    const int64_t blocks = (channels + kConvLanes - 1) / kConvLanes;
    nanovllm::parallel_for(0, sequences * blocks, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t seq = i / blocks, c = i % blocks * kConvLanes, lanes = std::min(kConvLanes, channels - c);
        T* rows = st + (slots[seq] * channels + c) * keep;
        for (int64_t r = seq * tokens; r < (seq + 1) * tokens; ++r)
          conv_channels(rows, w + c * width, xp + r * x_stride + c, out_p + r * channels + c, lanes, keep);
      }
    });
  });
  return out;
}

// The sequences' tokens through the rule: sequence i's `tokens` consecutive rows, in order, on state row
// slots[i] (each head's state stays in cache from token to token); the sequences and heads in parallel.
at::Tensor delta_rows(const char* op, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                      at::Tensor state, const int64_t* slots, int64_t sequences, int64_t tokens) {
  const DeltaShape shape = delta_inputs(op, q, k, v, g, beta, state);
  TORCH_CHECK(shape.rows == sequences * tokens, op, ": ", shape.rows, " rows for ", sequences, " sequences of ",
              tokens, " tokens");
  const int64_t key_heads = shape.key_heads, dk = shape.dk, heads = shape.heads, dv = shape.dv;
  auto out = at::empty({shape.rows, heads, dv}, q.options().dtype(at::kFloat));
  const int64_t group = heads / key_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  dispatch(op, q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const float* gp = g.data_ptr<float>();
    const float* bp = beta.data_ptr<float>();
    float* st = state.data_ptr<float>();
    float* out_p = out.data_ptr<float>();
    nanovllm::parallel_for(0, sequences * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> work(2 * dk + dv);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t seq = i / heads, h = i % heads, kh = h / group;
        float* s = st + (slots[seq] * heads + h) * dk * dv;
        for (int64_t r = seq * tokens; r < (seq + 1) * tokens; ++r)
          delta_step(qp + (r * key_heads + kh) * dk, kp + (r * key_heads + kh) * dk, vp + (r * heads + h) * dv,
                     gp[r * heads + h], bp[r * heads + h], s, out_p + (r * heads + h) * dv, dk, dv, scale,
                     work.data());
      }
    });
  });
  return out;
}

// The rule's float32 output, or `out` (the same shape) filled with it rounded to out's dtype.
at::Tensor into(const char* op, const at::Tensor& result, const c10::optional<at::Tensor>& out) {
  if (!out.has_value()) return result;
  TORCH_CHECK(out->sizes() == result.sizes(), op, ": out must be ", result.sizes(), ", got ", out->sizes());
  return out->copy_(result);
}

}  // namespace

// x [B, C] -> SiLU(depthwise conv of each channel's last K - 1 inputs (state[slots[b], c]) and x[b, c] with
// weight [C, K]); the state rows shift in x. As transformers: the sum rounded to the dtype, then SiLU.
at::Tensor causal_conv_decode_(at::Tensor x, at::Tensor state, at::Tensor weight, at::Tensor slots) {
  check_slots("causal_conv_decode_", slots, x.size(0), state.size(0));
  return conv_rows("causal_conv_decode_", x, state, weight, slots.data_ptr<int64_t>(), x.size(0), 1);
}

// One token of B sequences through the gated delta rule, each on state[slots[b]] ([heads, dk, dv] fp32,
// updated in place): q, k [B, key_heads, dk] and v [B, heads, dv] (any float dtype), g and beta [B, heads]
// fp32. q and k are L2-normalised (eps 1e-6 under the root), q scaled by dk^-0.5; key head h / (heads /
// key_heads) serves value head h. Returns the output [B, heads, dv] fp32, or `out` filled (rounded to its dtype).
at::Tensor gated_delta_decode_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                               at::Tensor state, at::Tensor slots, c10::optional<at::Tensor> out) {
  check_slots("gated_delta_decode_", slots, q.size(0), state.size(0));
  return into("gated_delta_decode_",
              delta_rows("gated_delta_decode_", q, k, v, g, beta, state, slots.data_ptr<int64_t>(), q.size(0), 1),
              out);
}

// A prompt chunk of T tokens of one sequence, token after token on its state row `slot`: the decode
// kernels' arithmetic (conv_step, delta_step) for each token, so a token's result does not depend on how
// the prompt was cut into chunks or steps (--deterministic). x [T, C] -> SiLU(conv) [T, C].
at::Tensor causal_conv_chunk_(at::Tensor x, at::Tensor state, at::Tensor weight, int64_t slot) {
  TORCH_CHECK(0 <= slot && slot < state.size(0), "causal_conv_chunk_: slot ", slot, " is outside the state's ",
              state.size(0), " rows");
  return conv_rows("causal_conv_chunk_", x, state, weight, &slot, 1, x.size(0));
}

// q, k [T, key_heads, dk], v [T, heads, dv], g and beta [T, heads] fp32: the output [T, heads, dv] fp32, or
// `out` filled (rounded to its dtype).
at::Tensor gated_delta_chunk_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                              at::Tensor state, int64_t slot, c10::optional<at::Tensor> out) {
  TORCH_CHECK(0 <= slot && slot < state.size(0), "gated_delta_chunk_: slot ", slot, " is outside the state's ",
              state.size(0), " rows");
  return into("gated_delta_chunk_", delta_rows("gated_delta_chunk_", q, k, v, g, beta, state, &slot, 1, q.size(0)),
              out);
}

// ---- Qwen3.5's elementwise and row-wise steps, row by row in a fixed order: PyTorch can compute the last
// elements of a tensor whose size is not a multiple of its vector width with scalar functions (exp,
// sigmoid, softplus) that round otherwise than its vector ones, so an element's result depends on the size
// of the step it was computed in. With these a token's result does not (--deterministic).

namespace {

inline float sigmoid_f(float x) { return 1.f / (1.f + std::exp(-x)); }

// A value head's decay g = -exp(A_log) softplus(a + dt_bias), float32.
inline float delta_decay(float a, float dt_bias, float a_log) {
  const float x = a + dt_bias;
  const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
  return -std::exp(a_log) * softplus;
}

// Its write strength beta = sigmoid(b), rounded to the dtype as transformers computes it there.
template <typename T>
inline float delta_strength(T b) {
  return rounded<T>(sigmoid_f(load(b)));
}

}  // namespace

// The write strength and decay of each token and value head: beta = sigmoid(b) (rounded to the dtype, as
// transformers computes it there), g = -exp(A_log) softplus(a + dt_bias) in float32. a, b [T, heads];
// a_log, dt_bias [heads]. Returns (g, beta) float32 [T, heads].
std::vector<at::Tensor> delta_gates(at::Tensor a, at::Tensor b, at::Tensor a_log, at::Tensor dt_bias) {
  check_one_dtype("delta_gates", {{"a", &a}, {"b", &b}, {"a_log", &a_log}, {"dt_bias", &dt_bias}});
  TORCH_CHECK(a.dim() == 2 && b.sizes() == a.sizes() && a.stride(1) == 1 && b.stride(1) == 1 &&
                  a_log.dim() == 1 && a_log.size(0) == a.size(1) && dt_bias.sizes() == a_log.sizes(),
              "delta_gates: a, b [T, heads] with contiguous rows, a_log and dt_bias [heads], got ", a.sizes(), " ",
              b.sizes(), " ", a_log.sizes(), " ", dt_bias.sizes());
  a_log = a_log.contiguous();
  dt_bias = dt_bias.contiguous();
  const int64_t tokens = a.size(0), heads = a.size(1);
  auto g = at::empty({tokens, heads}, a.options().dtype(at::kFloat));
  auto beta = at::empty({tokens, heads}, a.options().dtype(at::kFloat));
  dispatch("delta_gates", a.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* ap = a.data_ptr<T>();
    const T* bp = b.data_ptr<T>();
    const T* al = a_log.data_ptr<T>();
    const T* dt = dt_bias.data_ptr<T>();
    float* gp = g.data_ptr<float>();
    float* betap = beta.data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        gp[t * heads + h] = delta_decay(load(ap[t * a.stride(0) + h]), load(dt[h]), load(al[h]));
        betap[t * heads + h] = delta_strength(bp[t * b.stride(0) + h]);
      }
  });
  return {g, beta};
}

// x [T, n] times sigmoid(gate) rounded to the dtype (gate [T, n], or [T, 1] for one gate a row).
at::Tensor sigmoid_mul(at::Tensor x, at::Tensor gate) {
  check_one_dtype("sigmoid_mul", {{"x", &x}, {"gate", &gate}});
  TORCH_CHECK(x.dim() == 2 && gate.dim() == 2 && gate.size(0) == x.size(0) &&
                  (gate.size(1) == x.size(1) || gate.size(1) == 1),
              "sigmoid_mul: x [T, n] and gate [T, n] or [T, 1], got ", x.sizes(), " ", gate.sizes());
  x = x.contiguous();
  gate = gate.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), per_row = gate.size(1);
  auto out = at::empty_like(x);
  dispatch("sigmoid_mul", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* gp = gate.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * n;
        const T* g = gp + r * per_row;
        T* o = op + r * n;
        if (per_row == 1) {
          const float s = rounded<T>(sigmoid_f(load(g[0])));
          for (int64_t i = 0; i < n; ++i) o[i] = to<T>(load(xr[i]) * s);
          continue;
        }
        // A gated attention's whole row of gates: the vectorised exp (std::exp kept this loop scalar, 20 us
        // of a 2,048-wide row).
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = to<T>(load(xr[i]) * rounded<T>(1.f / (1.f + exp_simd(-load(g[i])))));
      }
    });
  });
  return out;
}

namespace {

// The sum of a row of d (< 512) floats in the order PyTorch's CPU sum over a contiguous last dimension takes
// (at::native's vectorized_inner_sum, row_sum and multi_row_sum, in 8-lane vectors on its AVX2 and AVX-512
// builds alike): vector i into accumulator i % 4 (the vectors past the last whole four into the first), the
// four accumulators added in order, then the values past the last whole vector and the 8 lanes in sequence.
// `v` holds the squares already rounded: a product here could be contracted into a fused multiply-add.
float torch_inner_sum(const float* v, int64_t d) {
  constexpr int64_t kLanes = 8;
  const int64_t vectors = d / kLanes, whole = vectors / 4 * 4;
  float acc[4][kLanes] = {};
  for (int64_t i = 0; i < vectors; ++i) {
    float* into = acc[i < whole ? i % 4 : 0];
    for (int64_t l = 0; l < kLanes; ++l) into[l] += v[i * kLanes + l];
  }
  for (int k = 1; k < 4; ++k)
    for (int64_t l = 0; l < kLanes; ++l) acc[0][l] += acc[k][l];
  float total = 0.f;
  for (int64_t i = vectors * kLanes; i < d; ++i) total += v[i];
  for (int64_t l = 0; l < kLanes; ++l) total += acc[0][l];
  return total;
}

// One row of gated_rms_norm below: core (d floats) into out (d values of T); x and squares hold d floats.
template <typename T>
inline void gated_norm_row(const float* core, const float* gate, const T* w, T* out, int64_t d, float eps, float* x,
                           float* squares) {
  for (int64_t i = 0; i < d; ++i) x[i] = rounded<T>(core[i]);
  for (int64_t i = 0; i < d; ++i) squares[i] = x[i] * x[i];
  asm volatile("" ::: "memory");  // the squares rounded apart from the sum's additions
  const float mean = torch_inner_sum(squares, d) / static_cast<float>(d);
  const float inverse = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) {
    const float normed = rounded<T>(x[i] * inverse);
    out[i] = to<T>(rounded<T>(load(w[i]) * normed) * gate[i]);
  }
}

}  // namespace

// Qwen3.5's gated RMSNorm of the delta rule's output, as transformers computes it in x's dtype T: each row
// of `core` (float32 [rows, d]) rounded to T, normalised in float32 (x / sqrt(mean(x^2) + eps), the mean's
// sum in PyTorch's order: the same bits as F.rms_norm), rounded to T, times `weight` ([d] in T, the product
// rounded to T), times `gate` (float32 [rows, d], SiLU already applied), rounded to T. One call in place of
// the dozen ATen operations a decode step's linear layer ran for it (each a dispatch and an allocation).
at::Tensor gated_rms_norm(at::Tensor core, at::Tensor gate, at::Tensor weight, double eps) {
  TORCH_CHECK(core.scalar_type() == at::kFloat && gate.scalar_type() == at::kFloat && core.dim() == 2 &&
                  gate.sizes() == core.sizes() && weight.dim() == 1 && weight.size(0) == core.size(1),
              "gated_rms_norm: core and gate float32 [rows, d], weight [d], got ", core.scalar_type(), " ",
              core.sizes(), ", ", gate.scalar_type(), " ", gate.sizes(), ", ", weight.sizes());
  const int64_t rows = core.size(0), d = core.size(1);
  TORCH_CHECK(d < 512, "gated_rms_norm: rows of ", d, " values; PyTorch sums 512 or more in another order");
  core = core.contiguous();
  gate = gate.contiguous();
  weight = weight.contiguous();
  auto out = at::empty({rows, d}, core.options().dtype(weight.scalar_type()));
  dispatch("gated_rms_norm", weight.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const float* cp = core.data_ptr<float>();
    const float* gp = gate.data_ptr<float>();
    const T* w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> x(d), squares(d);
      for (int64_t r = begin; r < end; ++r)
        gated_norm_row(cp + r * d, gp + r * d, w, op + r * d, d, static_cast<float>(eps), x.data(), squares.data());
    });
  });
  return out;
}

// A Gated DeltaNet layer's decode step between its two projections, for B sequences, one token each: from the
// in-projection's rows `projected` [B, mixed | z | b | a] (mixed: q, k of key_heads heads of key_dim, v of
// heads of value_dim) and the gates' SiLU `gate` (float32 [B, heads * value_dim]), the convolution of mixed on
// conv_state[slots[b]], each head's decay and write strength, the delta rule on recurrent_state[slots[b]] and
// the gated RMSNorm with norm_weight, into [B, heads * value_dim] in the dtype: causal_conv_decode_,
// delta_gates, gated_delta_decode_ and gated_rms_norm's arithmetic, the same bits, in one parallel region over
// (sequence, key head) and without the tensors between them. The C++ decode layers run it: in a decode
// step each call through the dispatcher, each allocation and each parallel region start cold after a
// projection's stream (docs/performance.md#qwen35-08b-shape-what-a-token-reads-benchquantizationpy---shape-qwen35-08b).
at::Tensor linear_attention_decode_(at::Tensor projected, at::Tensor gate, at::Tensor conv_state,
                                    at::Tensor conv_weight, at::Tensor recurrent_state, at::Tensor a_log,
                                    at::Tensor dt_bias, at::Tensor norm_weight, at::Tensor slots, int64_t key_heads,
                                    int64_t key_dim, int64_t heads, int64_t value_dim, double norm_eps) {
  constexpr const char* op = "linear_attention_decode_";
  check_one_dtype(op, {{"projected", &projected}, {"conv_state", &conv_state}, {"conv_weight", &conv_weight},
                       {"a_log", &a_log}, {"dt_bias", &dt_bias}, {"norm_weight", &norm_weight}});
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0 && key_dim > 0 && value_dim > 0, op, ": ", heads,
              " value heads must be a multiple of ", key_heads, " key heads, with head dims ", key_dim, " and ",
              value_dim);
  TORCH_CHECK(value_dim < 512, op, ": value heads of ", value_dim, "; PyTorch's norm sums 512 or more in another order");
  const int64_t batch = projected.size(0), key_size = key_heads * key_dim, value_size = heads * value_dim;
  const int64_t channels = 2 * key_size + value_size;
  TORCH_CHECK(projected.dim() == 2 && projected.stride(1) == 1 && projected.size(1) == channels + value_size + 2 * heads,
              op, ": projected must be [B, ", channels + value_size + 2 * heads, "] with unit stride (mixed ", channels,
              ", z ", value_size, ", b and a ", heads, " each), got ", projected.sizes());
  TORCH_CHECK(gate.scalar_type() == at::kFloat && gate.is_contiguous() && gate.dim() == 2 && gate.size(0) == batch &&
                  gate.size(1) == value_size,
              op, ": gate must be contiguous float32 [", batch, ", ", value_size, "], got ", gate.scalar_type(), " ",
              gate.sizes());
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.size(1) == channels &&
                  conv_weight.dim() == 2 && conv_weight.is_contiguous() && conv_weight.size(0) == channels &&
                  conv_weight.size(1) == conv_state.size(2) + 1,
              op, ": conv_state contiguous [slots, ", channels, ", K - 1] and conv_weight contiguous [", channels,
              ", K], got ", conv_state.sizes(), " ", conv_weight.sizes());
  const int64_t width = conv_weight.size(1), keep = width - 1;
  TORCH_CHECK(2 <= width && width <= 6, op, ": the convolution is ", width, " wide; the kernel runs 2 to 6");
  TORCH_CHECK(recurrent_state.dim() == 4 && recurrent_state.scalar_type() == at::kFloat &&
                  recurrent_state.is_contiguous() && recurrent_state.size(1) == heads &&
                  recurrent_state.size(2) == key_dim && recurrent_state.size(3) == value_dim,
              op, ": recurrent_state must be contiguous float32 [slots, ", heads, ", ", key_dim, ", ", value_dim,
              "], got ", recurrent_state.sizes(), " ", recurrent_state.scalar_type());
  TORCH_CHECK(a_log.numel() == heads && dt_bias.numel() == heads && norm_weight.numel() == value_dim, op,
              ": a_log and dt_bias must hold ", heads, " values and norm_weight ", value_dim, ", got ", a_log.numel(),
              ", ", dt_bias.numel(), ", ", norm_weight.numel());
  check_slots(op, slots, batch, conv_state.size(0));
  check_slots(op, slots, batch, recurrent_state.size(0));
  a_log = a_log.contiguous();
  dt_bias = dt_bias.contiguous();
  norm_weight = norm_weight.contiguous();
  auto out = at::empty({batch, value_size}, projected.options());
  const int64_t group = heads / key_heads, dk = key_dim, dv = value_dim;
  const int64_t b_at = channels + value_size, a_at = b_at + heads;  // b's and a's first columns
  const float scale = 1.f / std::sqrt(static_cast<float>(dk)), eps = static_cast<float>(norm_eps);
  dispatch(op, projected.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* pp = projected.data_ptr<T>();
    const T* cw = conv_weight.data_ptr<T>();
    const T* al = a_log.data_ptr<T>();
    const T* dt = dt_bias.data_ptr<T>();
    const T* nw = norm_weight.data_ptr<T>();
    const float* gp = gate.data_ptr<float>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    T* cs = conv_state.data_ptr<T>();
    float* rs = recurrent_state.data_ptr<float>();
    T* outp = out.data_ptr<T>();
    nanovllm::parallel_for(0, batch * key_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> mixed(2 * dk + group * dv);  // the key head's q and k, then its value heads' v, convolved
      std::vector<float> work(2 * dk + dv), o(dv), x(dv), squares(dv);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / key_heads, kh = task % key_heads, slot = sl[seq];
        const T* row = pp + seq * projected.stride(0);
        const int64_t first[3] = {kh * dk, key_size + kh * dk, 2 * key_size + kh * group * dv};
        const int64_t count[3] = {dk, dk, group * dv};
        for (int64_t part = 0, offset = 0; part < 3; offset += count[part++])
          conv_channels(cs + (slot * channels + first[part]) * keep, cw + first[part] * width, row + first[part],
                        mixed.data() + offset, count[part], keep);
        for (int64_t j = 0; j < group; ++j) {
          const int64_t h = kh * group + j;
          delta_step(mixed.data(), mixed.data() + dk, mixed.data() + 2 * dk + j * dv,
                     delta_decay(load(row[a_at + h]), load(dt[h]), load(al[h])), delta_strength(row[b_at + h]),
                     rs + (slot * heads + h) * dk * dv, o.data(), dk, dv, scale, work.data());
          gated_norm_row(o.data(), gp + seq * value_size + h * dv, nw, outp + seq * value_size + h * dv, dv, eps,
                         x.data(), squares.data());
        }
      }
    });
  });
  return out;
}

// RMSNorm over the last dimension with a float32 weight ([d], or [H, d] for x [T, H, d]) of a 16-bit x:
// normalised and multiplied in float32, rounded once (Qwen3.5's zero-centred norms, their 1 + w kept in
// float32).
namespace {

// Rows [begin, end) of `in` ([rows, d]) normalised and multiplied by the float32 weight (row r takes weight
// row r % heads) in float32, rounded once into `out`.
template <typename T>
void fp32_weight_norm_rows(const T* in, const float* w, int64_t heads, T* out, int64_t begin, int64_t end, int64_t d,
                           float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = in + r * d;
    const float* wr = w + (r % heads) * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += load(xr[i]) * load(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = to<T>(load(xr[i]) * inv * wr[i]);
  }
}

void check_fp32_norm_weight(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), op,
              ": weight must be contiguous float32, got ", weight.scalar_type());
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.size(-1) == d && (weight.dim() == 1 || (weight.dim() == 2 && x.dim() == 3 &&
                                                             weight.size(0) == x.size(1))),
              op, ": weight [d] or [H, d] for x [T, H, d], got ", weight.sizes(), " for ", x.sizes());
}

}  // namespace

void rms_norm_fp32_weight_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_fp32_norm_weight("rms_norm_fp32_weight", x, weight);
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "rms_norm_fp32_weight: x and out must be contiguous, of one shape and dtype");
  const int64_t d = x.size(-1), rows = x.numel() / d, heads = weight.dim() == 2 ? weight.size(0) : 1;
  dispatch("rms_norm_fp32_weight", x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    nanovllm::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      fp32_weight_norm_rows(xp, weight.data_ptr<float>(), heads, op, begin, end, d, static_cast<float>(eps));
    });
  });
}

// Qwen3.5's gated attention's q and k heads, from the QKV projection's output qkv [T, (2 heads + 2 kv_heads) d]
// (each q head followed by its gate, then the k heads, then the v heads): [T, heads + kv_heads, d], each head
// normalised with its row of the float32 weight (rms_norm_fp32_weight's arithmetic) and its first `rotary`
// dims turned by RoPE with cos and signed sin [T, 1, rotary] (the rotary kernel's roundings), the rest passed.
// What the module path's norm of the heads concatenated, rotary of their first dims and concatenation give, in
// one call: in a decode step each call through the dispatcher is cold after a projection's stream
// (docs/performance.md#qwen35-08b-shape-what-a-token-reads-benchquantizationpy---shape-qwen35-08b).
constexpr int64_t kMaxRotary = 512;  // the rotary dims a head turns, at most (Qwen3.5's: 64)

at::Tensor gated_qk_norm_rope(at::Tensor qkv, int64_t heads, int64_t kv_heads, int64_t d, at::Tensor weight,
                              double eps, at::Tensor cos, at::Tensor sin) {
  check_one_dtype("gated_qk_norm_rope", {{"qkv", &qkv}, {"cos", &cos}, {"sin", &sin}});
  const int64_t tokens = qkv.size(0), rows = heads + kv_heads, rotary = cos.size(-1), half = rotary / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (2 * heads + 2 * kv_heads) * d && qkv.stride(1) == 1,
              "gated_qk_norm_rope: qkv must be [T, ", (2 * heads + 2 * kv_heads) * d, "] with unit stride, got ",
              qkv.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == rows && weight.size(1) == d,
              "gated_qk_norm_rope: weight must be contiguous float32 [", rows, ", ", d, "], got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(rotary % 2 == 0 && rotary <= std::min<int64_t>(d, kMaxRotary) && cos.numel() == tokens * rotary &&
                  sin.numel() == tokens * rotary,
              "gated_qk_norm_rope: cos and sin must be [T, 1, rotary] with rotary even and at most ",
              std::min<int64_t>(d, kMaxRotary), ", got ", cos.sizes(), " ", sin.sizes());
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty({tokens, rows, d}, qkv.options());
  dispatch("gated_qk_norm_rope", qkv.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xp = qkv.data_ptr<T>();
    const float* w = weight.data_ptr<float>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t stride = qkv.stride(0), k_start = 2 * heads * d;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < rows; ++h) {
        const T* head = xp + t * stride + (h < heads ? h * 2 * d : k_start + (h - heads) * d);
        T* y = op + (t * rows + h) * d;
        fp32_weight_norm_rows(head, w + h * d, 1, y, 0, 1, d, static_cast<float>(eps));
        const T* c = cp + t * rotary;
        const T* sn = sp + t * rotary;
        T turned[kMaxRotary];
        for (int64_t i = 0; i < half; ++i)
          turned[i] = to<T>(rounded<T>(load(y[i]) * load(c[i])) + rounded<T>(load(y[i + half]) * load(sn[i])));
        for (int64_t i = half; i < rotary; ++i)
          turned[i] = to<T>(rounded<T>(load(y[i]) * load(c[i])) + rounded<T>(load(y[i - half]) * load(sn[i])));
        std::copy(turned, turned + rotary, y);
      }
  });
  return out;
}

at::Tensor rms_norm_fp32_weight(at::Tensor x, at::Tensor weight, double eps) {
  x = x.contiguous();
  auto out = at::empty_like(x);
  rms_norm_fp32_weight_into(x, weight, eps, out);
  return out;
}
