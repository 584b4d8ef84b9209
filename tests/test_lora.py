"""LoRA adapters in float32: each adapter's greedy tokens and logits equal transformers + PEFT's (random
Qwen3 and Llama models, random adapters of rank 8 and 64 on all seven projections or a subset); a batch
mixing adapters and the base equals each request alone; the prefix cache never serves one adapter's
blocks to another; adapters load and unload while others' requests run; bad adapters fail their load
naming the problem and leave the engine serving."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nanovllm import LLM
from nanovllm.common.errors import AdapterError, UnknownAdapterError
from nanovllm.kernels import triton_layers
from nanovllm.worker.runner.decode_graphs import EagerReplay
from tests.helpers import greedy, teacher_forced_logits
from tests.model_factory import ALL_LORA_TARGETS, build_model, make_adapter

SUBSET = ["q_proj", "v_proj", "down_proj"]
MAX_NEW = 16
ENGINE = {"max_model_len": 256, "kv_cache_memory": "16MiB", "max_lora_rank": 64, "dtype": "float32"}


def peft_model(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@torch.inference_mode()
def peft_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def models(model_dirs: dict[str, Path], tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """Per architecture: the base model and its adapters (name -> directory)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for arch in ("qwen3", "llama"):
        base = model_dirs[arch]
        out[arch] = (
            base,
            {
                "r8-all": make_adapter(base, root / arch / "r8-all", 8, ALL_LORA_TARGETS, seed=10),
                "r64-subset": make_adapter(base, root / arch / "r64-subset", 64, SUBSET, seed=11),
                "r8-subset": make_adapter(base, root / arch / "r8-subset", 8, SUBSET, seed=12),
            },
        )
    return out


def engine(base: Path, adapters: dict[str, Path], **options) -> LLM:
    loras = [f"{name}={path}" for name, path in adapters.items()]
    return LLM(str(base), lora_adapters=loras, **{**ENGINE, **options})


