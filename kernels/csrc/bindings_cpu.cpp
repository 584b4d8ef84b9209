// The Python module: every CPU kernel, bound in this one file. The kernels' own files include ATen only
// (compiled together: kernels_cpu.cpp); torch/extension.h (pybind11 and all of torch's C++ API) costs about
// a minute of compilation, so it is parsed once, here, with decode_layers_cpu.cpp (its classes' bindings).
#include <torch/extension.h>

#include "kernels_cpu.h"

#include "decode_layers_cpu.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_layers(m);
  m.def("linear_few_rows", &linear_few_rows, "x @ weight.T (+ bias) for few rows of x, reading each weight once "
        "(CPU; float32, bfloat16, float16; fp32 accumulation)", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("linear_grouped", &linear_grouped, "xs[g] @ weights[g].T for every g, as linear_few_rows computes each, in "
        "one parallel region (CPU; float32, bfloat16, float16)", py::arg("xs"), py::arg("weights"));
  m.def("linear_quantized", &linear_quantized, "x @ W.T (+ bias) with W as 8- or 4-bit integers in groups with "
        "float16 scales (and mins at 4 bits) (CPU; x float32, bfloat16, float16; fp32 accumulation)", py::arg("x"),
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group_size"),
        py::arg("bias") = py::none(), py::arg("batch_invariant") = false, py::arg("interleaved") = false,
        py::arg("exact") = false);
  m.def("dequantize_rows", &dequantize_rows, "rows of a packed weight (linear_quantized's planes) in a float dtype, "
        "as PackedWeight.dequantize computes them: an embedding's lookup (CPU)", py::arg("qweight"), py::arg("scales"),
        py::arg("mins"), py::arg("bits"), py::arg("group_size"), py::arg("rows"), py::arg("dtype"),
        py::arg("interleaved") = false);
  m.def("linear_quantized_interleaved", &linear_quantized_interleaved, "whether linear_quantized takes 4-bit "
        "weights in groups of 32 and 8-bit ones with one scale a row with their rows interleaved 16 at a time "
        "(PackedWeight.interleave_; with the integer dots: AVX512-VNNI or AVX2)");
  m.def("linear_quantized_int8_dots", &linear_quantized_int8_dots, "whether linear_quantized quantizes x to "
        "int8 for integer dot products unless exact (built for a CPU with AVX512-VNNI or AVX2)");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "logits[rows[j], t] = -inf where bit t of bitmask[j] is clear (CPU; float32; in place)");
  m.def("sample_rows", &sample_rows, "one token per row of float32 logits, drawn by inversion with spec's "
        "[temperature, top_k, top_p, min_p, uniform] rows (CPU)");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's largest float32 logit, a NaN the largest, "
        "as torch.argmax(dim=-1) (CPU)");
  m.def("store_kv_", &store_kv_, "new tokens' K and V into their cache slots, as index_copy_, or quantized with "
        "per-kv-head scales into an FP8 cache (CPU; float32, bfloat16, float16)", py::arg("key"), py::arg("value"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:] (CPU; float32, bfloat16, float16)");
  m.def("gelu_tanh", &gelu_tanh, "GELU's tanh form, in float32, rounded once to x's dtype (CPU; float32, bfloat16, float16)");
  m.def("rotary", &rotary, "rotate-half RoPE with precomputed cos / signed sin rows (CPU; float32, bfloat16, float16)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache in the queries' dtype or FP8 with per-kv-head scales (CPU; "
        "float32, bfloat16, float16; fp32 accumulation)", py::arg("query"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("lora_add_", &lora_add_, "y += each row group's LoRA adapter applied to x, part by part (CPU; float32, "
        "bfloat16, float16; fp32 accumulation; in place)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, weight [D] or one row per head [H, D] for x [T, H, D] "
        "(CPU; float32, bfloat16, float16)");
  m.def("causal_conv_decode_", &causal_conv_decode_, "a hybrid model's causal convolution for one token of B "
        "sequences, SiLU applied, each on its state row (updated in place) (CPU; float32, bfloat16, float16)");
  m.def("gated_delta_decode_", &gated_delta_decode_, "the gated delta rule's recurrent step for one token of B "
        "sequences, each on its float32 state row (updated in place); returns the float32 output, or `out` filled "
        "(CPU)", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"),
        py::arg("slots"), py::arg("out") = py::none());
  m.def("causal_conv_chunk_", &causal_conv_chunk_, "a prompt chunk of one sequence through the causal "
        "convolution token by token, as causal_conv_decode_ computes each (CPU; in place on the state row)");
  m.def("gated_delta_chunk_", &gated_delta_chunk_, "a prompt chunk of one sequence through the gated delta "
        "rule token by token, as gated_delta_decode_ computes each (CPU; in place on the state row)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("slot"),
        py::arg("out") = py::none());
  m.def("delta_gates", &delta_gates, "Qwen3.5's (g, beta) of each token and value head, float32 (CPU)");
  m.def("sigmoid_mul", &sigmoid_mul, "x * sigmoid(gate), the sigmoid rounded to the dtype (CPU; float32, bfloat16, "
        "float16)");
  m.def("gated_rms_norm", &gated_rms_norm, "Qwen3.5's gated RMSNorm of float32 rows rounded to the weight's dtype, "
        "times the weight, times a float32 gate, as transformers rounds it (CPU; float32, bfloat16, float16)");
  m.def("linear_attention_decode_", &linear_attention_decode_, "A Gated DeltaNet layer's decode step between its "
        "projections (convolution, gates, delta rule on the state rows in place, gated RMSNorm) in one call (CPU; "
        "float32, bfloat16, float16)", py::arg("projected"), py::arg("gate"), py::arg("conv_state"),
        py::arg("conv_weight"), py::arg("recurrent_state"), py::arg("a_log"), py::arg("dt_bias"),
        py::arg("norm_weight"), py::arg("slots"), py::arg("key_heads"), py::arg("key_dim"), py::arg("heads"),
        py::arg("value_dim"), py::arg("norm_eps"));
  m.def("gated_qk_norm_rope", &gated_qk_norm_rope, "Qwen3.5's gated attention's q and k heads from the QKV "
        "projection's output, normalised with a float32 weight and turned by RoPE on their first dims, in one call "
        "(CPU; float32, bfloat16, float16)", py::arg("qkv"), py::arg("heads"), py::arg("kv_heads"), py::arg("d"),
        py::arg("weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"));
  m.def("rms_norm_fp32_weight", &rms_norm_fp32_weight, "RMSNorm with a float32 weight, multiplied in float32 and "
        "rounded once (CPU; float32, bfloat16, float16)");
  m.def("add_rms_norm_", &add_rms_norm_,
        "residual += x; x = RMSNorm(residual), a float32 weight with 16-bit x as rms_norm_fp32_weight (CPU; "
        "float32, bfloat16, float16; in place)");
}
