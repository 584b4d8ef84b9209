// The CPU kernels' entry points, each defined in the file named above it (which includes this header, so
// the compiler holds definition and declaration together); bindings_cpu.cpp binds them and
// decode_layers_cpu.cpp chains them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// paged_attention_cpu.cpp
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void store_kv_(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
               c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gelu_tanh(at::Tensor x);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);

// linear_cpu.cpp
at::Tensor linear_few_rows(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
std::vector<at::Tensor> linear_grouped(std::vector<at::Tensor> xs, std::vector<at::Tensor> weights);

// linear_quantized_cpu.cpp
at::Tensor linear_quantized(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                            c10::optional<at::Tensor> mins, int64_t bits, int64_t group_size,
                            c10::optional<at::Tensor> bias, bool batch_invariant, bool interleaved, bool exact);
at::Tensor dequantize_rows(at::Tensor qweight, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t bits,
                           int64_t group_size, at::Tensor rows, at::ScalarType dtype, bool interleaved);
bool linear_quantized_int8_dots();
// The most rows of 16-bit x linear_quantized runs on its own kernels when not batch_invariant (more are
// dequantized for ATen's GEMM; float32 x stays on them longer).
int64_t linear_quantized_direct_rows();
bool linear_quantized_interleaved();

// lora_cpu.cpp
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor rows,
               at::Tensor starts, at::Tensor slots, std::vector<int64_t> parts);

// token_bitmask_cpu.cpp
void apply_token_bitmask_(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);

// gated_delta_cpu.cpp
at::Tensor causal_conv_decode_(at::Tensor x, at::Tensor state, at::Tensor weight, at::Tensor slots);
at::Tensor gated_delta_decode_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                               at::Tensor state, at::Tensor slots, c10::optional<at::Tensor> out);
at::Tensor causal_conv_chunk_(at::Tensor x, at::Tensor state, at::Tensor weight, int64_t slot);
at::Tensor gated_delta_chunk_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                              at::Tensor state, int64_t slot, c10::optional<at::Tensor> out);
std::vector<at::Tensor> delta_gates(at::Tensor a, at::Tensor b, at::Tensor a_log, at::Tensor dt_bias);
at::Tensor sigmoid_mul(at::Tensor x, at::Tensor gate);
at::Tensor rms_norm_fp32_weight(at::Tensor x, at::Tensor weight, double eps);
at::Tensor gated_qk_norm_rope(at::Tensor qkv, int64_t heads, int64_t kv_heads, int64_t d, at::Tensor weight,
                              double eps, at::Tensor cos, at::Tensor sin);
// Into `out` (contiguous, x's shape and dtype; may be x itself): what rms_norm_fp32_weight returns.
void rms_norm_fp32_weight_into(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
at::Tensor gated_rms_norm(at::Tensor core, at::Tensor gate, at::Tensor weight, double eps);
at::Tensor linear_attention_decode_(at::Tensor projected, at::Tensor gate, at::Tensor conv_state,
                                    at::Tensor conv_weight, at::Tensor recurrent_state, at::Tensor a_log,
                                    at::Tensor dt_bias, at::Tensor norm_weight, at::Tensor slots, int64_t key_heads,
                                    int64_t key_dim, int64_t heads, int64_t value_dim, double norm_eps);

// sampling_cpu.cpp
at::Tensor sample_rows(at::Tensor logits, at::Tensor spec);
at::Tensor argmax_rows(at::Tensor logits);
