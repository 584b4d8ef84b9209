// Shared by the CPU kernels' sources: fp32 <-> bf16/fp16 conversions written to vectorise, e^x in a
// vectorisable form, and the dtype dispatch and checks. Everything here is inline in an unnamed namespace,
// so each source file gets its own copy.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

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
// An FP8 KV cache's bytes (kernels/fp8_kv.py) as fp16 bits: e5m2 is the top byte of an fp16, and e4m3's
// bits moved into fp16's places make an fp16 kFp8Factor (2^8) times smaller than the value. The fp16 is
// then widened by the CPU's conversion (or the portable one above), which handles subnormals without a
// branch or a microcode assist; callers fold the factor into their scales (a power of two: exact).
inline uint16_t fp8_half_bits(c10::Float8_e4m3fn x) {
  const uint32_t b = x.x;
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}
inline uint16_t fp8_half_bits(c10::Float8_e5m2 x) { return static_cast<uint16_t>(x.x << 8); }
template <typename C>
constexpr float kFp8Factor = std::is_same_v<C, c10::Float8_e4m3fn> ? 256.f : 1.f;

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
void check_one_dtype(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const auto first = tensors.begin()->second->scalar_type();
  bool same = true;
  for (const auto& t : tensors) same = same && t.second->scalar_type() == first;
  if (same) return;
  std::string got;
  for (const auto& t : tensors)
    got += std::string(got.empty() ? "" : ", ") + t.first + " " + c10::toString(t.second->scalar_type());
  TORCH_CHECK(false, op, ": all tensors must have the same dtype, got ", got);
}

}  // namespace
