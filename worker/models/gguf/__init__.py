"""Serve GGUF checkpoints: their configuration and tokenizer converted, once, into a standard Hugging Face
model directory (cache.py, convert.py, layout.py, tokenizer.py), their weights read from the file
(tensors.py).

The engine reads a model's configuration and tokenizer from a Hugging Face directory. A GGUF file carries
the same model in llama.cpp's layout: quantized tensors under llama.cpp names, the configuration and the
tokenizer as metadata. `prepare_gguf` turns one into the other and caches the result:

- weights, for a reader of directories alone (a draft model), are dequantized to
  float32 with the `gguf` package and renamed to Hugging Face names, in shards (convert.py write_weights);
  the rows of Llama's q/k projections are un-permuted (llama.cpp's converter interleaves each head's
  rotary halves), Qwen3.5's changes undone (qwen35.py), and a mixture-of-experts projection's 3-D tensor
  becomes one tensor per expert;
- config.json / generation_config.json are mapped from the `<architecture>.*` and `tokenizer.ggml.*`
  metadata (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE: qwen35.py);
- the tokenizer is rebuilt with the `tokenizers` library straight from the vocabulary and merges (a fraction
  of a second), for the byte-level BPE pre-tokenizers this module knows; any other tokenizer goes through
  transformers' own GGUF tokenizer conversion, which is slower but covers every type transformers covers.

The served model's weights come from the file in every quantization: with `quantization=auto`
`gguf_quant_plan` says which layers keep their Q8_0 / Q4_0 / Q4_1 tensors, and `gguf_tensors` hands those
to the loader as PackedWeights (their blocks split into planes, never dequantized) and the rest as float32,
dequantized one tensor at a time; with none, int8 or int4 every tensor comes dequantized (int8/int4 then
requantize it). The converted directory holds weights only for a draft model.

The cache lives under ~/.cache/nanovllm/gguf/<key>, the key hashing the file's absolute path, size and
modification time, so an edited or replaced file converts again. A conversion writes into a temporary
directory renamed into place only when complete: a killed conversion never leaves a directory that looks
finished. Each directory records its source file, and a conversion deletes those no file reaches any more.
"""
