"""One GGUF file into a Hugging Face model directory: weights dequantized and renamed, config,
generation config and tokenizer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import ConfigError, UnsupportedModelError
from nanovllm.worker.models.gguf.layout import (
    generation_config,
    hf_config,
    hf_tensor_names,
    read_metadata,
    rotary_rows_heads,
    unpermute_rotary_rows,
)
from nanovllm.worker.models.gguf.tokenizer import build_tokenizer, transformers_tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write the Hugging Face files for `gguf_path` into the existing directory `out_dir`; returns the
    time each stage took (seconds) and which tokenizer path was used."""
    import gguf
    from safetensors.torch import save_file

    start = time.perf_counter()
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    metadata = read_metadata(reader)
    tensor_names = [tensor.name for tensor in reader.tensors]
    config = hf_config(metadata, tensor_names)
    read_s = time.perf_counter() - start

    start = time.perf_counter()
    tensors = _dequantized_tensors(gguf_path, reader, config)
    dequantize_s = time.perf_counter() - start

    start = time.perf_counter()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(metadata), indent=2) + "\n")
    write_s = time.perf_counter() - start

    start = time.perf_counter()
    tokenizer = build_tokenizer(metadata, config["max_position_embeddings"])
    tokenizer_path = "tokenizers"
    if tokenizer is None:
        tokenizer = transformers_tokenizer(gguf_path)
        tokenizer_path = "transformers"
    tokenizer.save_pretrained(str(out_dir))
    _portable_tokenizer_class(out_dir / "tokenizer_config.json")
    tokenizer_s = time.perf_counter() - start

    return {
        "read_s": round(read_s, 3),
        "dequantize_s": round(dequantize_s, 3),
        "write_s": round(write_s, 3),
        "tokenizer_s": round(tokenizer_s, 3),
        "total_s": round(read_s + dequantize_s + write_s + tokenizer_s, 3),
        "tokenizer_path": tokenizer_path,
    }


def _dequantized_tensors(gguf_path: Path, reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the file as float32 torch tensors under transformers' names and layouts."""
    import gguf
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, "
                f"which the gguf package cannot dequantize"
            ) from exc
        # GGUF lists dimensions fastest-moving first; torch wants [out_features, in_features].
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        heads = rotary_rows_heads(
            tensor.name,
            config["architectures"][0],
            config["num_attention_heads"],
            config["num_key_value_heads"],
        )
        if heads is not None:
            values = unpermute_rotary_rows(values, heads)
        names = hf_tensor_names(tensor.name, shape)
        parts = list(values) if len(names) > 1 else [values]  # a 3-D expert tensor: one expert per row
        for name, part in zip(names, parts):
            # F32 tensors come back as views of the read-only file mapping, and experts as views of their
            # 3-D tensor, which safetensors will not save as separate tensors: those are copied.
            if len(parts) > 1 or not part.flags.writeable:
                part = part.copy()
            tensors[name] = torch.from_numpy(np.ascontiguousarray(part))
    return tensors


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 names its generic fast tokenizer TokenizersBackend, a class transformers 4 lacks;
    PreTrainedTokenizerFast loads as the same class in 5 and exists in 4, so the cached directory keeps
    loading if the installed transformers changes."""
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
