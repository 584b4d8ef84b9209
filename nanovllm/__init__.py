"""nanovllm: a compact LLM serving engine. The offline API mirrors nano-vllm's."""

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.llm import LLM

__all__ = ["LLM", "SamplingParams"]
