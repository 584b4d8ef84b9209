"""Read a LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) for a model.

Everything is checked before anything is used: the config's fields, each tensor's name (a projection of a
decoder layer that LoRA can adapt here) and shape (the model's, at a rank within the engine's maximum), so a
bad adapter fails its load naming the problem and never reaches a slot.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from nanovllm.common.errors import AdapterError
from nanovllm.worker.layers.linear import ParallelLinear
from nanovllm.worker.layers.lora import PartWeights
from nanovllm.worker.models.decoder import DecoderForCausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# A PEFT tensor name: base_model.model.<the base model's module>.lora_A.weight (or lora_B).
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|linear_attn|mlp)\.(?P<target>\w+)$")

# Config fields that change what the weights mean, with the value that means "not used".
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


@dataclass(eq=False)
class LoRAAdapter:
    """An adapter read and checked: each adapted projection's parts (A, B with the scale folded into B),
    keyed by (layer index, the model's projection name, e.g. "self_attn.qkv_proj")."""

    name: str
    path: str
    rank: int
    scale: float
    digest: str  # of its two files: what the prefix cache keys this adapter's blocks by
    weights: dict[tuple[int, str], dict[object, PartWeights]]

    @property
    def cache_salt(self) -> int:
        """Where this adapter's prefix-cache hash chains start, so its blocks never serve another."""
        return int.from_bytes(hashlib.blake2b(self.digest.encode(), digest_size=8).digest(), "little")


def read_adapter(name: str, path: str | Path, model: DecoderForCausalLM, max_rank: int) -> LoRAAdapter:
    """The adapter in directory `path` for `model`, its tensors on the model's device and dtype."""
    directory = Path(path)
    config = _read_config(directory)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{directory / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r} has rank r={rank}, above this engine's max_lora_rank={max_rank}"
        )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{directory / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a regular expression over module names)
        for target in targets:
            if target not in model.lora_targets:
                raise _unknown_target(name, target, model)
    tensors, digest = _read_tensors(directory)
    weights = _fit(name, tensors, model, rank, scale)
    return LoRAAdapter(name, str(directory), rank, scale, digest, weights)


def _read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type {config['peft_type']!r} is not supported, only LORA")
    for field, unused in _UNSUPPORTED.items():
        value = config.get(field, unused)
        if value != unused and value not in (None, [], {}):
            raise AdapterError(f"{config_path}: {field}={value!r} is not supported (LoRA on the "
                               "projections' weights only)")  # fmt: skip
    return config


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE} (PEFT's safetensors weights)")
    digest = hashlib.sha256()
    for part in (directory / CONFIG_FILE, weights_path):
        digest.update(part.read_bytes())
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {exc}") from None
    if not tensors:
        raise AdapterError(f"{weights_path} holds no tensors")
    return tensors, digest.hexdigest()


def _fit(
    name: str, tensors: dict[str, torch.Tensor], model: DecoderForCausalLM, rank: int, scale: float
) -> dict[tuple[int, str], dict[object, PartWeights]]:
    """Each tensor checked against the projection it adapts, and paired with its other half."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        module = _LAYER_MODULE.match(match["module"]) if match else None
        if match is None or module is None:
            target = key.split(".lora_")[0].rsplit(".", 1)[-1] if ".lora_" in key else key
            raise _unknown_target(name, target, model, key)
        layer, target = int(module["layer"]), module["target"]
        if target not in model.lora_targets:
            raise _unknown_target(name, target, model, key)
        if layer >= len(model.model.layers):
            raise AdapterError(
                f"adapter {name!r}: {key} adapts layer {layer}, but the model has {len(model.model.layers)} layers"
            )
        halves.setdefault((layer, target), {})[match["which"]] = tensor
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    weights: dict[tuple[int, str], dict[object, PartWeights]] = {}
    for (layer, target), pair in sorted(halves.items()):
        where = f"model.layers.{layer}.{target}"
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"adapter {name!r}: {where} has no lora_{missing}.weight")
        projection_name, shard = model.lora_targets[target]
        try:
            projection = model.model.layers[layer].get_submodule(projection_name)
        except AttributeError:  # a hybrid's layer is attention or linear attention, not both
            projection = None
        if not isinstance(projection, ParallelLinear) or projection.lora is None:
            raise AdapterError(
                f"adapter {name!r}: {where} is not a projection this model adapts (an MoE layer's, or one this "
                "layer does not have?)"
            )
        whole_in, whole_out = projection.lora_whole(shard)
        a, b = pair["A"], pair["B"]
        expected_a, expected_b = (rank, whole_in), (whole_out, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise AdapterError(
                f"adapter {name!r} does not fit this model: {where} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, the model needs {expected_a} and {expected_b} at rank {rank} (an adapter "
                "for another base model?)"
            )
        a, b = projection.lora_shard(shard, a, b)  # this tensor-parallel rank's share
        parts = weights.setdefault((layer, projection_name), {})
        parts[shard] = (a.to(device, dtype), (b.float() * scale).to(device, dtype))
    return weights


def _unknown_target(
    name: str, target: str, model: DecoderForCausalLM, key: str | None = None
) -> AdapterError:
    where = f" (tensor {key})" if key is not None and key != target else ""
    supported = ", ".join(model.lora_targets)
    return AdapterError(f"adapter {name!r}: unknown target module {target!r}{where}; supported: {supported}")
