"""Offline API, call-compatible with nano-vllm: `LLM(path, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
import weakref
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from nanovllm.common.errors import ConfigError, RequestError
from nanovllm.common.images import ImagePatches, ImageProcessorConfig, expand_placeholders, patchify
from nanovllm.common.pooling import (
    RERANK_FORMAT,
    RERANK_INSTRUCTION,
    RERANK_TOKENS,
    PoolingParams,
    normalized,
    relevance,
)
from nanovllm.common.sampling_params import SamplingParams
from nanovllm.worker.config import EngineConfig
from nanovllm.worker.core.engine import LLMEngine
from nanovllm.worker.models.gguf.cache import resolve_model
from nanovllm.worker.sample.structured_output import GRAMMAR_WAIT_S, compile_timeout_message

# A prompt: text, token ids, or a dict with images (LLM.generate).
Prompt = str | list[int] | dict[str, Any]


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The checkpoint's Hugging Face tokenizer, or None when the directory ships none."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig) if f.init} - {
            "model",
            "gguf_file",
            "draft_gguf_file",
            "model_config",
            "draft_model_config",
        }
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown LLM arguments {unknown}; accepted: {sorted(known)}")
        model_dir, gguf_file = resolve_model(model)
        if kwargs.get("speculative_model"):
            kwargs["speculative_model"], kwargs["draft_gguf_file"] = resolve_model(
                kwargs["speculative_model"]
            )
        self.config = EngineConfig(model=model_dir, gguf_file=gguf_file, **kwargs)
        self.engine = LLMEngine(self.config)
        # Tensor-parallel ranks stop when this LLM is collected or the interpreter exits, if not before.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self.tokenizer = load_tokenizer(model_dir)
        self._image_processor: ImageProcessorConfig | None = None  # a vision model's, read at its first image
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks now (with tensor_parallel_size > 1); the LLM is unusable after."""
        self._finalizer()

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter in directory `path`; `generate(..., lora_name=name)` runs with it."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def generate(
        self,
        prompts: Prompt | list[Prompt] | list[int],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priorities: list[int] | None = None,
        lora_name: str | list[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Generate for every prompt; outputs come back in prompt order as nano-vllm's dicts
        ({"text", "token_ids"}) plus finish_reason, logprobs, prompt/cached token counts, and
        prompt_logprobs where SamplingParams.prompt_logprobs asks for them. `lora_name`:
        the LoRA adapter (loaded by `lora_adapters` or `add_lora`) of every prompt, or of each (None: the
        base model).

        A prompt is a string, token ids, or (a vision model's, as vLLM takes them) a dict of "prompt" (a
        string) or "prompt_token_ids", and "multi_modal_data": {"image": a PIL image or a list of them},
        where the prompt holds one image placeholder token (`<|image_pad|>`) per image, in order: each is
        expanded to the image's token count."""
        one = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
        batch = cast("list[Prompt]", [prompts] if one else prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(batch)} prompts; give one or one each"
            )
        if not isinstance(lora_name, list):
            lora_name = [lora_name] * len(batch)
        if len(lora_name) != len(batch):
            raise ValueError(f"got {len(lora_name)} lora_name for {len(batch)} prompts; give one or one each")
        # Constraints compile before anything is queued, so one that does not compile raises here.
        for constraint in {p.constraint for p in sampling_params if p.constraint is not None}:
            self._compile(constraint)
        ids = []
        for i, (prompt, params) in enumerate(zip(batch, sampling_params)):
            request_id = str(next(self._request_ids))
            priority = priorities[i] if priorities else 0
            token_ids, images = self._prompt_inputs(prompt)
            self.engine.add_request(
                request_id, token_ids, params, priority, lora_name=lora_name[i], images=images
            )
            ids.append(request_id)
        results = self._run(len(ids), use_tqdm)
        return [self._to_dict(results[request_id]) for request_id in ids]

    def embed(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        dimensions: int | None = None,
        use_tqdm: bool = True,
        lora_name: str | None = None,
    ) -> list[dict[str, Any]]:
        """Embed each prompt (text or token ids), as vLLM's `LLM.embed`: the last token's final hidden
        state, its first `dimensions` values (all with None) scaled to unit length. Outputs in prompt order:
        {"embedding", "num_prompt_tokens", "num_cached_tokens"}. Texts are embedded as given: an embedding
        model's query instruction is the caller's (common/pooling.py EMBED_QUERY_FORMAT)."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = cast("list[str | list[int]]", [prompts] if one else prompts)
        results = self._pool([self._encode(p) for p in batch], PoolingParams("embed"), use_tqdm, lora_name)
        return [
            {
                "embedding": normalized(r["pooled"].tolist(), dimensions),
                "num_prompt_tokens": r["num_prompt_tokens"],
                "num_cached_tokens": r["num_cached_tokens"],
            }
            for r in results
        ]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        instruction: str = RERANK_INSTRUCTION,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Rerank scores, as vLLM's `LLM.score`: each query of `data_1` (one for all, or one per document)
        against each document of `data_2`, through Qwen3-Reranker's judge prompt (common/pooling.py
        RERANK_FORMAT): sigmoid(logit("yes") - logit("no")) at its last token. Outputs in document order:
        {"score", "num_prompt_tokens", "num_cached_tokens"}."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            raise RequestError(
                f"score takes one query for all documents or one per document; got {len(queries)} queries "
                f"for {len(documents)} documents"
            )
        prompts = [
            RERANK_FORMAT.format(instruction=instruction, query=q, document=d)
            for q, d in zip(queries, documents)
        ]
        params = PoolingParams("score", tuple(self._single_token(word) for word in RERANK_TOKENS))
        results = self._pool([self._encode(p) for p in prompts], params, use_tqdm, None)
        return [
            {
                "score": relevance(r["pooled"].tolist()),
                "num_prompt_tokens": r["num_prompt_tokens"],
                "num_cached_tokens": r["num_cached_tokens"],
            }
            for r in results
        ]

    def _single_token(self, word: str) -> int:
        """The id of `word` as one token of the tokenizer (a reranker's "yes" and "no")."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.config.model} has no tokenizer: score needs its {word!r} token")
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"{self.config.model}'s tokenizer spells {word!r} as {len(ids)} tokens {ids}, not one"
            )
        return ids[0]

    def _pool(
        self, prompts: list[list[int]], params: PoolingParams, use_tqdm: bool, lora_name: str | None
    ) -> list[dict[str, Any]]:
        """Run each prompt as a pooling request; their results in prompt order."""
        ids: list[str] = []
        try:
            for token_ids in prompts:
                request_id = str(next(self._request_ids))
                self.engine.add_request(
                    request_id, token_ids, SamplingParams(), lora_name=lora_name, pooling=params
                )
                ids.append(request_id)
        except RequestError:
            for request_id in ids:  # none of the batch runs when one prompt is refused
                self.engine.abort_request(request_id)
            self._run(len(ids), use_tqdm=False)
            raise
        results = self._run(len(ids), use_tqdm)
        return [results[request_id] for request_id in ids]

    def _compile(self, constraint: tuple[str, str] | tuple[str, str, bool]) -> None:
        """Wait until `constraint` compiles, with the engine queue's time limit: raises its RequestError,
        or one naming grammar_compile_timeout_s when it takes longer (the tokenizer's first read apart)."""
        compiler = self.engine.constraints.compiler
        timeout = self.config.grammar_compile_timeout_s
        future = compiler.compile(constraint)
        asked = time.monotonic()
        while True:
            counting_from = compiler.counting_from(asked)
            left = None if counting_from is None else max(counting_from + timeout - time.monotonic(), 0.0)
            try:
                future.result(GRAMMAR_WAIT_S if left is None else left)
                return
            except concurrent.futures.TimeoutError:
                if left is not None:
                    raise RequestError(compile_timeout_message(constraint[0], timeout)) from None

    def _prompt_inputs(self, prompt: Prompt) -> tuple[list[int], list[ImagePatches]]:
        """A prompt's token ids, with each image's placeholder expanded, and its images' patches."""
        if not isinstance(prompt, dict):
            return self._encode(prompt), []
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise RequestError(
                'a prompt dict has "prompt" or "prompt_token_ids" (one of them) and optionally '
                f'"multi_modal_data"; got keys {sorted(prompt)}'
            )
        token_ids = self._encode(prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"])
        data = prompt.get("multi_modal_data") or {}
        if set(data) - {"image"}:
            raise RequestError(f'multi_modal_data takes "image" only; got {sorted(data)}')
        images = data.get("image", [])
        images = images if isinstance(images, list) else [images]
        if not images:
            return token_ids, []
        vision = self.config.model_config.vision
        if vision is None:
            raise RequestError(f"{self.config.model} has no vision tower: it takes no images")
        if self._image_processor is None:
            self._image_processor = ImageProcessorConfig.from_model_dir(self.config.model)
        patches = [patchify(image, self._image_processor) for image in images]
        counts = [p.num_tokens(vision.spatial_merge_size) for p in patches]
        return expand_placeholders(token_ids, vision.image_token_id, counts), patches

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.config.model} has no tokenizer; pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}
        bar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while self.engine.has_unfinished_requests():
            t = time.perf_counter()
            step = self.engine.step()
            elapsed = max(time.perf_counter() - t, 1e-9)
            outputs, stats = step.outputs, step.stats
            if stats.num_prefill_tokens:
                prefill_tps = stats.num_prefill_tokens / elapsed
            elif stats.num_decode_tokens:
                decode_tps = stats.num_decode_tokens / elapsed
            bar.set_postfix(Prefill=f"{prefill_tps:.0f}tok/s", Decode=f"{decode_tps:.0f}tok/s", refresh=False)
            for out in outputs:
                if out.error is not None:
                    raise RequestError(out.error)
                entry = results.setdefault(
                    out.request_id, {"token_ids": [], "logprobs": [], "finish_reason": None}
                )
                entry["token_ids"].extend(out.new_token_ids)
                entry["logprobs"].extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = out.prompt_logprobs
                if out.pooled is not None:
                    entry["pooled"] = out.pooled
                entry["num_prompt_tokens"] = out.num_prompt_tokens
                entry["num_cached_tokens"] = out.num_cached_tokens
                if out.finished:
                    entry["finish_reason"] = out.finish_reason
                    bar.update(1)
        bar.close()
        return results

    def _to_dict(self, result: dict[str, Any]) -> dict[str, Any]:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(result["token_ids"], skip_special_tokens=True)
        return {"text": text, **result}
