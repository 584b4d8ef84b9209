// A decode step's decoder layers (Llama, Qwen2, Qwen3, Qwen3-MoE) in one call from Python, on the CPU kernels.
//
// At one sequence on a CPU the layers' arithmetic is small enough that the Python around it counts: each
// layer is about a dozen kernel calls and as many module calls, views and splits: on SmolLM2-135M a third
// of a step went outside the projections' kernel, and one call took a fifth off the step
// (docs/performance.md#measurements-behind-choices-in-the-code). This
// runs the same kernels, in the same order, on the same tensors, as worker/models/decoder.py does for a
// decode-only step, so the result is bit for bit the module path's (tests/test_layer_kernels.py checks).
// The model keeps its modules for everything else (prefill, chunks, tensor parallelism, other backends).
#include <torch/extension.h>

#include "cpu_common.h"
#include "kernels_cpu.h"
#include "decode_team.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// One projection's weights, float or packed, as worker/layers/linear.py's `linear` dispatches them.
struct Projection {
  c10::optional<at::Tensor> weight;  // float [N, K]; absent when packed
  c10::optional<at::Tensor> qweight, scales, mins;
  int64_t bits = 0, group_size = 0;
  c10::optional<at::Tensor> bias;
  int64_t few_rows_max = 0;  // float weights: linear_few_rows up to this many rows, PyTorch's GEMM above
  bool batch_invariant = false;  // every row count on the kernels' fixed summation order
  bool interleaved = false;      // packed rows interleaved 16 at a time (PackedWeight.interleave_)
  bool exact = false;            // packed: x kept in its dtype, not quantized for the integer dots

  // The most rows of x this projection keeps on the kernels (which run on a DecodeTeam), not ATen's GEMM.
  int64_t kernel_rows() const {
    if (batch_invariant) return std::numeric_limits<int64_t>::max();
    return weight.has_value() ? few_rows_max : linear_quantized_direct_rows();
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (!weight.has_value())
      return linear_quantized(x, *qweight, *scales, mins, bits, group_size, bias, batch_invariant, interleaved, exact);
    if (batch_invariant || x.size(0) <= few_rows_max) return linear_few_rows(x, *weight, bias);
    return at::linear(x, *weight, bias);
  }
};

// A sparse layer's experts, as worker/layers/moe.py's SparseMoeBlock runs them on the CPU kernels: the same
// ops in the same order (route in float32, rows grouped by expert in ascending order, each token's k
// outputs added one at a time in that order), then a shared expert's output times sigmoid of its gate
// (Qwen3.5-MoE's) added.
struct SparseMoe {
  Projection router;
  std::vector<Projection> w13, w2;  // per expert: [2 I, H] (gate rows, then up rows) and [H, I]
  int64_t top_k = 0;
  bool norm_topk_prob = false;
  c10::optional<Projection> shared_gate_up, shared_down, shared_gate;  // all three or none

  int64_t kernel_rows() const {
    int64_t rows = router.kernel_rows();
    for (const std::vector<Projection>* experts : {&w13, &w2})
      for (const Projection& p : *experts) rows = std::min(rows, p.kernel_rows());
    for (const c10::optional<Projection>* p : {&shared_gate_up, &shared_down, &shared_gate})
      if (p->has_value()) rows = std::min(rows, (*p)->kernel_rows());
    return rows;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor out = experts(x);
    if (!shared_gate_up.has_value()) return out;
    const at::Tensor shared = (*shared_down)(silu_and_mul((*shared_gate_up)(x)));
    return out + sigmoid_mul(shared, (*shared_gate)(x));
  }

