"""Several base models and their LoRA adapters behind one router, in real processes: a Qwen3 worker and a
Llama worker, each with an adapter from the start, behind a router with the OpenAI face and admin tokens.
Each name routes to its own worker and gives the offline engine's tokens; the official `openai` client
lists and calls them; unknown names are NOT_FOUND / 404 naming what is served; adapters load and unload
through the authenticated Admin service while other streams run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from nanovllm import LLM
from nanovllm.server_process import ServerProcess
from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from tests.helpers import greedy
from tests.model_factory import ALL_LORA_TARGETS, build_model, make_adapter
from tests.services import (
    CALL_TIMEOUT_S,
    collect,
    library_errors,
    start_router,
    start_worker,
    wait_idle,
    wait_serving,
)

ADMIN_TOKEN = "admin-0123456789abcdef"
PROMPT = [5, 17, 99, 240, 31, 8, 77, 150, 3, 64]
MAX_NEW = 12
LORA_FLAGS = ("--max-lora-rank", "16", "--max-loras", "2")


@dataclass
class Cluster:
    qwen3: ServerProcess
    llama: ServerProcess
    router: ServerProcess
    bases: dict[str, Path]  # base model directories, by served name
    adapters: dict[str, Path]  # adapter directories, by name
    expected: dict[str, list[int]]  # each name's greedy tokens for PROMPT, from the offline engine
    client: openai.OpenAI


def served_tokens(router: str, model: str, max_tokens: int = MAX_NEW) -> list[int]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        model=model,
        return_token_ids=True,
    )
    responses, error = collect(router, request)
    assert error is None, error
    return [t for r in responses for t in r.token_ids]


def admin(router: str, method: str, request, token: str | None = ADMIN_TOKEN):
    with grpc.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.AdminStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        return getattr(stub, method)(request, metadata=metadata, timeout=CALL_TIMEOUT_S)


def list_models(router: str) -> dict[str, str]:
    with grpc.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        models = stub.ListModels(generate_pb2.ListModelsRequest(), timeout=10).models
    return {m.name: m.parent for m in models if m.num_workers}


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path], kernels, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("lora-service")
    qwen3_dir, llama_dir = model_dirs["qwen3"], model_dirs["llama"]
    adapters = {
        "q-sql": make_adapter(qwen3_dir, root / "q-sql", 8, ALL_LORA_TARGETS, seed=21),
        "q-chat": make_adapter(qwen3_dir, root / "q-chat", 16, ["q_proj", "v_proj"], seed=22),
        "l-sql": make_adapter(llama_dir, root / "l-sql", 8, ALL_LORA_TARGETS, seed=23),
    }
    names = {"qwen3": "qwen3", "llama": "llama", "q-sql": "qwen3", "q-chat": "qwen3", "l-sql": "llama"}
    expected = {}
    for base, base_dir in (("qwen3", qwen3_dir), ("llama", llama_dir)):
        own = {n: str(p) for n, p in adapters.items() if names[n] == base}
        offline = LLM(
            str(base_dir), max_model_len=512, kv_cache_memory="32MiB", dtype="float32",
            lora_adapters=[f"{n}={p}" for n, p in own.items()], max_lora_rank=16,
        )  # fmt: skip
        for name in [base, *own]:
            lora = None if name == base else name
            expected[name] = offline.generate([PROMPT], greedy(MAX_NEW), use_tqdm=False, lora_name=lora)[0][
                "token_ids"
            ]
    (root / "admin-tokens").write_text(f"ops:{ADMIN_TOKEN}\n")
    qwen3 = start_worker(
        qwen3_dir, "--lora", f"q-sql={adapters['q-sql']}", *LORA_FLAGS, log_path=root / "qwen3.log"
    )
    llama = start_worker(
        llama_dir, "--lora", f"l-sql={adapters['l-sql']}", *LORA_FLAGS, log_path=root / "llama.log"
    )
    router = start_router(
        [qwen3.address, llama.address],
        "--http-port", "0", "--admin-tokens-file", str(root / "admin-tokens"),
        log_path=root / "router.log",
    )  # fmt: skip
    cluster: Cluster | None = None
    try:
        for server in (qwen3, llama, router):
            wait_serving(server.address)
        while set(list_models(router.address)) != {"qwen3", "llama", "q-sql", "l-sql"}:
            threading.Event().wait(
                0.02
            )  # until both workers are connected (the router is SERVING at the first)
        client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0)
        cluster = Cluster(
            qwen3, llama, router, {"qwen3": qwen3_dir, "llama": llama_dir}, adapters, expected, client
        )
        yield cluster
    finally:
        if cluster is not None:  # a test may have replaced a worker (one restarted on its port)
            qwen3, llama, router = cluster.qwen3, cluster.llama, cluster.router
        router.stop()
        qwen3.stop()
        llama.stop()
    for log in ("router", "qwen3", "llama"):
        assert library_errors(root / f"{log}.log") == []


def test_each_name_runs_on_its_base_with_its_adapter(cluster: Cluster):
    """Every base and adapter, by name over gRPC: the offline engine's tokens (so each went to the worker
    of its base, with its adapter); adapters change the tokens."""
    for name in ("qwen3", "llama", "q-sql", "l-sql"):
        assert served_tokens(cluster.router.address, name) == cluster.expected[name], name
    assert cluster.expected["q-sql"] != cluster.expected["qwen3"]
    assert cluster.expected["l-sql"] != cluster.expected["llama"]


def test_openai_client_lists_and_calls_every_name(cluster: Cluster):
    listed = {m.id: getattr(m, "parent", None) for m in cluster.client.models.list().data}
    assert listed == {"qwen3": None, "llama": None, "q-sql": "qwen3", "l-sql": "llama"}
    for name in listed:
        completion = cluster.client.completions.create(
            model=name, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0
        )
        assert completion.model == name
        assert completion.choices[0].text  # the text of the tokens checked over gRPC above
    with pytest.raises(
        openai.NotFoundError,
        match=r"model 'qwen3-999b' is not served here; served: 'llama', 'qwen3', 'l-sql', 'q-sql'",
    ):
        cluster.client.completions.create(model="qwen3-999b", prompt=PROMPT, max_tokens=2)
    with pytest.raises(
        openai.BadRequestError, match=r"model is required: this router serves several base models"
    ):
        cluster.client.completions.create(model="", prompt=PROMPT, max_tokens=2)


def test_unknown_and_missing_names_over_grpc(cluster: Cluster):
    request = generate_pb2.GenerateRequest(
        text="hi", sampling=generate_pb2.SamplingParams(max_tokens=2), model="nope"
    )
    _, error = collect(cluster.router.address, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "model 'nope' is not served here" in error.details()
    request.model = ""
    _, error = collect(cluster.router.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'llama', 'qwen3'" in error.details()


def test_admin_loads_and_unloads_while_streams_run(cluster: Cluster):
    """A long stream of one adapter runs while another is loaded, used and unloaded; the long stream's
    tokens are the offline engine's. Unloading an adapter in use lets its stream finish; a new request
    naming it is then NOT_FOUND."""
    router = cluster.router.address
    long_request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        model="q-sql",
        return_token_ids=True,
    )
    with grpc.insecure_channel(router) as channel:
        stream = generate_pb2_grpc.GenerationStub(channel).Generate(long_request, timeout=CALL_TIMEOUT_S)
        first = next(stream)  # the stream runs on the qwen3 worker
        loaded = admin(router, "LoadLoRAAdapter", generate_pb2.LoadLoRAAdapterRequest(
            name="q-chat", path=str(cluster.adapters["q-chat"]), base_model="qwen3"))  # fmt: skip
        assert list(loaded.workers) == [cluster.qwen3.address]
        offline = LLM(
            str(cluster.bases["qwen3"]), max_model_len=512, kv_cache_memory="32MiB", dtype="float32", max_lora_rank=16,
            lora_adapters=[f"q-chat={cluster.adapters['q-chat']}"],
        )  # fmt: skip
        expected_chat = offline.generate([PROMPT], greedy(MAX_NEW), use_tqdm=False, lora_name="q-chat")[0][
            "token_ids"
        ]
        assert served_tokens(router, "q-chat") == expected_chat
        assert list_models(router)["q-chat"] == "qwen3"
        unloaded = admin(router, "UnloadLoRAAdapter", generate_pb2.UnloadLoRAAdapterRequest(name="q-sql"))
        assert list(unloaded.workers) == [cluster.qwen3.address]
        rest = list(stream)  # the unloaded adapter's stream finishes with it
    tokens = [t for r in [first, *rest] for t in r.token_ids]
    assert tokens == cluster.expected["q-sql"]
    with pytest.raises(openai.NotFoundError, match="model 'q-sql' is not served here"):
        cluster.client.completions.create(model="q-sql", prompt=PROMPT, max_tokens=2)
    # Back as it was, for the other tests.
    reload = generate_pb2.LoadLoRAAdapterRequest(
        name="q-sql", path=str(cluster.adapters["q-sql"]), base_model="qwen3"
    )
    admin(router, "LoadLoRAAdapter", reload)
    admin(router, "UnloadLoRAAdapter", generate_pb2.UnloadLoRAAdapterRequest(name="q-chat"))
    assert served_tokens(router, "q-sql") == cluster.expected["q-sql"]
    wait_idle(cluster.qwen3.address)


def test_admin_calls_need_an_admin_token_and_name_what_is_wrong(cluster: Cluster, tmp_path: Path):
    router = cluster.router.address
    wide = build_model("qwen3", tmp_path / "wide", hidden=96, seed=5)  # another base: other shapes
    wide_adapter = make_adapter(wide, tmp_path / "wide-adapter", 8, ["q_proj"], seed=6)
    good = generate_pb2.LoadLoRAAdapterRequest(
        name="x", path=str(cluster.adapters["q-chat"]), base_model="qwen3"
    )
    for token, code in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("public-0123456789abcdef", grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            admin(router, "LoadLoRAAdapter", good, token=token)
        assert caught.value.code() == code
    cases = [
        (generate_pb2.LoadLoRAAdapterRequest(name="x", path=str(tmp_path / "nowhere"), base_model="qwen3"),
         grpc.StatusCode.INVALID_ARGUMENT, f"worker {cluster.qwen3.address} could not load 'x': adapter directory"),
        (generate_pb2.LoadLoRAAdapterRequest(name="x", path=str(wide_adapter), base_model="qwen3"),
         grpc.StatusCode.INVALID_ARGUMENT, "does not fit this model"),
        (generate_pb2.LoadLoRAAdapterRequest(name="q-sql", path=str(cluster.adapters["q-chat"]), base_model="qwen3"),
         grpc.StatusCode.ALREADY_EXISTS, "'q-sql' is already served: a LoRA adapter of 'qwen3'"),
        (generate_pb2.LoadLoRAAdapterRequest(name="x", path=str(cluster.adapters["q-chat"])),
         grpc.StatusCode.INVALID_ARGUMENT, "base_model: model is required"),
        (generate_pb2.LoadLoRAAdapterRequest(name="x", path=str(cluster.adapters["q-chat"]), base_model="q-sql"),
         grpc.StatusCode.INVALID_ARGUMENT, "is a LoRA adapter; name its base model 'qwen3'"),
    ]  # fmt: skip
    for request, code, message in cases:
        with pytest.raises(grpc.RpcError) as caught:
            admin(router, "LoadLoRAAdapter", request)
            pytest.fail(f"loaded {request}")
        assert caught.value.code() == code and message in caught.value.details(), caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        admin(router, "UnloadLoRAAdapter", generate_pb2.UnloadLoRAAdapterRequest(name="x"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert set(list_models(router)) == {"qwen3", "llama", "q-sql", "l-sql"}  # nothing else changed
    assert served_tokens(router, "q-sql") == cluster.expected["q-sql"]


def test_a_restarted_worker_gets_the_adapters_loaded_through_admin(cluster: Cluster, tmp_path: Path):
    """The router remembers what Admin loaded: the worker, killed and started again with only its --lora
    adapter, serves the Admin-loaded one again before it takes requests (and not one Admin unloaded)."""
    router, chat = cluster.router.address, str(cluster.adapters["q-chat"])
    admin(
        router,
        "LoadLoRAAdapter",
        generate_pb2.LoadLoRAAdapterRequest(name="q-chat", path=chat, base_model="qwen3"),
    )
    admin(
        router,
        "LoadLoRAAdapter",
        generate_pb2.LoadLoRAAdapterRequest(name="gone", path=chat, base_model="qwen3"),
    )
    admin(router, "UnloadLoRAAdapter", generate_pb2.UnloadLoRAAdapterRequest(name="gone"))
    port = int(cluster.qwen3.address.rsplit(":", 1)[1])
    cluster.qwen3.kill()
    cluster.qwen3 = start_worker(
        cluster.bases["qwen3"], "--lora", f"q-sql={cluster.adapters['q-sql']}", *LORA_FLAGS, port=port,
        log_path=tmp_path / "qwen3.log",
    )  # fmt: skip
    wait_serving(cluster.qwen3.address)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while "qwen3" not in list_models(router) and time.monotonic() < deadline:
        threading.Event().wait(0.02)  # until the router has reconnected (it joins with its adapters)
    assert list_models(router) == {
        "qwen3": "",
        "llama": "",
        "q-sql": "qwen3",
        "l-sql": "llama",
        "q-chat": "qwen3",
    }
    assert served_tokens(router, "q-chat") == cluster.expected["q-chat"]
    admin(router, "UnloadLoRAAdapter", generate_pb2.UnloadLoRAAdapterRequest(name="q-chat"))
    assert library_errors(tmp_path / "qwen3.log") == []