# auto: the C++ kernels (one lora_add_ call per projection); torch: PyTorch's matmuls (group by group, or
# batched over the groups), as on a device without the C++ kernels; triton: the CUDA path's kernels, in
# Triton's interpreter here.
BACKENDS = ["auto", "torch"]
TRITON = {"attention_backend": "triton", "enforce_eager": True, "dtype": "float32"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_tokens_and_logits_equal_peft(models, arch: str, backend: str):
    """Each adapter alone: greedy tokens equal PEFT's, and differ from the base model's (the adapter is
    felt); teacher-forced logits within 1e-4 of PEFT's in prefill, chunked prefill and decode, the three
    adapters and the base in the same steps."""
    base, adapters = models[arch]
    llm = engine(base, adapters, attention_backend=backend)
    batch = prompts(1, 3)
    base_tokens = [o["token_ids"] for o in llm.generate(batch, greedy(MAX_NEW), use_tqdm=False)]
    names = list(adapters)
    for name in names:
        reference = peft_model(base, adapters[name])
        ours = [o["token_ids"] for o in llm.generate(batch, greedy(MAX_NEW), use_tqdm=False, lora_name=name)]
        assert ours == [peft_greedy(reference, p, MAX_NEW) for p in batch], name
        assert ours != base_tokens, f"{name} does not change the greedy tokens: the test would prove nothing"
    forced = prompts(2, 4)
    expected = []
    with torch.inference_mode():
        for name, ids in zip([*names, None], forced):
            model = peft_model(base, adapters[name]) if name else AutoModelForCausalLM.from_pretrained(base)
            expected.append(model(torch.tensor([ids])).logits[0].float())
    for chunk in (64, 5, 1):
        got = teacher_forced_logits(llm, forced, chunk, [*names, None])
        for name, ours, theirs in zip([*names, None], got, expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4, msg=f"{name}, chunk {chunk}")


@pytest.mark.parametrize(
    ("backend", "count", "max_new"),
    # Triton's interpreter runs a step's kernels in Python: fewer and shorter requests there.
    [
        ("auto", 8, MAX_NEW),
        ("torch", 8, MAX_NEW),
        ("auto-fp8", 8, MAX_NEW),  # an FP8 KV cache (kernels/fp8_kv.py)
        pytest.param("triton", 3, 4, marks=pytest.mark.slow),
    ],
)
def test_a_mixed_batch_equals_each_request_alone(models, backend: str, count: int, max_new: int):
    """Three adapters and the base, requests of each, in one batch with chunked prefill; then each
    request alone on an engine without a prefix cache. On the Triton path the batch's decode steps replay
    in the decode graphs' adapter variant (each row's slot in a static buffer, -1 for the base and padding
    rows), the requests alone run eagerly: CUDA graphs on a GPU, here EagerReplay (the same static buffers
    and padding, Triton in its interpreter)."""
    base, adapters = models["qwen3"]
    batch = prompts(3, count)
    names = ([None, "r8-all", "r64-subset", "r8-subset"] * 2)[:count]
    options = TRITON if backend == "triton" else {"attention_backend": backend}
    if backend == "auto-fp8":
        options = {"kv_cache_dtype": "fp8"}
    graphs = {"max_num_seqs": 4, "enforce_eager": not torch.cuda.is_available()}  # buckets 1, 2, 4
    llm = engine(
        base, adapters, max_num_batched_tokens=32, **{**options, **(graphs if backend == "triton" else {})}
    )
    replayed: list[int] = []
    if backend == "triton":
        if llm.engine.runner.decode_graphs is None:
            llm.engine.runner.use_decode_graphs(EagerReplay())
        graphs = llm.engine.runner.decode_graphs
        for size, replay in list(graphs.adapter_replays.items()):
            graphs.adapter_replays[size] = lambda replay=replay, size=size: (replayed.append(size), replay())[
                1
            ]
    mixed = llm.generate(batch, greedy(max_new), use_tqdm=False, lora_name=names)
    assert (4 in replayed) == (backend == "triton")  # the three rows padded to bucket 4, at least once
    alone = engine(base, adapters, enable_prefix_caching=False, **options)
    for prompt, name, out in zip(batch, names, mixed):
        expected = alone.generate([prompt], greedy(max_new), use_tqdm=False, lora_name=name)[0]["token_ids"]
        assert out["token_ids"] == expected, name


@pytest.mark.parametrize("kind", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_add_each_groups_adapter(kernels, dtype: torch.dtype, kind: str):
    """The C++ and the Triton lora_add_ against float64 on the same (rounded) inputs: within the dtype's
    rounding of y, once; and each row's result bit for bit the same alone as in its group (each row is
    summed on its own, in a fixed order)."""
    gen = torch.Generator().manual_seed(0)
    device = "cuda" if kind == "triton" and torch.cuda.is_available() else "cpu"
    slots, rank, k, parts = 3, 8, 37, [0, 24, 32, 40]  # K and the parts' sizes not multiples of 8
    x = torch.randn(11, k, generator=gen).to(device, dtype)
    a = torch.randn(slots, 3 * rank, k, generator=gen).to(device, dtype)
    b = torch.randn(slots, parts[-1], rank, generator=gen).to(device, dtype)
    y = torch.randn(11, parts[-1], generator=gen).to(device, dtype)
    groups = {2: [0, 3, 4, 5, 6, 7, 8, 9, 10], 0: [2]}  # row 1 runs the base model: untouched
    rows = torch.tensor([r for g in groups.values() for r in g])
    starts = torch.tensor([0, len(groups[2]), len(rows)])
    slots_of_rows = torch.tensor([slot for slot, g in groups.items() for _ in g])

    def add(
        y: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, row_slots
    ) -> None:
        if kind == "cpu":
            kernels.lora_add_(y, x, a, b, rows, starts, slots, parts)
        else:
            triton_layers.lora_add_(y, x, a, b, rows.to(device), row_slots.to(device), parts)

    ours = y.clone()
    add(ours, rows, starts, torch.tensor(list(groups)), slots_of_rows)
    x, a, b, y, ours = (t.cpu() for t in (x, a, b, y, ours))
    expected = y.double()
    for slot, members in groups.items():
        for p in range(3):
            shrunk = x[members].double() @ a[slot, p * rank : (p + 1) * rank].double().T
            expected[members, parts[p] : parts[p + 1]] += shrunk @ b[slot, parts[p] : parts[p + 1]].double().T
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(
        ours.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    )
    assert torch.equal(ours[1], y[1])
    alone = y.clone().to(device)
    x, a, b = (t.to(device) for t in (x, a, b))
    add(alone, torch.tensor([5]), torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([2]))
    assert torch.equal(alone[5].cpu(), ours[5])
    if kind == "triton":  # a captured graph's batch: every row, -1 for a row without an adapter
        every = y.clone().to(device)
        slot_of = {row: slot for slot, members in groups.items() for row in members}
        row_slots = torch.tensor([slot_of.get(row, -1) for row in range(len(y))])
        triton_layers.lora_add_(every, x, a, b, torch.arange(len(y)).to(device), row_slots.to(device), parts)
        assert torch.equal(every.cpu(), ours)


def test_prefix_cache_blocks_never_cross_adapters(models):
    """A prompt computed under one adapter: the same prompt under another adapter or the base is computed
    again (no cached tokens) and gives that adapter's own tokens; under the first adapter again it hits."""
    base, adapters = models["qwen3"]
    prompt = prompts(4, 1)[0] * 3  # several full 16-token blocks
    fresh = engine(base, adapters, enable_prefix_caching=False)
    expected = {
        name: fresh.generate([prompt], greedy(8), use_tqdm=False, lora_name=name)[0]["token_ids"]
        for name in ("r8-all", "r8-subset", None)
    }
    llm = engine(base, adapters)
    first = llm.generate([prompt], greedy(8), use_tqdm=False, lora_name="r8-all")[0]
    assert first["num_cached_tokens"] == 0 and first["token_ids"] == expected["r8-all"]
    for name in ("r8-subset", None):
        out = llm.generate([prompt], greedy(8), use_tqdm=False, lora_name=name)[0]
        assert out["num_cached_tokens"] == 0, name
        assert out["token_ids"] == expected[name], name
    again = llm.generate([prompt], greedy(8), use_tqdm=False, lora_name="r8-all")[0]
    assert again["num_cached_tokens"] >= 32 and again["token_ids"] == expected["r8-all"]


def test_more_adapters_than_slots_take_turns(models):
    """Three adapters through one slot: each request waits until its adapter can have the slot, the slot is
    refilled as they alternate, and every request gets its own adapter's tokens."""
    base, adapters = models["qwen3"]
    batch = prompts(5, 6)
    names = ["r8-all", "r64-subset", "r8-subset", None, "r8-all", "r8-subset"]
    alone = engine(base, adapters, enable_prefix_caching=False)
    expected = [
        alone.generate([p], greedy(MAX_NEW), use_tqdm=False, lora_name=n)[0]["token_ids"]
        for p, n in zip(batch, names)
    ]
    llm = engine(base, adapters, max_loras=1)
    outs = llm.generate(batch, greedy(MAX_NEW), use_tqdm=False, lora_name=names)
    assert [o["token_ids"] for o in outs] == expected
    assert llm.engine.runner.adapter_slots.num_loads >= 3


def test_load_and_unload_while_requests_run(models):
    """Loading an adapter and unloading two while requests run: no request fails or changes. An unloaded
    adapter's queued and running requests finish with it; a new request naming it is refused
    (UnknownAdapterError, NOT_FOUND on the wire) naming what is loaded."""
    base, adapters = models["qwen3"]
    batch = prompts(6, 4)
    names = ["r8-all", "r8-all", None, "r64-subset"]
    alone = engine(base, adapters, enable_prefix_caching=False)
    expected = [
        alone.generate([p], greedy(MAX_NEW), use_tqdm=False, lora_name=n)[0]["token_ids"]
        for p, n in zip(batch, names)
    ]
    llm = engine(base, {k: adapters[k] for k in ("r8-all", "r64-subset")}, max_num_seqs=3)
    for i, (prompt, name) in enumerate(zip(batch, names)):
        llm.engine.add_request(str(i), prompt, greedy(MAX_NEW), lora_name=name)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    finished: set[str] = set()

    def step() -> None:
        for out in llm.engine.step().outputs:
            assert out.error is None and out.finish_reason != "abort", out
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)

    for _ in range(3):
        step()
    assert [s.request_id for s in llm.engine.scheduler.waiting] == ["3"]  # at most three run
    llm.add_lora("late", str(adapters["r8-subset"]))
    llm.remove_lora("r64-subset")  # its request is queued
    llm.remove_lora("r8-all")  # two of its requests are running
    with pytest.raises(UnknownAdapterError, match=r"'r8-all' is not loaded; loaded: 'late'"):
        llm.engine.add_request("new", batch[0], greedy(4), lora_name="r8-all")
    while len(finished) < len(batch):
        step()
    assert [tokens[str(i)] for i in range(len(batch))] == expected
    late = llm.generate(batch[:1], greedy(MAX_NEW), use_tqdm=False, lora_name="late")[0]["token_ids"]
    assert (
        late
        == alone.generate(batch[:1], greedy(MAX_NEW), use_tqdm=False, lora_name="r8-subset")[0]["token_ids"]
    )


def _rewrite(source: Path, target: Path, config: dict | None = None, weights: bytes | None = None) -> Path:
    """A copy of adapter `source` with its config's fields changed, or its weights file replaced."""
    target.mkdir(parents=True)
    data = json.loads((source / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**data, **(config or {})}))
    (target / "adapter_model.safetensors").write_bytes(
        weights if weights is not None else (source / "adapter_model.safetensors").read_bytes()
    )
    return target


