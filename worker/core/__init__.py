"""The engine core: LLMEngine's step loop, the scheduler that decides each step and applies its results,
and the block manager of the paged KV cache. Imports the rooms below it (runner, sample, models, layers)."""
