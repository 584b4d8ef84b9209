"""An FP8 KV cache's scales (kernels/fp8_kv.py), per attention layer and KV head, set once as the runner is
built, before the cache exists: an FP8 checkpoint's own (`k_scale`, `v_scale` in every attention layer),
rounded up to powers of two; otherwise from the largest |K| and |V| of a fixed pseudo-random prompt run
through the model (nothing is stored, and every layer sees the K/V in the model's dtype). The same weights
and kernels give every worker and every start the same scales, which exact failover and the disk tier's
files need; every tensor-parallel rank calibrates its own heads, all together (the forward's collectives
pair up)."""

from __future__ import annotations

import torch

from nanovllm.common.logging import get_logger
from nanovllm.kernels.fp8_kv import KVScales, from_checkpoint, scale_for
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.runner.inputs import InputBuilder
from nanovllm.worker.step import SeqChunk, StepInputs

# The calibration prompt: long enough for every position's RoPE phase mix and the first tokens' large
# activations to show, short enough to cost a fraction of a second.
KV_CALIBRATION_TOKENS = 256

log = get_logger(__name__)


@torch.inference_mode()
def calibrate_kv_scales(
    model: DecoderForCausalLM,
    inputs: InputBuilder,
    kv_cache_dtype: torch.dtype,
    vocab_size: int,
    max_model_len: int,
    logs: bool,
) -> None:
    """Set every attention layer's `kv_scales` for a cache of `kv_cache_dtype`; `logs`: this rank reports
    them (rank 0)."""
    device = inputs.device
    layers = model.attention_layers()
    if all(len(attn.checkpoint_scales) == 2 for attn in layers):  # an FP8 checkpoint's own
        for attn in layers:
            key, value = (
                from_checkpoint(attn.checkpoint_scales[kind], attn.num_kv_heads).to(device)
                for kind in ("key", "value")
            )
            attn.kv_scales = KVScales(key, value)
        if logs:
            log.info("kv_scales_from_checkpoint", kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."))
        return
    n = min(KV_CALIBRATION_TOKENS, max_model_len)
    ids = torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    for attn in layers:
        attn.kv_amax = torch.zeros(2, attn.num_kv_heads, device=device)
    prompt = StepInputs(
        input_ids=ids,
        positions=list(range(n)),
        slot_mapping=[],
        decodes=[],
        fresh=[SeqChunk(0, n, [])],
        cached=[],
        logits_index=[n - 1],
    )
    input_ids, positions, meta, _ = inputs.tensors(prompt)
    model(input_ids, positions, meta)
    for attn in layers:
        amax, attn.kv_amax = attn.kv_amax, None
        assert amax is not None  # recorded by the forward pass above
        attn.kv_scales = KVScales(scale_for(amax[0], kv_cache_dtype), scale_for(amax[1], kv_cache_dtype))
    if logs:
        every = [a.kv_scales for a in layers if a.kv_scales is not None]  # every layer's, just set
        scales = torch.stack([torch.stack([s.key, s.value]) for s in every])
        log.info(
            "kv_scales_calibrated",
            kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
            tokens=n,
            log2_scale_min=int(scales.log2().min()),
            log2_scale_max=int(scales.log2().max()),
        )
