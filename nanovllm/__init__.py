"""nanovllm: a compact LLM serving engine. The offline API mirrors nano-vllm's.

`LLM` is imported on first use so that processes that never run the engine (the router, the client)
do not pay for importing torch.
"""

from typing import TYPE_CHECKING, Any

from nanovllm.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.worker.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from nanovllm.worker.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
