"""The committed gRPC stubs match protos/, and protos/generate.py --check really notices when they do not."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.common.sampling_params import SamplingParams
from nanovllm.common.v1 import worker_pb2
from nanovllm.common.wire import sampling_from_wire, sampling_to_wire

REPO = Path(__file__).resolve().parent.parent
GENERATE = REPO / "protos" / "generate.py"


@pytest.fixture(scope="module")
def gen():
    """protos/generate.py loaded as a module (it is a script, not part of a package)."""
    spec = importlib.util.spec_from_file_location("nanovllm_protos_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_stubs() -> set[Path]:
    return {p for d in (REPO / "nanovllm" / "v1", REPO / "common" / "v1") for p in d.glob("*_pb2*.py*")}


def test_committed_stubs_are_up_to_date():
    """`generate.py --check` passes on the tree as committed: nobody edited a .proto without `make protos`."""
    command = [sys.executable, str(GENERATE), "--check"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


def test_every_committed_stub_is_generated_identically(gen, tmp_path):
    """Regenerating yields exactly the committed stub files, byte for byte, and no committed stub is left
    over from a proto that no longer exists (which --check alone would not notice)."""
    gen.generate(tmp_path)
    files = gen.generated_files(tmp_path)
    assert set(files.values()) == committed_stubs()
    assert len(files) >= 6  # generate.proto and worker.proto, each: _pb2.py, _pb2.pyi, _pb2_grpc.py
    for src, dest in files.items():
        assert src.read_bytes() == dest.read_bytes(), f"{dest.relative_to(REPO)} differs from protoc's output"


@pytest.fixture
def fake_repo(gen, tmp_path, monkeypatch):
    """A copy of the committed stubs, with generate.py's destinations pointed at it."""
    root = tmp_path / "repo"
    dirs = {}
    for proto_dir, dest in gen.OUTPUT_DIRS.items():
        copy = root / dest.relative_to(REPO)
        shutil.copytree(dest, copy)
        dirs[proto_dir] = copy
    monkeypatch.setattr(gen, "REPO", root)
    monkeypatch.setattr(gen, "OUTPUT_DIRS", dirs)
    return root


def run_main(gen, monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["generate.py", *args])
    return gen.main()


def test_check_passes_on_a_pristine_copy(gen, fake_repo, monkeypatch, capsys):
    """Baseline for the staleness tests below: the redirected check passes on unmodified copies."""
    assert run_main(gen, monkeypatch, "--check") == 0
    assert capsys.readouterr().err == ""


def test_check_flags_an_edited_stub(gen, fake_repo, monkeypatch, capsys):
    """A stub that differs from protoc's output makes --check exit 1 and name that file."""
    stub = fake_repo / "common" / "v1" / "worker_pb2.py"
    stub.write_text(stub.read_text() + "\n# hand edit\n")
    assert run_main(gen, monkeypatch, "--check") == 1
    err = capsys.readouterr().err
    assert "stale: common/v1/worker_pb2.py" in err
    assert err.count("stale:") == 1


def test_check_flags_a_missing_stub(gen, fake_repo, monkeypatch, capsys):
    """A stub that was never generated (deleted) also counts as stale."""
    (fake_repo / "nanovllm" / "v1" / "generate_pb2_grpc.py").unlink()
    assert run_main(gen, monkeypatch, "--check") == 1
    assert "stale: nanovllm/v1/generate_pb2_grpc.py" in capsys.readouterr().err


def test_regenerating_repairs_stale_stubs(gen, fake_repo, monkeypatch, capsys):
    """Without --check, the script rewrites stale stubs, after which --check passes again."""
    stub = fake_repo / "nanovllm" / "v1" / "generate_pb2.pyi"
    stub.write_text("stale\n")
    (fake_repo / "common" / "v1" / "worker_pb2_grpc.py").unlink()
    assert run_main(gen, monkeypatch) == 0
    assert stub.read_bytes() == (REPO / "nanovllm" / "v1" / "generate_pb2.pyi").read_bytes()
    assert run_main(gen, monkeypatch, "--check") == 0
    assert "stale" not in capsys.readouterr().err


def test_every_sampling_field_crosses_the_worker_link():
    """SamplingParams and the link's message have the same fields (None-able ones `optional`), so a
    non-default value of each comes back unchanged."""
    message_fields = worker_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(message_fields)
    params = SamplingParams(
        temperature=0.5, top_k=7, top_p=0.25, min_p=0.125, repetition_penalty=1.5, presence_penalty=-0.5,
        frequency_penalty=0.75, seed=2**40, max_tokens=33, min_tokens=3, stop_token_ids=[4, 9],
        ignore_eos=True, logprobs=0,
    )  # fmt: skip
    assert sampling_from_wire(sampling_to_wire(params, worker_pb2.SamplingParams)) == params
    unset = sampling_from_wire(sampling_to_wire(SamplingParams(), worker_pb2.SamplingParams))
    assert unset.seed is None and unset.logprobs is None and unset.constraint is None


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_schema": '{"type": "object"}'},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"grammar": 'start: "a" | "b"'},
        {"choice": ["yes", "no, never"]},
    ],
)
def test_each_constraint_crosses_the_worker_link(constraint):
    """The oneof carries exactly the one constraint set; the others come back unset."""
    params = SamplingParams(temperature=0.0, **constraint)
    message = sampling_to_wire(params, worker_pb2.SamplingParams)
    assert message.WhichOneof("constraint") == next(iter(constraint))
    assert sampling_from_wire(message) == params
