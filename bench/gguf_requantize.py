"""A GGUF file with its quantized tensors in another type, as llama.cpp's `llama-quantize` makes one: the
embedded SmolLM2 ships Q4_1 only, and the benchmarks also want its Q4_0 and Q8_0 forms (the same trained
weights, so the same tokens to decode). Each quantized tensor is dequantized with gguf-py and quantized
again; float tensors (norms) and the metadata are copied as they are.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

DEFAULT_CACHE = Path.home() / ".cache" / "nanovllm" / "bench-gguf"
_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}


def requantized_gguf(source: Path, qtype: str, cache: Path = DEFAULT_CACHE) -> Path:
    """`source` with every quantized tensor in `qtype` (Q4_0, Q4_1, Q8_0, ...), written once to `cache`."""
    target = cache / f"{source.stem}.{qtype}.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        # the writer writes the header fields and the architecture itself
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    new_type = gguf.GGMLQuantizationType[qtype]
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if tensor.tensor_type in _FLOAT_TYPES:
            writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(shape))
            continue
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        data = gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), new_type)
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=new_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target
