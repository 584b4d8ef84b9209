// Structured output's token masks applied to the logits: logits[rows[j], t] = -inf wherever bit t % 32 of
// bitmask[j][t / 32] is clear (worker/structured_output.py fills the bitmasks, worker/sampler.py calls this).
//
// PyTorch has no op that reads packed bits, so the torch path unpacks them into a [rows, 32 * words] tensor
// and runs masked_fill over it, as long as the rest of the sampler
// (docs/performance.md#measurements-behind-choices-in-the-code). Here one pass reads each word once and writes only the
// disallowed logits.
#include <ATen/ATen.h>
#include "kernels_cpu.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

void apply_token_bitmask_(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask_: logits must be contiguous float32 [batch, vocab], got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask must be contiguous int32 [rows, words], got ", bitmask.sizes(), " ",
              bitmask.scalar_type());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask_: rows must be int64 [", bitmask.size(0), "], got ", rows.sizes());
  const int64_t vocab = logits.size(1), words = bitmask.size(1), n = rows.size(0);
  TORCH_CHECK(words * 32 >= vocab, "apply_token_bitmask_: ", words, " words of bits cannot cover ", vocab,
              " logits");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(0 <= row[j] && row[j] < logits.size(0), "apply_token_bitmask_: row ", row[j], " is outside [0, ",
                logits.size(0), ")");
  float* out = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = vocab / 32;
  at::parallel_for(0, n * words, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j = i / words, w = i % words;
      uint32_t clear = ~bits[j * words + w];
      if (w >= full_words) clear &= (vocab % 32 == 0) ? 0u : ((1u << (vocab % 32)) - 1u);  // past the vocab
      float* x = out + row[j] * vocab + w * 32;
      while (clear != 0) {  // only the disallowed tokens are written
        x[__builtin_ctz(clear)] = neg_inf;
        clear &= clear - 1;
      }
    }
  });
}
