// Every kernel's file, compiled as one translation unit. Each file on its own parsed ATen's headers again
// (about 18 s of a 20-60 s compilation on a 2-core AVX2 EPYC): together they compile in about a third of
// the CPU time, and a fresh build (CI, a new machine's first start) takes half as long
// (docs/performance.md#measurements-behind-choices-in-the-code). The files stay one concept each; names
// private to a file live in its anonymous namespace and must not repeat another file's.
#include "gated_delta_cpu.cpp"
#include "linear_cpu.cpp"
#include "linear_quantized_cpu.cpp"
#include "lora_cpu.cpp"
#include "paged_attention_cpu.cpp"
#include "sampling_cpu.cpp"
#include "token_bitmask_cpu.cpp"
