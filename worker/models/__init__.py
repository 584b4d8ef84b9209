"""Model definitions (the decoder, its one-call decode layers) and checkpoint loading (safetensors, GGUF)."""
