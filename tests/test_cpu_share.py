"""Processes that run models on the same CPUs split them (worker/runner/cpu_share.py): real processes holding
real lock files, and two real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from nanovllm.v1 import generate_pb2, generate_pb2_grpc
from nanovllm.worker.runner.cpu_share import CpuShare, cpu_slice
from tests.cpus import HOST_CPUS
from tests.services import open_channel, start_router, start_worker, wait_serving

FOUR_CPUS = frozenset({0, 1, 2, 3})

# A member in another process: joins, prints its slice, holds its lock until stdin closes, then leaves.
MEMBER = """
import sys
from pathlib import Path
from nanovllm.worker.runner.cpu_share import CpuShare
share = CpuShare(frozenset({0, 1, 2, 3}), 4, root=Path(sys.argv[1]))
print(share.slice().cpus, flush=True)
sys.stdin.read()
share.close()
"""


def start_member(root: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


@pytest.mark.parametrize("num_cpus", [1, 2, 3, 8])
def test_slices_are_disjoint_and_cover_the_cpus(num_cpus: int) -> None:
    cpus = frozenset(range(10, 10 + num_cpus))
    for count in range(1, num_cpus + 1):
        slices = [cpu_slice(cpus, i, count) for i in range(count)]
        assert all(slices), f"{count} processes on {num_cpus} CPUs: an empty slice in {slices}"
        assert sorted(c for s in slices for c in s) == sorted(cpus)
    over = [cpu_slice(cpus, i, num_cpus + 2) for i in range(num_cpus + 2)]
    assert all(len(s) == 1 for s in over) and {c for s in over for c in s} == cpus


def test_processes_split_the_set_and_a_killed_ones_cpus_come_back(tmp_path: Path) -> None:
    older, older_slice = start_member(tmp_path)
    try:
        share = CpuShare(FOUR_CPUS, 4, root=tmp_path)
        assert older_slice == "[0, 1, 2, 3]"  # alone when it joined
        mine = share.slice()
        # the younger takes the second half
        assert (mine.cpus, mine.threads, mine.processes) == ([2, 3], 2, 2)
        older.kill()
        older.wait()
        alone = share.slice()
        assert (alone.cpus, alone.threads, alone.processes) == ([0, 1, 2, 3], 4, 1)
        assert [p.name for p in share.directory.iterdir()] == [share.path.name]  # the dead one's file went
        share.close()
    finally:
        older.kill()
        older.wait()


def test_engines_in_one_process_hold_one_slice(tmp_path: Path) -> None:
    older, _ = start_member(tmp_path)
    try:
        first, second = CpuShare(FOUR_CPUS, 4, root=tmp_path), CpuShare(FOUR_CPUS, 4, root=tmp_path)
        assert first.slice() == second.slice()
        assert first.slice().cpus == [2, 3] and first.slice().processes == 2
        first.close()
        second.close()
    finally:
        older.stdin.close()
        older.wait()
    assert list(tmp_path.glob("*/*.lock")) == []  # every member left


def test_refresh_moves_every_thread_and_close_gives_the_cpus_back(tmp_path: Path) -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    threads_before = torch.get_num_threads()
    stop = threading.Event()
    bystander = threading.Thread(target=stop.wait)
    bystander.start()
    share = CpuShare(cpus, len(cpus), root=tmp_path, refresh_interval_s=0.0)
    member = subprocess.Popen(
        [
            sys.executable,
            "-c",
            MEMBER.replace("{0, 1, 2, 3}), 4", f"{set(cpus)}), {len(cpus)}"),
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        member.stdout.readline()
        share.refresh()
        expected = cpu_slice(cpus, 0, 2)  # the older member's half
        assert share.current.cpus == expected
        assert os.sched_getaffinity(bystander.native_id) == set(expected)
        assert torch.get_num_threads() == max(1, min(len(expected), len(cpus) // 2))
        share.close()
        assert os.sched_getaffinity(0) == cpus and os.sched_getaffinity(bystander.native_id) == cpus
    finally:
        stop.set()
        bystander.join()
        member.stdin.close()
        member.wait()
        share.close()
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads_before)


def _last_share(log: Path) -> dict:
    events = [json.loads(line) for line in log.read_text().splitlines() if '"cpu_share"' in line]
    return events[-1]


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="splitting CPUs needs at least two")
def test_two_workers_on_one_host_split_its_cpus(
    tmp_path: Path, qwen3_dir: Path, kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their own temp directory, so the two share only with each other, not with the suite's other engines.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # On every CPU of the host, even where this test process has a share of them (pytest-xdist).
    cpus = set(HOST_CPUS)
    first = start_worker(qwen3_dir, log_path=tmp_path / "first.log", cpus=cpus)
    servers = [first]
    try:
        # The second starts once the first holds its share, so it sees the first however slow the start.
        wait_serving(first.address)
        second = start_worker(qwen3_dir, log_path=tmp_path / "second.log", cpus=cpus)
        servers.append(second)
        router = start_router([first.address], log_path=tmp_path / "router.log")
        servers.append(router)
        for server in (second, router):
            wait_serving(server.address)
        # The older worker holds every CPU until a step a refresh interval after its last look
        # (worker/runner/cpu_share.py): give it steps until it has taken its part.
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=4),
        )
        deadline = time.monotonic() + 60
        with open_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            while (
                _last_share(tmp_path / "first.log")["sharing_processes"] != 2 and time.monotonic() < deadline
            ):
                list(stub.Generate(request, timeout=60))
        older, younger = _last_share(tmp_path / "first.log"), _last_share(tmp_path / "second.log")
        assert older["sharing_processes"] == 2 and younger["sharing_processes"] == 2
        assert set(older["cpus"]).isdisjoint(younger["cpus"]), (older, younger)
        assert 1 <= older["threads"] <= len(older["cpus"]) and 1 <= younger["threads"] <= len(younger["cpus"])
    finally:
        for server in reversed(servers):
            server.kill()