 private:
  at::Tensor experts(const at::Tensor& x) const {
    at::Tensor weights, chosen;
    std::tie(weights, chosen) = at::softmax(router(x), -1, at::kFloat).topk(top_k, -1);
    if (norm_topk_prob) weights.div_(weights.sum(-1, /*keepdim=*/true));
    weights = weights.to(x.scalar_type()).contiguous();
    chosen = chosen.contiguous();
    // The (token, slot) pairs as rows grouped by expert in ascending order, tokens in order within a group (a
    // stable counting sort of the choices: SparseMoeBlock's stable argsort), found on the host: a decode step's
    // dozen routing and combining ATen calls each ran cold after the experts' streams.
    const int64_t tokens = x.size(0), pairs = tokens * top_k, num_experts = static_cast<int64_t>(w13.size());
    const int64_t* choice = chosen.data_ptr<int64_t>();
    std::vector<int64_t> first(num_experts + 1, 0);
    for (int64_t i = 0; i < pairs; ++i) ++first[choice[i] + 1];
    std::vector<int64_t> experts, sizes;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (first[e + 1] > 0) experts.push_back(e), sizes.push_back(first[e + 1]);
      first[e + 1] += first[e];
    }
    std::vector<int64_t> pair_of_row(pairs);  // row r holds pair pair_of_row[r] (token * top_k + slot)
    for (int64_t i = 0; i < pairs; ++i) pair_of_row[first[choice[i]]++] = i;
    at::Tensor token_of_row = at::empty({pairs}, chosen.options());
    int64_t* token = token_of_row.data_ptr<int64_t>();
    for (int64_t r = 0; r < pairs; ++r) token[r] = pair_of_row[r] / top_k;
    const std::vector<at::Tensor> inputs = x.index_select(0, token_of_row).split_with_sizes(sizes);
    const int64_t most_rows = *std::max_element(sizes.begin(), sizes.end());
    std::vector<at::Tensor> ys;
    if (w13[0].weight.has_value() && (router.batch_invariant || most_rows <= router.few_rows_max)) {
      std::vector<at::Tensor> gate_up_weights, down_weights;
      for (int64_t e : experts) gate_up_weights.push_back(*w13[e].weight), down_weights.push_back(*w2[e].weight);
      const at::Tensor acts = silu_and_mul(at::cat(linear_grouped(inputs, gate_up_weights)));
      ys = linear_grouped(acts.split_with_sizes(sizes), down_weights);
    } else {
      for (size_t i = 0; i < experts.size(); ++i) ys.push_back(w2[experts[i]](silu_and_mul(w13[experts[i]](inputs[i]))));
    }
    // Each token's k rows (in ascending expert order) times their weights, each product rounded to the dtype,
    // added one at a time with the sum rounded after each add: SparseMoeBlock's mul_ and adds, as ATen rounds them.
    const int64_t hidden = ys[0].size(1);
    std::vector<const at::Tensor*> y_of_row(pairs);
    std::vector<int64_t> index_in_y(pairs);
    for (size_t i = 0, r = 0; i < ys.size(); ++i)
      for (int64_t j = 0; j < sizes[i]; ++j, ++r) y_of_row[r] = &ys[i], index_in_y[r] = j;
    std::vector<int64_t> rows_seen(tokens, 0);
    at::Tensor out = at::empty({tokens, hidden}, x.options());
    dispatch("SparseMoe", x.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      const T* w = weights.data_ptr<T>();
      T* o = out.data_ptr<T>();
      std::vector<float> product(hidden);
      for (int64_t r = 0; r < pairs; ++r) {  // rows ascend by expert, so each token meets its rows in that order
        const int64_t pair = pair_of_row[r], t = pair / top_k;
        const T* y = y_of_row[r]->data_ptr<T>() + index_in_y[r] * hidden;
        const float weight = load(w[pair]);
        T* into = o + t * hidden;
        if (rows_seen[t]++ == 0) {
          for (int64_t h = 0; h < hidden; ++h) into[h] = to<T>(load(y[h]) * weight);
          continue;
        }
        for (int64_t h = 0; h < hidden; ++h) product[h] = rounded<T>(load(y[h]) * weight);
        asm volatile("" ::: "memory");  // the products rounded apart from the adds (no fused multiply-add)
        for (int64_t h = 0; h < hidden; ++h) into[h] = to<T>(load(into[h]) + product[h]);
      }
    });
    return out;
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> qk_norm;  // Qwen3's per-head norm, [heads + kv_heads, head_dim]
  Projection qkv, o;
  c10::optional<Projection> gate_up, down;  // a dense MLP's, or
  c10::optional<SparseMoe> moe;             // a sparse layer's experts
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  c10::optional<at::Tensor> k_scale, v_scale;  // an FP8 cache's, per kv head

  int64_t kernel_rows() const {
    const int64_t rows = std::min(qkv.kernel_rows(), o.kernel_rows());
    return std::min(rows, moe.has_value() ? moe->kernel_rows() : std::min(gate_up->kernel_rows(), down->kernel_rows()));
  }
};

