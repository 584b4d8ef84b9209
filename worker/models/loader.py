"""Load checkpoints into a nanovllm model: Hugging Face safetensors (single file or sharded) here, a GGUF
file's tensors as they ship through worker/models/gguf/, both by `load_tensors`.

Files are memory-mapped; each weight's `weight_loader` reads only this rank's slice of a tensor
(CheckpointTensor.narrow), and fuses q/k/v and gate/up projections into the fused weights the model
declares (float parameters, PackedWeights or BlockFp8Weights, worker/layers/quantization.py).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.worker.layers.attention import Attention
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight
from nanovllm.worker.layers.loadable import LoadableTensor, read_float
from nanovllm.worker.layers.quantization import PackedWeight, assign
from nanovllm.worker.model_config import CheckpointQuantization
from nanovllm.worker.models.quantized_checkpoint import QuantizedCheckpoint

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


def _copy_whole(param: nn.Parameter, loaded: LoadableTensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ConfigError(
            f"checkpoint tensor {loaded.name} of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
        )
    assign(param, loaded.read())


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


def has_tensors_under(model_dir: str | Path, prefix: str) -> bool:
    """Whether a Hugging Face checkpoint directory holds a tensor whose name starts with `prefix` (its
    files' headers read)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if any(name.startswith(prefix) for name in f.keys()):  # noqa: SIM118 (safe_open is not iterable)
                return True
    return False


def safetensors_tensors(
    model_dir: str | Path, files: contextlib.ExitStack
) -> list[tuple[str, LoadableTensor]]:
    """Every tensor of a Hugging Face checkpoint directory, read lazily from its files, which stay open
    until `files` closes (a quantized weight's scales may lie in another shard)."""
    tensors: list[tuple[str, LoadableTensor]] = []
    for path in safetensors_files(model_dir):
        f = files.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if "rotary_emb.inv_freq" not in name:
                tensors.append((name, CheckpointTensor(f, name)))
    return tensors


def load_safetensors(
    model: nn.Module,
    model_dir: str | Path,
    quantization: CheckpointQuantization | None = None,
    packed: bool = False,
) -> QuantizedCheckpoint | None:
    """Load a checkpoint directory; one quantized before it shipped (`quantization`) goes through its
    reader (worker/models/quantized_checkpoint.py; `packed`: its int4 layers kept packed), returned for
    the start log."""
    reader = None if quantization is None else QuantizedCheckpoint(quantization, packed, str(model_dir))
    with contextlib.ExitStack() as files:
        tensors: Iterable[tuple[str, LoadableTensor]] = safetensors_tensors(model_dir, files)
        if reader is not None:
            tensors = reader.tensors(tensors)
        load_tensors(model, tensors, str(model_dir))
    return reader


# An expert's projection in a mixture-of-experts checkpoint (...mlp.experts.<e>.<projection>.weight): it goes
# into that expert's w13 (gate, up) or w2 (down), worker/layers/moe.py.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _target(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """The model weight a checkpoint tensor goes into, and the part of it (shard id) it fills."""
    expert = _EXPERT.search(name)
    if expert is not None:
        stacked = "w2" if expert.group(2) == "down_proj" else "w13"
        return f"{name[: expert.start()]}.experts.{stacked}.{expert.group(1)}", expert.group(2)
    for part, (fused, sid) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), sid
    return name, None


class ExpertPart:
    """Rows [first, first + rows) of expert `expert`'s matrix in a checkpoint's fused expert tensor
    ([experts, out, in], transformers' layout for Qwen3.5-MoE's published checkpoints), read as the
    per-expert tensor it stands for."""

    def __init__(self, fused: LoadableTensor, name: str, expert: int, first: int, rows: int) -> None:
        self._fused, self.name, self._expert, self._first = fused, name, expert, first
        self.shape = torch.Size([rows, fused.shape[2]])

    def read(self) -> torch.Tensor:
        expert = self._fused.narrow(0, self._expert, 1)
        assert isinstance(expert, torch.Tensor)  # fused experts are float tensors, never packed
        return expert[0].narrow(0, self._first, self.shape[0])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.read().narrow(dim, start, length)


_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _per_expert(tensors: Iterable[tuple[str, LoadableTensor]]) -> Iterator[tuple[str, LoadableTensor]]:
    """Fused expert tensors (...experts.gate_up_proj [E, 2I, H], ...experts.down_proj [E, H, I]) as the
    per-expert projections they hold; every other tensor as it is."""
    for name, tensor in tensors:
        fused = _FUSED_EXPERTS.search(name)
        if fused is None or len(tensor.shape) != 3:
            yield name, tensor
            continue
        base = name[: fused.start()]
        for e in range(tensor.shape[0]):
            if fused.group(1) == "down_proj":
                yield f"{base}.experts.{e}.down_proj.weight", ExpertPart(tensor, name, e, 0, tensor.shape[1])
            else:
                half = tensor.shape[1] // 2
                yield f"{base}.experts.{e}.gate_proj.weight", ExpertPart(tensor, name, e, 0, half)
                yield f"{base}.experts.{e}.up_proj.weight", ExpertPart(tensor, name, e, half, half)


def _keep_kv_scale(model: nn.Module, name: str, tensor: LoadableTensor, source: str) -> None:
    """An FP8 checkpoint's per-tensor KV cache scale (value = stored byte x scale, vLLM's convention), kept on
    its attention layer for an FP8 cache (worker/runner/build.py); a cache in the model's dtype ignores it."""
    attention = cast(Attention, model.get_submodule(name.rsplit(".", 1)[0] + ".attn"))  # self_attn's
    value = read_float(tensor)
    if value.numel() != 1:
        raise ConfigError(
            f"checkpoint tensor {name} in {source}: a per-tensor KV scale, got shape {tuple(value.shape)}"
        )
    attention.checkpoint_scales["key" if name.endswith("k_scale") else "value"] = float(value)


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, LoadableTensor]], source: str) -> None:
    """Copy every checkpoint tensor into its weight; every weight must be covered."""
    weights: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    weights |= {
        name: m
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, (PackedWeight, BlockFp8Weight))
    }
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    # A model whose checkpoints name its tensors otherwise (a multimodal layout served text-only) says how
    # each maps to its own names, None for a tensor it does not run.
    rename = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    skipped: dict[str, int] = {}
    for name, tensor in _per_expert(tensors):
        stored = name  # as the checkpoint names it, for errors
        if rename is not None:
            own = rename(name)
            if own is None:
                part = name.split(".")[0] if not name.startswith("model.") else ".".join(name.split(".")[:2])
                skipped[part] = skipped.get(part, 0) + 1
                continue
            name = own
        if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
            _keep_kv_scale(model, name, tensor, source)
            continue
        target, shard_id = _target(name, packed)
        weight = weights.get(target)
        if weight is None:
            raise ConfigError(f"checkpoint tensor {stored!r} in {source} matches no model parameter")
        loader = getattr(weight, "weight_loader", _copy_whole)
        loader(weight, tensor, shard_id)
        loaded.add(target)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(weights) - loaded - tied)
    if missing:
        raise ConfigError(f"checkpoint in {source} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    if skipped:
        log.info("checkpoint_tensors_not_served", source=source, tensors_by_prefix=skipped)
    log.debug("weights_loaded", source=source, tensors=len(loaded))
