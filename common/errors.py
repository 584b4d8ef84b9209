"""Exceptions the engine raises on purpose, each carrying a message that names the numbers."""


class NanoVLLMError(Exception):
    """Base class for errors raised deliberately by nanovllm."""


class ConfigError(NanoVLLMError, ValueError):
    """The engine configuration or the model cannot work as given (e.g. KV cache too small)."""


class RequestError(NanoVLLMError, ValueError):
    """A request is invalid for this engine (e.g. prompt longer than max_model_len)."""


class InvalidStateTransition(NanoVLLMError, RuntimeError):
    """A sequence was asked to move between states that are not connected; always a bug."""


class UnsupportedModelError(NanoVLLMError, ValueError):
    """The checkpoint's architecture or layout is not one nanovllm implements."""


class EngineDeadError(NanoVLLMError, RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel rank died); its process should fail and exit."""


class AdapterError(NanoVLLMError, ValueError):
    """A LoRA adapter cannot be loaded (a missing or malformed file, a shape the model does not have, ...)."""


class DuplicateAdapterError(AdapterError):
    """A LoRA adapter is loaded under a name another one already has."""


class UnknownAdapterError(RequestError):
    """A request names a LoRA adapter this engine does not hold."""