def test_bad_adapters_fail_their_load_naming_the_problem(models, model_dirs, tmp_path):
    """Each bad adapter fails add_lora with an AdapterError naming what is wrong; the engine goes on
    serving the base and its loaded adapter with the same tokens."""
    base, adapters = models["qwen3"]
    good = adapters["r8-all"]
    llm = engine(base, {"r8-all": good}, max_lora_rank=32)
    prompt = prompts(7, 1)
    before = [
        llm.generate(prompt, greedy(8), use_tqdm=False, lora_name=n)[0]["token_ids"] for n in (None, "r8-all")
    ]
    other_base = build_model("qwen3", tmp_path / "wide", hidden=96, seed=5)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    malformed = _rewrite(good, tmp_path / "malformed", weights=b"")
    (malformed / "adapter_config.json").write_text("{ not json")
    cases = {
        "another base": (
            make_adapter(other_base, tmp_path / "wide-adapter", 8, SUBSET, 1),
            r"does not fit this model",
        ),
        "rank above the maximum": (
            adapters["r64-subset"],
            r"rank r=64, above this engine's max_lora_rank=32",
        ),
        "missing directory": (tmp_path / "nowhere", r"does not exist"),
        "missing config": (no_config, r"has no adapter_config.json"),
        "missing weights": (no_weights, r"has no adapter_model.safetensors"),
        "malformed config": (malformed, r"adapter_config.json is not valid JSON"),
        "garbage weights": (
            _rewrite(good, tmp_path / "garbage", weights=b"\x00garbage" * 10),
            r"is not a readable safetensors file",
        ),
        "unknown target": (
            _rewrite(good, tmp_path / "unknown", {"target_modules": ["q_proj", "lm_head"]}),
            r"unknown target module 'lm_head'",
        ),
        "DoRA": (_rewrite(good, tmp_path / "dora", {"use_dora": True}), r"use_dora=True is not supported"),
    }
    for case, (path, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            llm.add_lora(case, str(path))
    with pytest.raises(AdapterError, match=r"named 'r8-all' is already loaded"):
        llm.add_lora("r8-all", str(adapters["r8-subset"]))
    after = [
        llm.generate(prompt, greedy(8), use_tqdm=False, lora_name=n)[0]["token_ids"] for n in (None, "r8-all")
    ]
    assert after == before
    assert sorted(llm.engine.adapters) == ["r8-all"]
