"""The layers models are built from: attention, linear (float and quantized), norms, rotary, embeddings."""
