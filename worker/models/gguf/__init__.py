"""Serve GGUF checkpoints by converting them, once, into a standard Hugging Face model directory
(cache.py, convert.py, layout.py, tokenizer.py), or with their quantized tensors as they ship (tensors.py).

The engine only loads Hugging Face directories (config.json + safetensors + tokenizer files). A GGUF file
carries the same model in llama.cpp's layout: quantized tensors under llama.cpp names, the configuration
and the tokenizer as metadata. `prepare_gguf` turns one into the other and caches the result:

- weights are dequantized to float32 with the `gguf` package and renamed to Hugging Face names; the rows
  of Llama's q/k projections are un-permuted (llama.cpp's converter interleaves each head's rotary halves);
- config.json / generation_config.json are mapped from the `llama.*` and `tokenizer.ggml.*` metadata;
- the tokenizer is rebuilt with the `tokenizers` library straight from the vocabulary and merges (a fraction
  of a second), for the byte-level BPE pre-tokenizers this module knows; any other tokenizer goes through
  transformers' own GGUF tokenizer conversion, which is slower but covers every type transformers covers.

`quantization=auto` serves a GGUF as it ships instead: `gguf_quant_plan` says which layers keep their
Q8_0 / Q4_0 / Q4_1 tensors, and `gguf_tensors` hands those to the loader as PackedWeights (their blocks
split into planes, never dequantized) and the rest as float32. The converted directory still supplies the
configuration and the tokenizer.

The cache lives under ~/.cache/nanovllm/gguf/<key>, the key hashing the file's absolute path, size and
modification time, so an edited or replaced file converts again. A conversion writes into a temporary
directory renamed into place only when complete: a killed conversion never leaves a directory that looks
finished.
"""
