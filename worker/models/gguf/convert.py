"""One GGUF file into a Hugging Face model directory: config, generation config and tokenizer
(`convert_gguf`), and on demand its weights dequantized and renamed (`write_weights`).

The weights are written only for a reader of directories alone (a draft model): the served model reads
its weights from the file itself in every quantization (worker/runner/build.py), and a float32 copy of a
large model would cost four bytes per parameter of disk. They are written in shards of at most SHARD_BYTES, so
converting never holds more than one shard in memory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.layout import generation_config, hf_config, open_reader, read_metadata
from nanovllm.worker.models.gguf.tensors import gguf_tensors
from nanovllm.worker.models.gguf.tokenizer import build_tokenizer, transformers_tokenizer

SHARD_BYTES = 2 * 2**30
# Written last, once every shard is in place: the directory holds its weights when this file exists.
WEIGHTS_INDEX = "model.safetensors.index.json"


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write the Hugging Face config, generation config and tokenizer for `gguf_path` into the existing
    directory `out_dir`; returns the time each stage took (seconds) and which tokenizer path was used."""
    start = time.perf_counter()
    reader = open_reader(gguf_path)
    metadata = read_metadata(reader)
    config = hf_config(metadata, [tensor.name for tensor in reader.tensors])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(metadata), indent=2) + "\n")
    read_s = time.perf_counter() - start

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
        "tokenizer_s": round(tokenizer_s, 3),
        "total_s": round(read_s + tokenizer_s, 3),
        "tokenizer_path": tokenizer_path,
    }


def has_weights(model_dir: Path) -> bool:
    return (model_dir / WEIGHTS_INDEX).is_file()


def write_weights(gguf_path: Path, model_dir: Path, shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Dequantize every tensor of `gguf_path` to float32 under transformers' names into `model_dir` (which
    convert_gguf wrote): shards model-<i>-of-<n>.safetensors and their index, each written under a
    temporary name and renamed, the index last. Two processes doing this at once write the same bytes."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    config = ModelConfig.from_pretrained_dir(model_dir)
    shards: list[list[str]] = []  # each written shard's tensor names
    current: dict[str, Any] = {}
    size = total = 0
    for name, loadable in gguf_tensors(gguf_path, config, packed=False):
        tensor = loadable.read()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            save_file(current, str(model_dir / _shard_name(len(shards) + 1, 0)), metadata={"format": "pt"})
            shards.append(list(current))
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
        total += nbytes
    save_file(current, str(model_dir / _shard_name(len(shards) + 1, 0)), metadata={"format": "pt"})
    shards.append(list(current))
    count = len(shards)
    for i in range(1, count + 1):  # the shards were named before their count was known
        os.replace(model_dir / _shard_name(i, 0), model_dir / _shard_name(i, count))
    weight_map = {name: _shard_name(i + 1, count) for i, names in enumerate(shards) for name in names}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    staging = model_dir / f".{WEIGHTS_INDEX}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(staging, model_dir / WEIGHTS_INDEX)
    return {"weights_s": round(time.perf_counter() - start, 3), "weights_bytes": total, "shards": count}


def _shard_name(index: int, count: int) -> str:
    """The shard's file name; count 0: its name while the count is not known yet (not *.safetensors, so
    no loader picks it up)."""
    if count == 0:
        return f".model-{index:05d}.{os.getpid()}.partial"
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 names its generic fast tokenizer TokenizersBackend, a class transformers 4 lacks;
    PreTrainedTokenizerFast loads as the same class in 5 and exists in 4, so the cached directory keeps
    loading if the installed transformers changes."""
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