// The most rows of x for which every projection of `layers` stays on the kernels.
template <typename L>
int64_t kernel_rows(const std::vector<L>& layers) {
  int64_t rows = std::numeric_limits<int64_t>::max();
  for (const L& layer : layers) rows = std::min(rows, layer.kernel_rows());
  return rows;
}

// body() leading a DecodeTeam when `on_kernels` (every projection of the step on the kernels, none on
// ATen's GEMM, which inside the team's region would run on one thread); alone otherwise.
template <typename Body>
void lead_team(nanovllm::StreamOrder& order, bool on_kernels, const Body& body) {
  if (on_kernels) return nanovllm::DecodeTeam::lead(order, body);
  body();
}

class DecodeLayers {
 public:
  DecodeLayers(std::vector<Layer> layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale)
      : layers_(std::move(layers)),
        heads_(num_heads),
        kv_heads_(num_kv_heads),
        dim_(head_dim),
        eps_(eps),
        scale_(scale),
        team_rows_(kernel_rows(layers_)) {}

  // x: the embedded tokens [T, hidden]; returns (the last layer's output, the residual), as the module
  // path leaves them for the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                             at::Tensor slot_mapping, at::Tensor block_tables,
                                             at::Tensor context_lens) const {
    std::tuple<at::Tensor, at::Tensor> out;
    lead_team(order_, x.size(0) <= team_rows_, [&] { out = layers(x, cos, sin, slot_mapping, block_tables, context_lens); });
    return out;
  }

 private:
  std::tuple<at::Tensor, at::Tensor> layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                            const at::Tensor& context_lens) const {
    at::Tensor residual;
    const int64_t tokens = x.size(0), qk_size = (heads_ + kv_heads_) * dim_;
    for (const Layer& layer : layers_) {
      if (!residual.defined()) {
        residual = x;
        x = rms_norm(x, layer.input_norm, eps_);
      } else {
        add_rms_norm_(x, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.qkv(x);
      at::Tensor qk = qkv.slice(1, 0, qk_size).view({tokens, -1, dim_});
      if (layer.qk_norm.has_value()) qk = rms_norm(qk, *layer.qk_norm, eps_);
      const auto rotated = rotary(qk, cos, sin).split({heads_, kv_heads_}, 1);
      const at::Tensor v = qkv.slice(1, qk_size).view({tokens, kv_heads_, dim_});
      store_kv_(rotated[1], v, layer.k_cache, layer.v_cache, slot_mapping, layer.k_scale, layer.v_scale);
      const at::Tensor attended = paged_decode_attention(rotated[0], layer.k_cache, layer.v_cache, block_tables,
                                                         context_lens, scale_, layer.k_scale, layer.v_scale);
      x = layer.o(attended.flatten(1));
      add_rms_norm_(x, residual, layer.post_attention_norm, eps_);
      x = layer.moe.has_value() ? (*layer.moe)(x) : (*layer.down)(silu_and_mul((*layer.gate_up)(x)));
    }
    return {x, residual};
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
  int64_t team_rows_;
  mutable nanovllm::StreamOrder order_;  // which weights follow which in a step (decode_team.h)
};

// ---- A hybrid model's (Qwen3.5's, Qwen3.5-MoE's) decode step in one call: Gated DeltaNet layers, each
// reading and writing its state rows in place, and gated-attention layers; every norm zero-centred (a float32
// 1 + w); dense MLPs or sparse experts with a shared expert. The modules' ops in their order
// (worker/models/qwen3_5.py).

struct LinearAttentionWeights {
  Projection in_proj, out_proj;
  at::Tensor conv_weight, a_log, dt_bias, norm_weight;  // norm_weight: GatedRMSNorm's, in the model's dtype
  at::Tensor conv_state, recurrent_state;              // every slot's rows, updated in place
  std::vector<int64_t> split_sizes;                     // the in-projection's mixed (q, k, v), z, b, a
  int64_t key_heads = 0, heads = 0, key_dim = 0, value_dim = 0;
  double norm_eps = 0;
};

struct GatedAttentionWeights {
  Projection qkv, o;  // qkv's rows: [q | gate] per head, then k, then v
  at::Tensor qk_norm;  // float32 [heads + kv_heads, head_dim]
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  double scale = 0;
  at::Tensor k_cache, v_cache;
  c10::optional<at::Tensor> k_scale, v_scale;
};

struct HybridLayer {
  at::Tensor input_norm, post_attention_norm;  // float32 1 + w
  c10::optional<LinearAttentionWeights> linear;
  c10::optional<GatedAttentionWeights> attention;
  c10::optional<Projection> gate_up, down;  // a dense MLP's, or
  c10::optional<SparseMoe> moe;             // a sparse layer's experts (and shared expert)

  int64_t kernel_rows() const {
    const int64_t rows = linear.has_value() ? std::min(linear->in_proj.kernel_rows(), linear->out_proj.kernel_rows())
                                            : std::min(attention->qkv.kernel_rows(), attention->o.kernel_rows());
    return std::min(rows, moe.has_value() ? moe->kernel_rows() : std::min(gate_up->kernel_rows(), down->kernel_rows()));
  }
};

class HybridDecodeLayers {
 public:
  HybridDecodeLayers(std::vector<HybridLayer> layers, double eps)
      : layers_(std::move(layers)), eps_(eps), team_rows_(kernel_rows(layers_)) {}

  // x: the embedded tokens [T, hidden], one a sequence; cos and sin [T, 1, rotary_dim]; slots: each
  // sequence's state row. Returns (the last layer's output, the residual), as the module path leaves them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor context_lens,
                                             at::Tensor slots) const {
    std::tuple<at::Tensor, at::Tensor> out;
    lead_team(order_, x.size(0) <= team_rows_,
              [&] { out = layers(x, cos, sin, slot_mapping, block_tables, context_lens, slots); });
    return out;
  }

 private:
  std::tuple<at::Tensor, at::Tensor> layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                            const at::Tensor& context_lens, const at::Tensor& slots) const {
    at::Tensor residual;
    for (const HybridLayer& layer : layers_) {
      if (!residual.defined()) {
        residual = x;
        x = norm(x, layer.input_norm);
      } else {
        add_and_norm(x, residual, layer.input_norm);
      }
      x = layer.linear.has_value() ? linear_attention(*layer.linear, x, slots)
                                   : gated_attention(*layer.attention, x, cos, sin, slot_mapping, block_tables,
                                                     context_lens);
      add_and_norm(x, residual, layer.post_attention_norm);
      x = layer.moe.has_value() ? (*layer.moe)(x) : (*layer.down)(silu_and_mul((*layer.gate_up)(x)));
    }
    return {x, residual};
  }

  // RMSNorm with a float32 weight: in a 16-bit model multiplied in float32 and rounded once.
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {
    return weight.scalar_type() == x.scalar_type() ? rms_norm(x, weight, eps_) : rms_norm_fp32_weight(x, weight, eps_);
  }

  // RMSNorm.add_and_norm: x <- norm(x + residual), residual <- x + residual.
  void add_and_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight) const {
    add_rms_norm_(x, residual, weight, eps_);
  }

  // GatedDeltaNet.forward for decode rows: the in-projection, the gates' SiLU in float32 as the module's
  // F.silu(z.float()) (widened into a buffer of their own, then PyTorch's SiLU in place: the same kernel), the
  // rest up to the out-projection in one call (linear_attention_decode_).
  static at::Tensor linear_attention(const LinearAttentionWeights& l, const at::Tensor& x, const at::Tensor& slots) {
    const at::Tensor projected = l.in_proj(x);  // mixed, z, b, a
    at::Tensor gate = at::empty({x.size(0), l.split_sizes[1]}, x.options().dtype(at::kFloat));
    gate.copy_(projected.narrow(1, l.split_sizes[0], l.split_sizes[1]));
    at::silu_(gate);
    return l.out_proj(linear_attention_decode_(projected, gate, l.conv_state, l.conv_weight, l.recurrent_state,
                                               l.a_log, l.dt_bias, l.norm_weight, slots, l.key_heads, l.key_dim,
                                               l.heads, l.value_dim, l.norm_eps));
  }

  // GatedAttention.forward for decode rows: q/k normalised per head, RoPE on the first rotary_dim of each
  // head (the rotary kernel, as the module runs it on the CPU kernels), the output times sigmoid(gate).
  at::Tensor gated_attention(const GatedAttentionWeights& a, const at::Tensor& x, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& context_lens) const {
    const int64_t tokens = x.size(0), d = a.head_dim, q_size = 2 * a.heads * d;
    const at::Tensor qkv = a.qkv(x);
    const std::vector<at::Tensor> q_gate = qkv.slice(1, 0, q_size).view({tokens, a.heads, 2 * d}).split(d, -1);
    const std::vector<at::Tensor> kv = qkv.slice(1, q_size).view({tokens, 2 * a.kv_heads, d}).chunk(2, 1);
    at::Tensor qk;
    if (a.qk_norm.scalar_type() != x.scalar_type()) {  // a 16-bit model's float32 1 + w: one call
      qk = gated_qk_norm_rope(qkv, a.heads, a.kv_heads, d, a.qk_norm, eps_, cos, sin);
    } else {
      qk = norm(at::cat({q_gate[0], kv[0]}, 1), a.qk_norm);
      qk = at::cat({rotary(qk.slice(-1, 0, a.rotary_dim), cos, sin), qk.slice(-1, a.rotary_dim)}, -1);
    }
    const std::vector<at::Tensor> q_k = qk.split_with_sizes({a.heads, a.kv_heads}, 1);
    store_kv_(q_k[1], kv[1].contiguous(), a.k_cache, a.v_cache, slot_mapping, a.k_scale, a.v_scale);
    const at::Tensor out = paged_decode_attention(q_k[0], a.k_cache, a.v_cache, block_tables, context_lens, a.scale,
                                                  a.k_scale, a.v_scale);
    return a.o(sigmoid_mul(out.flatten(1), q_gate[1].reshape({tokens, a.heads * d})));
  }

  std::vector<HybridLayer> layers_;
  double eps_;
  int64_t team_rows_;
  mutable nanovllm::StreamOrder order_;  // which weights follow which in a step (decode_team.h)
};

}  // namespace

