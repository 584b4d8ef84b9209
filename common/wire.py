"""Messages filled by walking fields of the same name: engine sampling options on the router-worker link,
in both directions, and reports built from another record (a worker's load, the public model info); and
a resized image's form on the link (its pixels: the worker hashes them itself).

The link's message (nanovllm.worker.v1.SamplingParams) has one field per SamplingParams field, of the same
name, so the conversion walks the dataclass's fields: a field added to one side and not the other fails
here (and in tests/test_protos.py), never silently. The router validates a client's options into
SamplingParams and sends every field; the worker rebuilds SamplingParams from the message, so both ends
validate with the same code. Fields that may be None (seed, logprobs) are proto3 `optional`; the
structured-output constraints are one `oneof`, its unset members None (or False), `choice` a Choice message.
"""

from __future__ import annotations

import array
import dataclasses
import sys
from collections.abc import Iterable
from typing import Any, TypeVar, cast

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from nanovllm.common.errors import RequestError
from nanovllm.common.images import ResizedImage
from nanovllm.common.pooling import PoolingKind, PoolingParams
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.v1 import worker_pb2

M = TypeVar("M", bound=Message)


def sampling_to_wire(params: SamplingParams, message_type: type[M]) -> M:
    message = message_type()
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        field = message.DESCRIPTOR.fields_by_name[f.name]
        if _in_constraint(field) and (value is None or value is False):
            continue  # setting a oneof member, even to False, would select it
        if f.name == "choice":
            message.choice.choices.extend(value)
        elif isinstance(value, list):
            getattr(message, f.name).extend(value)
        elif value is not None:  # None leaves an optional field unset
            setattr(message, f.name, value)
    return message


def sampling_from_wire(message: Message) -> SamplingParams:
    """Raises ValueError naming the field when a value is out of range."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        field = message.DESCRIPTOR.fields_by_name[f.name]
        if _in_constraint(field) and not message.HasField(f.name):
            values[f.name] = False if field.type == field.TYPE_BOOL else None
        elif field.has_presence and not message.HasField(f.name):
            values[f.name] = None
        elif f.name == "choice":
            values[f.name] = list(message.choice.choices)
        else:
            value = getattr(message, f.name)
            values[f.name] = list(value) if field.is_repeated else value
    return SamplingParams(**values)


def _in_constraint(field: FieldDescriptor) -> bool:
    """A member of the structured-output oneof (proto3 `optional` fields sit in oneofs of their own)."""
    return field.containing_oneof is not None and field.containing_oneof.name == "constraint"


def fields_to_message(source: object, message_type: type[M], **extra: object) -> M:
    """A `message_type` whose every field takes the value of `source`'s attribute of the same name (a
    dataclass or another message), or of `extra` for fields `source` does not have. A field neither gives
    is an error here, so a field added to the message is never silently left at zero."""
    values = {}
    for name in message_type.DESCRIPTOR.fields_by_name:
        if name in extra:
            values[name] = extra[name]
        elif hasattr(source, name):
            values[name] = getattr(source, name)
        else:
            raise TypeError(f"{type(source).__name__} has no {name} for {message_type.__name__}")
    return message_type(**values)


def image_to_wire(image: ResizedImage, message_type: type[M]) -> M:
    """The link's Image: height, width and the RGB bytes (numpy, imported here: common/images.py says why)."""
    import numpy as np

    height, width, _ = image.rgb.shape
    return message_type(height=height, width=width, rgb=np.ascontiguousarray(image.rgb).tobytes())


def image_from_wire(message: Any, index: int) -> ResizedImage:
    """A link Image (`index`: its place in the request, for the error) as a ResizedImage, hashed here."""
    height, width, size = message.height, message.width, len(message.rgb)
    if size != height * width * 3:
        raise RequestError(
            f"images[{index}]: {size} bytes for {width}x{height} RGB pixels ({height * width * 3})"
        )
    import numpy as np

    return ResizedImage.of(np.frombuffer(message.rgb, np.uint8).reshape(height, width, 3))


def pooling_to_wire(params: PoolingParams) -> worker_pb2.Pooling:
    kind = worker_pb2.PoolingKind.Value(f"POOLING_KIND_{params.kind.upper()}")
    return worker_pb2.Pooling(kind=kind, token_ids=params.token_ids)


def pooling_from_wire(message: worker_pb2.Pooling) -> PoolingParams:
    """The link's Pooling as PoolingParams; an unset kind is refused by name (RequestError)."""
    if message.kind == worker_pb2.POOLING_KIND_UNSPECIFIED:
        raise RequestError("Submit.pooling.kind is unset: POOLING_KIND_EMBED or POOLING_KIND_SCORE")
    name = worker_pb2.PoolingKind.Name(message.kind).removeprefix("POOLING_KIND_").lower()
    return PoolingParams(cast(PoolingKind, name), tuple(message.token_ids))


def floats_to_bytes(values: Iterable[float]) -> bytes:
    """float32 values as little-endian bytes (RequestUpdate.pooled)."""
    packed = array.array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def floats_from_bytes(data: bytes) -> list[float]:
    """RequestUpdate.pooled's float32 values."""
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes are not whole float32 values")
    packed = array.array("f", data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()
