"""Load Hugging Face safetensors checkpoints (single file or sharded) into a nanovllm model.

Files are memory-mapped; each parameter's `weight_loader` reads only this rank's slice of a tensor
(CheckpointTensor.narrow), and fuses q/k/v and gate/up projections into the packed parameters the model
declares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger

log = get_logger(__name__)


class CheckpointTensor:
    """One tensor of an open safetensors file, read lazily: `narrow` reads just that slice from the
    memory-mapped file, so a tensor-parallel rank never materializes the other ranks' parts."""

    def __init__(self, file: Any, name: str) -> None:
        self._file, self.name = file, name
        self.shape = torch.Size(file.get_slice(name).get_shape())

    def read(self) -> torch.Tensor:
        return self._file.get_tensor(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._file.get_slice(self.name)[tuple(index)]


def _copy_whole(param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ConfigError(
            f"checkpoint tensor {loaded.name} of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
        )
    param.data.copy_(loaded.read())


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights found in {model_dir}")
    return files


def load_safetensors(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard_id = name, None
                for source, (fused, sid) in packed.items():
                    if f".{source}." in name:
                        target, shard_id = name.replace(f".{source}.", f".{fused}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ConfigError(f"checkpoint tensor {name!r} in {path.name} matches no model parameter")
                loader = getattr(param, "weight_loader", _copy_whole)
                loader(param, CheckpointTensor(f, name), shard_id)
                loaded.add(target)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ConfigError(f"checkpoint in {model_dir} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    log.debug("weights_loaded", model_dir=str(model_dir), tensors=len(loaded))