void register_decode_layers(pybind11::module& m) {
  namespace py = pybind11;
  m.def("decode_teams_led", [] { return nanovllm::DecodeTeam::led().load(); }, "how many decode steps' layers "
        "this process ran on a team of more than one thread (decode_team.h)");
  py::class_<Projection>(m, "Projection", "One projection's weights for DecodeLayers: float or packed")
      .def(py::init([](c10::optional<at::Tensor> weight, c10::optional<at::Tensor> qweight,
                       c10::optional<at::Tensor> scales, c10::optional<at::Tensor> mins, int64_t bits,
                       int64_t group_size, c10::optional<at::Tensor> bias, int64_t few_rows_max,
                       bool batch_invariant, bool interleaved, bool exact) {
             TORCH_CHECK(weight.has_value() != qweight.has_value(), "Projection: a float weight or a packed one");
             return Projection{weight, qweight, scales, mins, bits, group_size, bias, few_rows_max, batch_invariant,
                               interleaved, exact};
           }),
           py::arg("weight"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"),
           py::arg("group_size"), py::arg("bias"), py::arg("few_rows_max"), py::arg("batch_invariant"),
           py::arg("interleaved") = false, py::arg("exact") = false);
  py::class_<SparseMoe>(m, "SparseMoe", "A sparse layer's router, experts and shared expert for the decode layers")
      .def(py::init([](Projection router, std::vector<Projection> w13, std::vector<Projection> w2, int64_t top_k,
                       bool norm_topk_prob, c10::optional<Projection> shared_gate_up,
                       c10::optional<Projection> shared_down, c10::optional<Projection> shared_gate) {
             TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "SparseMoe: ", w13.size(), " gate/up and ",
                         w2.size(), " down projections");
             TORCH_CHECK(router.weight.has_value(), "SparseMoe: the router's weight must be float");
             TORCH_CHECK(top_k >= 1 && top_k <= static_cast<int64_t>(w13.size()), "SparseMoe: top_k ", top_k,
                         " with ", w13.size(), " experts");
             TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() &&
                             shared_down.has_value() == shared_gate.has_value(),
                         "SparseMoe: a shared expert's gate_up, down and gate, all three or none");
             return SparseMoe{router, w13, w2, top_k, norm_topk_prob, shared_gate_up, shared_down, shared_gate};
           }),
           py::arg("router"), py::arg("w13"), py::arg("w2"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none());
  py::class_<Layer>(m, "DecoderLayerWeights", "One decoder layer's weights and KV cache for DecodeLayers")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm,
                       c10::optional<at::Tensor> qk_norm, Projection qkv, Projection o,
                       c10::optional<Projection> gate_up, c10::optional<Projection> down,
                       c10::optional<SparseMoe> moe, at::Tensor k_cache, at::Tensor v_cache,
                       c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
             TORCH_CHECK(moe.has_value() != (gate_up.has_value() && down.has_value()),
                         "DecoderLayerWeights: a dense MLP's gate_up and down, or a sparse layer's moe");
             return Layer{input_norm, post_attention_norm, qk_norm, qkv, o, gate_up, down, moe,
                          k_cache, v_cache, k_scale, v_scale};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qk_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("moe"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  py::class_<DecodeLayers>(m, "DecodeLayers", "A decode step's decoder layers in one call (CPU kernels)")
      .def(py::init<std::vector<Layer>, int64_t, int64_t, int64_t, double, double>(), py::arg("layers"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("forward", &DecodeLayers::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("context_lens"));
  py::class_<LinearAttentionWeights>(m, "LinearAttentionWeights", "A Gated DeltaNet layer's weights and state rows")
      .def(py::init([](Projection in_proj, Projection out_proj, at::Tensor conv_weight, at::Tensor a_log,
                       at::Tensor dt_bias, at::Tensor norm_weight, at::Tensor conv_state, at::Tensor recurrent_state,
                       std::vector<int64_t> split_sizes, int64_t key_heads, int64_t heads, int64_t key_dim,
                       int64_t value_dim, double norm_eps) {
             TORCH_CHECK(split_sizes.size() == 4, "LinearAttentionWeights: split_sizes are mixed, z, b and a; got ",
                         split_sizes.size());
             return LinearAttentionWeights{in_proj, out_proj, conv_weight, a_log, dt_bias, norm_weight, conv_state,
                                           recurrent_state, split_sizes, key_heads, heads, key_dim, value_dim,
                                           norm_eps};
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("conv_weight"), py::arg("a_log"), py::arg("dt_bias"),
           py::arg("norm_weight"), py::arg("conv_state"), py::arg("recurrent_state"), py::arg("split_sizes"),
           py::arg("key_heads"), py::arg("heads"), py::arg("key_dim"), py::arg("value_dim"), py::arg("norm_eps"));
  py::class_<GatedAttentionWeights>(m, "GatedAttentionWeights", "A gated-attention layer's weights and KV cache")
      .def(py::init([](Projection qkv, Projection o, at::Tensor qk_norm, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t rotary_dim, double scale, at::Tensor k_cache, at::Tensor v_cache,
                       c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
             return GatedAttentionWeights{qkv, o, qk_norm, heads, kv_heads, head_dim, rotary_dim, scale,
                                          k_cache, v_cache, k_scale, v_scale};
           }),
           py::arg("qkv"), py::arg("o"), py::arg("qk_norm"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("rotary_dim"), py::arg("scale"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  py::class_<HybridLayer>(m, "HybridLayerWeights", "One hybrid decoder layer for HybridDecodeLayers")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm,
                       c10::optional<LinearAttentionWeights> linear, c10::optional<GatedAttentionWeights> attention,
                       c10::optional<Projection> gate_up, c10::optional<Projection> down,
                       c10::optional<SparseMoe> moe) {
             TORCH_CHECK(linear.has_value() != attention.has_value(),
                         "HybridLayerWeights: a linear-attention layer or a gated-attention one");
             TORCH_CHECK(moe.has_value() != (gate_up.has_value() && down.has_value()),
                         "HybridLayerWeights: a dense MLP's gate_up and down, or a sparse layer's moe");
             return HybridLayer{input_norm, post_attention_norm, linear, attention, gate_up, down, moe};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("linear"), py::arg("attention"),
           py::arg("gate_up"), py::arg("down"), py::arg("moe"));
  py::class_<HybridDecodeLayers>(m, "HybridDecodeLayers", "A hybrid model's decode step in one call (CPU kernels)")
      .def(py::init<std::vector<HybridLayer>, double>(), py::arg("layers"), py::arg("eps"))
      .def("forward", &HybridDecodeLayers::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"), py::arg("slots"));
}
