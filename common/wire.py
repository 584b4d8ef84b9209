"""Engine sampling options on the router-worker link (nanovllm.worker.v1), in both directions.

The router validates a client's options into SamplingParams and sends every field; the worker rebuilds
SamplingParams from the message, so both ends validate with the same code.
"""

from __future__ import annotations

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.v1 import worker_pb2


def sampling_to_wire(params: SamplingParams) -> worker_pb2.SamplingParams:
    msg = worker_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_from_wire(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field when a value is out of range."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )
