"""A CPU engine's weights, KV cache and states on 2 MiB pages (worker/runner/huge_pages.py): the memory is
where /proc/self/smaps says the kernel gave huge pages, every tensor keeps its values and its holders, and
an engine decodes the same tokens with them and without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.worker.layers.quantization import PackedWeight, QuantScheme
from nanovllm.worker.runner import huge_pages
from tests.model_factory import build_model

pytestmark = pytest.mark.skipif(
    not huge_pages.available(), reason="this kernel gives no transparent huge pages (Linux, mode not never)"
)

HUGE = huge_pages.HUGE_PAGE


def huge_page_bytes(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def from_a_huge_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors from 2 MiB up on huge pages (the runner's threshold is larger than this file's tensors)."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", HUGE)


def test_zeros_are_zero_on_a_huge_page_boundary_and_on_huge_pages(from_a_huge_page: None):
    tensor = huge_pages.zeros((3, 2**20), torch.float32)  # 12 MiB
    assert tensor.shape == (3, 2**20) and tensor.dtype == torch.float32
    assert tensor.data_ptr() % HUGE == 0
    assert not tensor.any()
    # faulted in at allocation (zero_), on huge pages: all six 2 MiB pages the kernel could give
    assert huge_page_bytes(tensor.data_ptr()) >= 3 * HUGE, huge_page_bytes(tensor.data_ptr())
    small = huge_pages.zeros((1000, 4), torch.bfloat16)  # under the threshold: from torch.zeros
    assert small.shape == (1000, 4) and not small.any()


class Tied(nn.Module):
    """Two linears sharing one weight parameter, a packed weight (int4 planes) and a parameter that is a
    0-d tensor: what move_weights meets in a model."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(512, 1024)
        self.second = nn.Linear(512, 1024, bias=False)
        self.second.weight = self.first.weight
        self.packed = PackedWeight(256, 512, QuantScheme("int4", 4, 32), "packed")
        self.packed.quantize_(torch.randn(256, 512))
        self.scale = nn.Parameter(torch.tensor(0.5), requires_grad=False)


def test_move_weights_keeps_each_parameter_its_values_and_its_holders(from_a_huge_page: None):
    torch.manual_seed(0)
    model = Tied().requires_grad_(False)
    x = torch.randn(3, 512)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    expected = (model.first(x), model.second(x), model.packed.dequantize(torch.float32))
    params = {name: id(p) for name, p in model.named_parameters()}
    moved = huge_pages.move_weights(model)
    # the model's own scale, the shared weight once, the bias, then qweight, scales and mins, each on a cache line
    sizes = [4, 1024 * 512 * 4, 1024 * 4, 256 * 256, 256 * 16 * 2, 256 * 16 * 2]
    assert moved == sum(-(-size // 64) * 64 for size in sizes)
    assert {name: id(p) for name, p in model.named_parameters()} == params
    assert model.second.weight is model.first.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    got = (model.first(x), model.second(x), model.packed.dequantize(torch.float32))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # all in one mapping, in the order the modules list them, starting on a huge page
    pointers = [
        model.scale.data_ptr(), model.first.weight.data_ptr(), model.first.bias.data_ptr(),
        model.packed.qweight.data_ptr(), model.packed.scales.data_ptr(), model.packed.mins.data_ptr(),
    ]  # fmt: skip
    assert pointers == sorted(pointers) and pointers[0] % HUGE == 0
    assert pointers[-1] - pointers[0] < moved
    assert huge_page_bytes(pointers[1]) >= HUGE  # 2 MiB of the weight at least


def test_weights_under_the_threshold_stay_where_they_are():
    model = Tied().requires_grad_(False)  # 2.2 MB, under the runner's 16 MiB
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    assert huge_pages.move_weights(model) == 0
    assert [t.data_ptr() for t in model.state_dict().values()] == pointers


def test_an_engine_on_huge_pages_decodes_what_it_decodes_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A hybrid model in bf16 with int4 projections (interleaved for the C++ kernel where it runs first, then
    moved), its recurrent states and KV cache: greedy tokens equal the same engine's off huge pages. Every
    tensor of this small model goes on huge pages (a real model's are above the runner's threshold)."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    build_model("qwen3_5", tmp_path, num_layers=4, hidden=256, tokenizer=False)
    prompts = [[(5 * i + j) % 900 + 3 for j in range(40 + 7 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        llm = LLM(
            str(tmp_path), max_model_len=256, kv_cache_memory="64MiB", quantization="int4", dtype="bfloat16",
            huge_pages=on,
        )  # fmt: skip
        runner = llm.engine.runner
        assert runner.on_huge_pages == on
        # each mapping starts on a huge page: the weights' (the first parameter first), the KV cache's, a 5 MiB state's
        if on:
            weights = next(runner.model.parameters()).data_ptr()
            state = runner.model.model.linear_attention_layers()[0].recurrent_state.data_ptr()
            assert [address % HUGE for address in (weights, runner.kv_cache.data_ptr(), state)] == [0, 0, 0]
            assert huge_page_bytes(runner.kv_cache.data_ptr()) >= HUGE
        tokens[on] = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens[True] == tokens[False]


# In a fresh process with the worker's malloc settings (freed memory kept): 256 MB of weights allocated from
# the heap, moved onto huge pages, the freed memory given back; the resident memory before and after.
MOVE_SCRIPT = """
import json, torch
from torch import nn
from nanovllm.worker.runner import huge_pages
from nanovllm.worker.runner.host_memory import keep_freed_memory, return_freed_memory
def resident() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
keep_freed_memory()
model = nn.Sequential(*(nn.Linear(2048, 4096, bias=False) for _ in range(8))).requires_grad_(False)
before = resident()
huge_pages.move_weights(model)
return_freed_memory()
print(json.dumps({"before": before, "after": resident()}))
"""


def test_moving_the_weights_does_not_keep_them_twice():
    """As the runner does it; without return_freed_memory glibc keeps the old 256 MB and this fails."""
    out = subprocess.run([sys.executable, "-c", MOVE_SCRIPT], capture_output=True, text=True, check=True)
    sizes = json.loads(out.stdout.splitlines()[-1])
    assert sizes["after"] - sizes["before"] < 8 * 2048 * 4096 * 4 // 8, sizes  # the mapping's slack at most
