"""What a model runner builds once and holds for its life: placement and threads, the weights (and a
draft model's) with their quantization plan, the sampler, the activation peak measured on a GPU, the KV
cache, the kernels bound to each layer, and the CUDA graphs of decode steps. The per-step work is
ModelRunner's (worker/runner/model_runner.py)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import cast

import psutil
import torch

from nanovllm.common.errors import ConfigError
from nanovllm.common.logging import get_logger
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.kernels.backends import (
    CpuKernelAttention,
    TritonAttention,
    select_attention_backend,
    triton_unavailable,
)
from nanovllm.kernels.fla_gated_delta import fla_unavailable, gated_delta_prompts_, warm_up
from nanovllm.kernels.fp8_kv import KV_CACHE_DTYPES, is_fp8
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.device import resolve_placement, usable_cpus
from nanovllm.worker.layers.block_fp8 import BlockFp8Weight
from nanovllm.worker.layers.kernels import GatedDeltaPrompts, LayerKernels
from nanovllm.worker.layers.linear import interleave_packed_weights
from nanovllm.worker.layers.lora import LoRAContext
from nanovllm.worker.layers.moe import SparseMoeBlock
from nanovllm.worker.layers.parallel import TPContext
from nanovllm.worker.layers.quantization import PackedWeight, QuantPlan, QuantScheme
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.decoder import DecoderForCausalLM
from nanovllm.worker.models.gguf.tensors import gguf_quant_plan, gguf_tensors, has_mtp_block
from nanovllm.worker.models.loader import has_tensors_under, load_safetensors, load_tensors
from nanovllm.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from nanovllm.worker.models.qwen3_5_vision import Qwen3_5ForConditionalGeneration
from nanovllm.worker.models.registry import causal_lm_class
from nanovllm.worker.runner import huge_pages
from nanovllm.worker.runner.block_table_rows import BlockTableRows
from nanovllm.worker.runner.cpu_share import CpuShare
from nanovllm.worker.runner.decode_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture
from nanovllm.worker.runner.host_memory import keep_freed_memory, return_freed_memory
from nanovllm.worker.runner.images import ImageEncoder
from nanovllm.worker.runner.inputs import InputBuilder
from nanovllm.worker.runner.kv_cache import (
    check_num_blocks,
    cpu_kv_cache_bytes,
    gpu_kv_cache_bytes,
    kv_bytes_per_block,
)
from nanovllm.worker.runner.kv_calibration import calibrate_kv_scales
from nanovllm.worker.runner.kv_disk import DiskTier, model_digest
from nanovllm.worker.runner.kv_offload import KVOffload
from nanovllm.worker.runner.lora_slots import AdapterSlots
from nanovllm.worker.runner.tensor_parallel import ShardRunner, TensorParallelGroup
from nanovllm.worker.sample.draft import DraftModel
from nanovllm.worker.sample.mtp import MtpProposer
from nanovllm.worker.sample.sampler import Sampler
from nanovllm.worker.step import SamplingRow, SeqChunk, StepInputs

log = get_logger(__name__)
# The block-FP8 projections built dequantized that the start log names (it counts them all).
FP8_DEQUANTIZED_SHOWN = 3


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunnerBase:
    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        """Rank 0 passes no `tp`: with tensor_parallel_size > 1 it starts ranks 1..N-1 itself. Those ranks
        (worker/runner/tensor_parallel.py) pass their own TPContext."""
        self.config = config
        self.tp_group: TensorParallelGroup | None = None
        self.cpu_share: CpuShare | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.kv_offload: KVOffload | None = None
        self.interleaved_weights = 0  # packed projections whose rows the CPU kernel takes interleaved
        # Packed weights meet x in its dtype, not x quantized to int8 for the CPU kernel's integer dots, and why
        # (_choose_quantized_arithmetic).
        self.exact_quantized, self.exact_quantized_reason = True, "no packed weights"
        # Before any rank starts: a device that cannot run the dtype fails here, with nothing to undo.
        self.placement = resolve_placement(config.device, config.dtype)
        if tp is None:
            log.info(
                "dtype_selected",
                dtype=self.placement.dtype_name,
                device=str(self.placement.device),
                reason=self.placement.reason,
            )
            log.info(
                "deterministic_selected",
                deterministic=config.deterministic,
                reason=config.deterministic_reason,
            )
            tp = TPContext(0, config.tensor_parallel_size, bool(config.deterministic))
            if tp.size > 1:
                runner = cast("type[ShardRunner]", type(self))  # a ModelRunner, which a rank runs
                self.tp_group = TensorParallelGroup(config, runner)
        self.tp = tp
        try:
            self._build()
        except BaseException as exc:
            try:
                # A rank that failed to build its shard is named, unless this rank's own error is a
                # configuration error: every rank meets that one, and it says what to change.
                if self.tp_group is not None and not isinstance(exc, ConfigError):
                    self.tp_group.raise_if_dead(exc)
            finally:
                self.shutdown()  # never leave the other ranks behind
            raise

    def _build(self) -> None:
        """The runner's construction, a stage a line."""
        config = self.config
        self._place()
        self._select_backend()
        self._load_weights()
        self._prepare_steps()
        if is_fp8(self.kv_cache_dtype):
            calibrate_kv_scales(
                self.model, self.inputs, self.kv_cache_dtype, config.model_config.vocab_size,
                config.max_model_len, logs=self.tp.rank == 0,
            )  # fmt: skip
        self.num_blocks = self._allocate_kv_cache()
        self.kv_offload = self._kv_offload() if config.kv_tiers else None
        self._choose_quantized_arithmetic()
        self._lay_out_weights()
        self._bind_kernels()
        if self.tp.rank == 0 and config.weight_format != "none":
            self._log_quantized_weights()
        if self._wants_cuda_graphs():
            self.use_decode_graphs(CudaGraphCapture())

    def _place(self) -> None:
        """The device (one GPU per rank), the CPU threads, the dtypes and the block size."""
        config = self.config
        self.device = self.placement.device
        if self.device.type == "cuda":
            if self.tp.size > 1:  # one GPU per rank
                index = self.tp.rank
            else:
                index = torch.cuda.current_device() if self.device.index is None else self.device.index
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self._set_cpu_threads()
            if config.keep_freed_memory:
                kept = keep_freed_memory()  # the worker did it already, before its threads started
                if self.tp.rank == 0:
                    log.info("freed_memory_kept_for_reuse" if kept else "freed_memory_returned", glibc=kept)
        self.dtype = self.placement.dtype
        self.kv_cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        # The tensors the runner keeps for its lifetime on 2 MiB pages (worker/runner/huge_pages.py).
        self.on_huge_pages = self.device.type == "cpu" and config.huge_pages and huge_pages.available()
        self.block_size = config.kvcache_block_size

    def _load_weights(self) -> None:
        """The model's weights (this rank's shard, checked to fit first), a draft model's on rank 0, the
        LoRA slots; `weights_bytes`: what they took on a GPU."""
        config = self.config
        self._check_weights_fit()
        baseline = self._cuda_allocated()
        mtp = config.speculative_method == "mtp"
        if mtp and config.gguf_file is not None:
            if not has_mtp_block(Path(config.gguf_file), config.model_config):
                raise ConfigError(
                    f"speculative_method=mtp needs the checkpoint's multi-token-prediction head, and "
                    f"{config.gguf_file} holds no block after its {config.model_config.num_hidden_layers} layers "
                    "with nextn tensors (llama.cpp's converter writes one unless told --no-mtp)"
                )
        elif mtp and not has_tensors_under(config.model, "mtp."):
            raise ConfigError(
                f"speculative_method=mtp needs the checkpoint's multi-token-prediction head, and {config.model} "
                "holds no mtp.* tensors (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, "
                "mtp.layers.0.*, mtp.norm)"
            )
        self.model = self._load_model(
            config.model_config, config.model, config.weight_format, gguf_file=config.gguf_file, mtp=mtp
        )
        # The head is the model's, split as it is; rank 0 hands each of its passes to the other ranks.
        self.mtp = (
            MtpProposer(
                cast("Qwen3_5ForCausalLM", self.model), self.block_size, config.speculative_draft_vocab,
                self.tp_group.send_head_pass if self.tp_group is not None else None,
            )
            if mtp
            else None
        )  # fmt: skip
        self.draft: DraftModel | None = None
        if (
            config.draft_model_config is not None
            and config.speculative_model is not None
            and self.tp.rank == 0
        ):
            # Whole, on rank 0 alone: it proposes between the target's steps, which the other ranks
            # run with rank 0; a small model gains nothing from a split that costs a collective per layer.
            whole = TPContext(0, 1, bool(config.deterministic))
            draft = self._load_model(
                config.draft_model_config, config.speculative_model, "none", whole, config.draft_gguf_file
            )
            self.draft = DraftModel(draft, config.draft_model_config, self.block_size)
        self.lora: LoRAContext | None = None
        self.adapter_slots: AdapterSlots | None = None
        if config.max_loras:
            with _default_dtype(self.dtype), self.device:
                self.lora = self.model.enable_lora(config.max_loras, config.max_lora_rank)
            self.adapter_slots = AdapterSlots(self.model, self.lora)
        self.weights_bytes = self._cuda_allocated() - baseline

    def _prepare_steps(self) -> None:
        """The sampler and the builder of each step's input tensors."""
        generator = torch.Generator(self.device).manual_seed(self.config.seed)
        self.sampler = Sampler(generator)
        self.block_rows = BlockTableRows(self._max_blocks_per_seq(), 2 * self.config.max_num_seqs)
        self.inputs = InputBuilder(self.block_size, self.device, self.block_rows)
        # A vision model's tower outputs, by image (worker/runner/images.py): rank 0's, which sends them.
        self.images = (
            ImageEncoder(self.model.encode_image, self.device, self.config.encoder_cache_tokens)
            if isinstance(self.model, Qwen3_5ForConditionalGeneration) and self.tp.rank == 0
            else None
        )

    def _load_model(
        self,
        cfg: ModelConfig,
        path: str,
        weight_format: str,
        tp: TPContext | None = None,
        gguf_file: str | None = None,
        mtp: bool = False,
    ) -> DecoderForCausalLM:
        """The model of `path` with its linear layers in `weight_format` (EngineConfig.weight_format), this
        rank's shard of it (or as `tp` cuts it); with `mtp`, its multi-token-prediction head too (a Qwen3.5
        model's). A model converted from `gguf_file` is read from the file in every format: its tensors as
        they ship for the gguf format, dequantized (and requantized for int8/int4) otherwise."""
        held_fp8 = (  # a block-FP8 checkpoint's bytes held for the Triton kernel where it runs, else dequantized
            cfg.quantization is not None
            and cfg.quantization.method == "fp8"
            and weight_format == "none"
            and self.config.quantization == "auto"
            and self.block_fp8_kernel
            and gguf_file is None
        )
        fp8_plan = self._block_fp8_plan(cfg) if held_fp8 else None
        plan = fp8_plan or self._quant_plan(weight_format)
        with _default_dtype(self.dtype), self.device:
            model = causal_lm_class(cfg)(cfg, tp or self.tp, plan)
            if mtp:
                cast("Qwen3_5ForCausalLM", model).enable_mtp()
        if gguf_file is not None:
            tensors = gguf_tensors(Path(gguf_file), cfg, packed=weight_format == "gguf", mtp=mtp)
            load_tensors(model, tensors, gguf_file)
            return model.eval()
        packed = held_fp8 or (cfg.quantization is not None and weight_format == cfg.quantization.method)
        reader = load_safetensors(model, path, cfg.quantization, packed)
        if reader is not None and self.tp.rank == 0:
            held = {id(m): m for m in model.modules() if isinstance(m, BlockFp8Weight)}.values()
            fp8 = (
                {}
                if fp8_plan is None
                else {
                    "fp8_layers": len(held),
                    "fp8_bytes": sum(m.nbytes for m in held),
                    # parts not cut at the blocks (worker/layers/block_fp8.py): the first few, with why
                    "fp8_dequantized": {
                        "count": len(fp8_plan.dequantized),
                        "first": dict(list(fp8_plan.dequantized.items())[:FP8_DEQUANTIZED_SHOWN]),
                    },
                }
            )
            log.info("checkpoint_quantization", source=path, **reader.summary(), **fp8)
        return model.eval()

    @staticmethod
    def _block_fp8_plan(cfg: ModelConfig) -> QuantPlan:
        """The projections a block-FP8 checkpoint's bytes are held for: those whose every part the checkpoint
        quantizes (a fused projection's parts by the model's packed_modules_mapping), but the experts, which
        the Triton path runs as one stacked float tensor per layer (kernels/triton_moe.py). Of those,
        make_weight builds dequantized (and records in the plan) any whose parts do not cut at the blocks on
        every rank."""
        shipped = cfg.quantization
        assert shipped is not None  # a block-FP8 checkpoint's
        mapping = causal_lm_class(cfg).packed_modules_mapping

        def held(prefix: str) -> bool:
            if ".experts." in prefix:
                return False
            module, _, leaf = prefix.rpartition(".")
            parts = [part for part, (fused, _) in mapping.items() if fused == leaf] or [leaf]
            return all(shipped.converts(f"{module}.{part}") for part in parts)

        return QuantPlan(block_fp8=held)

    def _quant_plan(self, weight_format: str) -> QuantPlan | None:
        if weight_format == "gguf" and self.config.gguf_file is not None:
            mapping = causal_lm_class(self.config.model_config).packed_modules_mapping
            return gguf_quant_plan(Path(self.config.gguf_file), self.config.model_config, mapping)
        # The LM head at int8 a row under either width, as GGUF files ship their output at 6-8 bits beside
        # 4-bit layers: every token reads it whole, most of a small model's bytes (docs/quantization.md).
        head, tied = QuantScheme("int8", 8, None), self.config.model_config.tie_word_embeddings
        if weight_format == "int8":
            return QuantPlan(every_linear=head, head=head, tied=tied)
        if weight_format == "int4":
            group = self.config.quantization_group_size
            return QuantPlan(every_linear=QuantScheme("int4", 4, group), head=head, tied=tied)
        shipped = self.config.model_config.quantization
        if (
            shipped is not None and weight_format == shipped.method
        ):  # an AWQ / GPTQ checkpoint's int4, as shipped
            return QuantPlan(every_linear=QuantScheme(shipped.method, 4, shipped.group_size))
        return None

    def _log_quantized_weights(self) -> None:
        """What was quantized, the weights' bytes in the model's dtype and as held, and the kernel."""
        packed = {id(m): m for m in self.model.modules() if isinstance(m, PackedWeight)}.values()
        float_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        element = self._element_size()
        log.info(
            "weights_quantized",
            format=self.config.weight_format,
            layers=len(packed),
            types=dict(Counter(m.scheme.name for m in packed)),
            weight_bytes_in_dtype=float_bytes + sum(m.shape.numel() * element for m in packed),
            weight_bytes=float_bytes + sum(m.nbytes for m in packed),
            kernel=self._quantized_kernel(),
            kernel_reason=self.exact_quantized_reason,
            rows_interleaved=self.interleaved_weights,
        )

    def _quantized_kernel(self) -> str:
        kernels = self.sampler.cpu_kernels
        if kernels is None:
            return "dequantize + F.linear"
        if self.exact_quantized:
            return "linear_quantized (C++, exact)"
        rows = "up to 64 rows" if self.dtype == torch.float32 else "up to 8 rows"
        rows = "at every row count" if self.config.deterministic else rows
        return f"linear_quantized (C++, int8 dots {rows})"

    def _wants_cuda_graphs(self) -> bool:
        """CUDA graphs for decode unless enforce_eager; not yet with tensor parallelism, whose ranks would
        each have to capture and replay in step with rank 0; not with MoE layers that read their experts'
        counts on the host."""
        if self.config.enforce_eager or self.device.type != "cuda":
            return False
        if self.tp.size > 1:
            log.info("decode_graphs_off", reason="not yet captured with tensor_parallel_size > 1")
            return False
        if any(isinstance(m, SparseMoeBlock) and not m.grouped for m in self.model.modules()):
            reason = "mixture-of-experts layers run expert by expert (packed experts, or --deterministic)"
            log.info("decode_graphs_off", reason=reason)
            return False
        return True

    def use_decode_graphs(self, capture: GraphCapture) -> None:
        """Replay decode-only steps through `capture`'s graphs from now on (worker/runner/decode_graphs.py). The
        runner calls it itself on CUDA; the CPU tests call it with EagerReplay."""
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(
                self.model,
                capture,
                max_num_seqs=self.config.max_num_seqs,
                max_blocks_per_seq=self._max_blocks_per_seq(),
                block_size=self.block_size,
                pad_block=self.pad_block,
                device=self.device,
                # Adapter steps replay too where the adapters run on the Triton kernels.
                lora=self.lora if self.kernel_backend == "triton" else None,
                pad_state_row=self.pad_state_row,
            )

    def _max_blocks_per_seq(self) -> int:
        return -(-self.config.max_model_len // self.block_size)

    def _set_cpu_threads(self) -> None:
        """A fixed num_threads is split between the ranks. By default every process that runs a model on
        these CPUs (each rank, each co-located worker) takes its share of them (worker/runner/cpu_share.py):
        more OpenMP threads than CPUs makes every op wait on the slowest thread."""
        if self.config.num_threads is None:
            self.cpu_share = CpuShare(frozenset(os.sched_getaffinity(0)), usable_cpus())
            self.cpu_share.refresh()
            return
        threads = max(1, self.config.num_threads // self.tp.size)
        torch.set_num_threads(threads)
        if self.tp.rank == 0:
            log.info("cpu_threads", threads_per_rank=threads, ranks=self.tp.size)

    def _check_weights_fit(self) -> None:
        if self.device.type != "cpu":
            return  # on CUDA the allocator's own out-of-memory error already names the sizes
        element, model, draft = self._element_size(), self.config.model_config, self.config.draft_model_config
        needed = model.num_parameters * element
        if self.config.weight_format != "none":  # the projections at a byte a weight at most
            embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
            needed = embeddings * element + (model.num_parameters - embeddings)
        needed //= self.tp.size
        if draft is not None and self.tp.rank == 0:  # whole, on rank 0 (see _build)
            needed += draft.num_parameters * element
        available = psutil.virtual_memory().available
        if needed > available:
            raise ConfigError(
                f"the model's weights need {needed / 2**30:.2f} GiB in {self.dtype} but only "
                f"{available / 2**30:.2f} GiB of RAM is available"
            )

    def _select_backend(self) -> None:
        """Choose the attention backend once, before the weights load, and whether the Triton block-FP8
        projection runs (the Triton backend, or any on CUDA where Triton works): a block-FP8 checkpoint's
        weights are held as FP8 for it, else dequantized at load."""
        deterministic = bool(self.config.deterministic)  # bool | None only until EngineConfig resolves it
        self.backend_choice = select_attention_backend(
            self.config.attention_backend, self.device, self.dtype, self.block_size, deterministic,
            self.kv_cache_dtype,
        )  # fmt: skip
        self.kernel_backend = self.backend_choice.backend.name  # reported by the bench and logs
        self.block_fp8_kernel = self.kernel_backend == "triton" or (
            self.device.type == "cuda" and triton_unavailable(self.device) is None
        )
        if self.tp.rank == 0:
            log.info(
                "attention_backend_selected", backend=self.kernel_backend, reason=self.backend_choice.reason
            )

    def _choose_quantized_arithmetic(self) -> None:
        """Whether packed weights take the C++ kernel's integer dots, each row of x rounded to int8 in blocks
        of 32 (its scale the block's max |x| / 127), where the rounding adds little to the error already there:
        16-bit x's own rounding is of that size, and 4-bit weights' rounding about 16 times it (a group of 32
        Gaussian weights spans ~4 sigma in 15 steps, x's block ~2.2 sigma in 254). Float32 x with 8-bit
        weights only stays exact: per-channel int8 rounds each weight by about what the dots would round x by,
        so they would double the error (seen: random Qwen3-MoE and Qwen3.5 breaking the top-5 rule). A model
        whose projections are 4-bit takes the dots for its 8-bit weights too (the int8 head of
        --quantization int4, a GGUF's Q8_0 embedding): their rounding is small beside the layers'."""
        cpu = self.backend_choice.backend
        kernels = cpu.kernels if isinstance(cpu, CpuKernelAttention) else None
        models = [self.model] if self.draft is None else [self.model, self.draft.model]
        bits = {m.bits for model in models for m in model.modules() if isinstance(m, PackedWeight)}
        if not bits:
            return
        if self.config.exact_quantized_matmuls:
            choice = True, "asked for (--exact-quantized-matmuls)"
        elif kernels is None or not kernels.linear_quantized_int8_dots():
            choice = True, "the CPU kernels have no integer dots here (neither AVX2 nor AVX512-VNNI)"
        elif self.dtype != torch.float32:
            choice = False, "16-bit x: x's int8 rounding in blocks of 32 is about its own"
        elif 4 in bits:
            choice = (
                False,
                "4-bit weights: their rounding is about 16 times x's int8 rounding in blocks of 32",
            )
        else:
            choice = True, "float32 x and 8-bit weights: x's int8 rounding would about double their error"
        self.exact_quantized, self.exact_quantized_reason = choice

    def _lay_out_weights(self) -> None:
        """The weights as the kernels read them, before the kernels bind them: packed weights interleaved
        for the C++ kernel's integer dots with AVX512-VNNI; on a CPU, every weight moved onto huge pages
        (worker/runner/huge_pages.py)."""
        backend = self.backend_choice.backend
        cpu = backend.kernels if isinstance(backend, CpuKernelAttention) else None
        models = [self.model] if self.draft is None else [self.model, self.draft.model]
        if cpu is not None and not self.exact_quantized and cpu.linear_quantized_interleaved():
            self.interleaved_weights = sum(interleave_packed_weights(model) for model in models)
        if self.on_huge_pages:
            moved = sum(huge_pages.move_weights(model) for model in models)
            if moved:
                return_freed_memory()  # the weights' old memory: no step reuses that much
            if self.tp.rank == 0:
                log.info("weights_on_huge_pages", mib=round(moved / 2**20, 1))

    def _bind_kernels(self) -> None:
        """Bind the kernels chosen: the attention backend, and with the C++ attention the other layers' C++
        variants, with Triton's its fused layer kernels (worker/layers/kernels.py)."""
        deterministic = bool(self.config.deterministic)
        choice = self.backend_choice
        cpu = choice.backend.kernels if isinstance(choice.backend, CpuKernelAttention) else None
        fused: ModuleType | None = None
        block_fp8: ModuleType | None = None
        gated_delta: ModuleType | None = cpu
        if self.block_fp8_kernel:  # Triton is imported only where it runs
            from nanovllm.kernels import triton_block_fp8 as block_fp8
        prompts: GatedDeltaPrompts | None = None
        if isinstance(choice.backend, TritonAttention):
            from nanovllm.kernels import triton_gated_delta as gated_delta
            from nanovllm.kernels import triton_layers as fused

            if self.model.is_hybrid:
                prompts = self._prompt_kernel(deterministic)
        kernels = LayerKernels(
            cpu=cpu, triton=fused, block_fp8=block_fp8, deterministic=deterministic,
            exact_quantized=self.exact_quantized, gated_delta=gated_delta, gated_delta_prompts=prompts,
        )  # fmt: skip
        self.model.bind_kernels(choice.backend, kernels)
        self.sampler.cpu_kernels = cpu
        if self.mtp is not None:
            self.mtp.cpu_kernels = cpu
        if self.draft is not None:
            self.draft.model.bind_kernels(choice.backend, kernels)
            self.draft.cpu_kernels = cpu

    def _prompt_kernel(self, deterministic: bool) -> GatedDeltaPrompts | None:
        """fla-core's chunked kernels for a hybrid model's prompts on the Triton path, where they run and the
        arithmetic allows (kernels/fla_gated_delta.py says why and when); None: prompts walk their tokens."""
        if deterministic:
            reason: str | None = "--deterministic walks a prompt's tokens as its decode steps do"
        elif self.dtype == torch.float32:
            reason = "float32 keeps the exact walk (fla-core's matmuls take TF32)"
        else:
            reason = fla_unavailable(self.device)
        if self.tp.rank == 0:
            log.info("linear_attention_prompts", kernel="walk" if reason else "fla-core", reason=reason)
        if reason is not None or not isinstance(self.model, Qwen3_5ForCausalLM):
            return None
        layer = self.model.linear_attention_layers()[0]
        warm_up(layer.num_key_heads, layer.num_heads, layer.key_dim, layer.value_dim, self.dtype, self.device)
        return gated_delta_prompts_

    def _cuda_allocated(self) -> int:
        """Bytes this process holds on the GPU through torch (0 on CPU): differences of it are this
        engine's own, whatever other engines or processes hold on the same GPU."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _kv_cache_bytes(self) -> int:
        """This rank's KV cache budget (worker/runner/kv_cache.py), from the weights and activation peak
        measured here on a GPU, or from the available RAM."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            peak = self._activation_peak()
            return gpu_kv_cache_bytes(self.config, str(self.device), total, self.weights_bytes, peak)
        return cpu_kv_cache_bytes(self.config, psutil.virtual_memory().available, self.tp.size)

    def _activation_peak(self) -> int:
        """GPU bytes the largest step needs beyond the weights, measured by running it before the KV cache
        exists. Every tensor-parallel rank runs it at once (the forward's collectives pair up)."""
        torch.cuda.synchronize(self.device)
        before = self._cuda_allocated()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._run_largest_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _run_largest_step(self) -> None:
        """The step that needs the most activation memory, on dummy tokens: a prompt batch of
        max_num_batched_tokens, logits for max_num_seqs rows and the sampler's heaviest path (top-k/top-p
        sorts and logprobs). Only valid while the attention layers have no KV cache (nothing is stored)."""
        config = self.config
        num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
        lengths = [config.max_model_len] * (num_tokens // config.max_model_len)
        lengths += [num_tokens % config.max_model_len] if num_tokens % config.max_model_len else []
        num_rows = min(config.max_num_seqs, num_tokens)
        inputs = StepInputs(
            input_ids=[0] * num_tokens,
            positions=[p for n in lengths for p in range(n)],
            slot_mapping=[],
            decodes=[],
            fresh=[SeqChunk(0, n, []) for n in lengths],
            cached=[],
            logits_index=list(range(num_rows)),
        )
        input_ids, positions, meta, logits_index = self.inputs.tensors(inputs)
        hidden = self.model(input_ids, positions, meta)
        if self.model.lm_head is None:  # a base model (embeddings only): no logits, no sampler
            return
        logits = self.model.compute_logits(hidden.index_select(0, logits_index)).float()
        del hidden
        heaviest = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=SamplingParams.MAX_LOGPROBS)
        self.sampler(logits, [SamplingRow(heaviest, [0], [])] * num_rows)

    def _allocate_states(self, budget: int) -> int:
        """A hybrid model's state rows, taken from the KV cache's budget: a slot for each request that may
        run (max_num_seqs, or as many as state_memory_fraction of the budget holds), with speculation
        num_speculative_tokens rows more per slot (the state after each verified position, which a
        rejection rolls back to), then, with the prefix cache, snapshot rows (state_cache_fraction of what is
        left) that hits resume from (worker/core/recurrent_states.py); each linear-attention layer's share
        bound to it. Returns the bytes they took."""
        config = self.config
        self.num_state_slots = self.num_state_snapshots = 0
        self.state_rows_per_slot = 1  # a slot and its speculation rows
        self.state_row_bytes = 0  # one row's, this rank's share
        self.pad_state_row: int | None = None
        if not self.model.is_hybrid:
            return 0
        # A hybrid class declares its state and lists the layers that keep it (Qwen3.5's, the one so far).
        model = cast("Qwen3_5ForCausalLM", self.model)
        layout = model.state_layout(config.model_config, self.tp.size)
        per_slot = layout.bytes_per_slot(self._element_size())
        if config.speculative_method != "none":
            self.state_rows_per_slot += config.num_speculative_tokens
        share = int(budget * config.state_memory_fraction)
        slots = self.tp.all_reduce_min(
            min(config.max_num_seqs, share // (per_slot * self.state_rows_per_slot))
        )
        if slots < 1:
            raise ConfigError(
                f"one request's linear-attention state needs {per_slot * self.state_rows_per_slot / 2**20:.2f} "
                f"MiB ({self.state_rows_per_slot} rows with speculation), more than "
                f"state_memory_fraction={config.state_memory_fraction} of this rank's KV cache budget of "
                f"{budget / 2**20:.1f} MiB allows; raise kv_cache_memory or state_memory_fraction"
            )
        self.num_state_slots, self.state_row_bytes = slots, per_slot
        if config.enable_prefix_caching:
            left = budget - (slots * self.state_rows_per_slot + 1) * per_slot  # the slots' rows, the pad row
            self.num_state_snapshots = self.tp.all_reduce_min(
                max(0, int(left * config.state_cache_fraction)) // per_slot
            )
        # The slots, the snapshot rows (worker/core/recurrent_states.py numbers them after the slots), the
        # speculation rows, and one row more, which a replayed decode graph's padding rows run on.
        rows = slots * self.state_rows_per_slot + self.num_state_snapshots + 1
        self.pad_state_row = rows - 1
        for layer in model.linear_attention_layers():
            layer.conv_state = self._zeros((rows, *layout.conv), self.dtype)
            layer.recurrent_state = self._zeros((rows, *layout.recurrent), layout.recurrent_dtype)
        if self.tp.rank == 0:
            log.info(
                "state_slots_allocated",
                slots=slots,
                max_num_seqs=config.max_num_seqs,
                snapshots=self.num_state_snapshots,
                speculation_rows=slots * (self.state_rows_per_slot - 1),
                mib_per_slot=round(per_slot / 2**20, 3),
                gib=round(rows * per_slot / 2**30, 3),
            )
        return rows * per_slot

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor the runner keeps for its lifetime (the KV cache, the states): on a CPU on huge pages."""
        if self.on_huge_pages:
            return huge_pages.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _allocate_kv_cache(self) -> int:
        cfg = self.config.model_config
        kv_heads = self.tp.kv_heads(cfg.num_key_value_heads)[1]
        per_block = kv_bytes_per_block(cfg, self.block_size, kv_heads, self.kv_cache_dtype.itemsize)
        if self.mtp is not None:  # the head's one layer keeps its KV of a block's tokens in its own cache
            layer_kv = kv_bytes_per_block(cfg, self.block_size, kv_heads, self._element_size())
            per_block += layer_kv // cfg.num_attention_layers
        if self.draft is not None:  # the draft's KV of a block's tokens lives in a block of its own cache
            # (in the model's dtype: a draft's KV is small, and it keeps speculation's proposals unchanged)
            draft = self.draft.config
            per_block += kv_bytes_per_block(
                draft, self.block_size, draft.num_key_value_heads, self._element_size()
            )
        # Every rank must hold the same blocks: the scheduler on rank 0 hands out block ids for all.
        budget = self._kv_cache_bytes()
        budget -= self._allocate_states(budget)
        num_blocks = self.tp.all_reduce_min(budget // per_block)
        check_num_blocks(self.config, num_blocks, per_block)
        # One block more than the scheduler hands out: the pad block, which padded rows of a replayed decode
        # step write to (worker/runner/decode_graphs.py).
        self.pad_block = num_blocks
        shape = (2, cfg.num_attention_layers, num_blocks + 1, self.block_size, kv_heads, cfg.head_dim)
        self.kv_cache = self._zeros(shape, self.kv_cache_dtype)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if self.draft is not None:
            self.draft.allocate_cache(num_blocks + 1, self.dtype, self.device)
        if self.mtp is not None:
            self.mtp.allocate_cache(num_blocks + 1, self.dtype, self.device)
        log.info(
            "kv_cache_allocated",
            kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            num_blocks=num_blocks,
            block_size=self.block_size,
            tokens=num_blocks * self.block_size,
            gib=round(num_blocks * per_block / 2**30, 3),
        )
        return num_blocks

    def _kv_offload(self) -> KVOffload:
        """The copies to and from the prefix cache's host and disk tiers (worker/runner/kv_offload.py),
        sized by their flags, which count the worker's bytes: each rank holds its share of every block in
        the same number of slots, and its share of the disk's bytes in a directory of its own. A hybrid
        model's state snapshots go down with their blocks: state_cache_fraction of the host memory holds
        them (as of the device's budget), each rank its share of every row."""
        config = self.config
        block = self.kv_cache[:, :, 0]
        block_nbytes = block.numel() * block.element_size()
        states = self._state_tensors() if self.num_state_snapshots else []
        state_nbytes = sum(t[0].numel() * t.element_size() for t in states)
        host_blocks = host_state_rows = 0
        if config.kv_host_memory is not None:
            available = psutil.virtual_memory().available
            assert config.kv_host_size is not None  # read from kv_host_memory
            # A fraction of free RAM is read on each rank while the others allocate theirs: the least wins.
            host_bytes = self.tp.all_reduce_min(config.kv_host_size.of(available) // self.tp.size)
            if state_nbytes:
                host_state_rows = int(host_bytes * config.state_cache_fraction) // state_nbytes
            host_blocks = (host_bytes - host_state_rows * state_nbytes) // block_nbytes
        disk = None
        if config.kv_disk_path is not None:
            capacity = config.kv_disk_capacity // self.tp.size
            digest = model_digest(
                config, tuple(block.shape), self.dtype, self.device, self.tp, self._kv_scales(),
                [(tuple(t.shape[1:]), t.dtype) for t in states],
            )  # fmt: skip
            disk = DiskTier(config.kv_disk_path, capacity, digest, block_nbytes, state_nbytes)
        if self.tp.rank == 0:
            log.info(
                "kv_tiers",
                host_blocks=host_blocks,
                host_state_rows=host_state_rows,
                disk_bytes=disk.capacity if disk is not None and disk.writable else 0,
                disk_path=config.kv_disk_path,
            )
        return KVOffload(self.kv_cache, host_blocks, disk, states, host_state_rows)

    def _state_tensors(self) -> list[torch.Tensor]:
        """A hybrid model's state tensors, indexed by row first: each linear-attention layer's convolution
        and recurrent state, in that order (a snapshot's order in a disk file)."""
        model = cast("Qwen3_5ForCausalLM", self.model)
        return [
            t for layer in model.linear_attention_layers() for t in (layer.conv_state, layer.recurrent_state)
        ]

    def _kv_scales(self) -> list[float]:
        """Every layer's FP8 scales in one list (empty for a cache in the model's dtype)."""
        return [
            float(x)
            for attn in self.model.attention_layers()
            if attn.kv_scales is not None
            for x in torch.cat([attn.kv_scales.key, attn.kv_scales.value]).tolist()
        ]

    def _element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (joined, never orphaned) and leave the CPU share."""
        if self.tp_group is not None:
            self.tp_group.shutdown()
            self.tp_group = None
        if self.cpu_share is not None:
            self.cpu_share.close()
            self.cpu_share = None
        if self.kv_offload is not None:
            self.kv_offload.close()
