"""Workers on one host split its CPUs between them instead of fighting over them.

A CPU worker runs each op on an OpenMP team as wide as its thread count. Two workers that each take every
core oversubscribe them: a parallel region ends only when all of its team's threads have run, and
libgomp's threads busy-wait between regions, so a thread parked for the other worker's spinning thread
holds its whole team for a time slice. Two such workers on a 2-core host ran at 0.06-0.28 of one worker's
throughput; pinned to a core each, at 0.9-1.0. Taking turns at the cores (one model step at a time,
under a lock) reached only 0.54: each worker then steps with half the batch, and a small model's step
costs almost the same at half the batch.

So each process that runs a model on the CPU holds a lock file in a directory named by its CPU set for as
long as it lives. Between steps (at most once a second) it counts the live files and takes its slice of
the CPUs: its threads' affinity and its torch thread count. The oldest process takes the first slice.
The kernel drops the lock of a process that dies, and the others grow back into its CPUs.

Processes with other CPU sets (pinned, or containers with their own /tmp) never see each other. A fixed
`num_threads` opts out. The thread count changes float32 rounding at a few batch sizes, so with the
default, a float32 request's tokens can depend on how many workers shared the host when it ran.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from nanovllm.common.logging import get_logger

log = get_logger(__name__)

REFRESH_INTERVAL_S = 1.0


def share_directory(cpus: frozenset[int], root: Path | None = None) -> Path:
    """The directory shared by every process whose affinity mask is exactly `cpus`."""
    key = xxhash.xxh64_hexdigest(",".join(map(str, sorted(cpus))).encode())
    return (root or Path(tempfile.gettempdir())) / f"nanovllm-cpus-{len(cpus)}-{key}"


def cpu_slice(cpus: frozenset[int], index: int, count: int) -> list[int]:
    """The `index`-th of `count` near-equal contiguous slices of `cpus`; with more processes than CPUs,
    processes share single CPUs round-robin."""
    ordered = sorted(cpus)
    n = len(ordered)
    if count > n:
        return [ordered[index % n]]
    return ordered[index * n // count : (index + 1) * n // count]


def _is_locked(path: Path) -> bool:
    """Whether a live process holds `path`'s lock (a file whose owner died is removed)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, PermissionError):  # gone, or unreadable to us: not a member we can see
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    # Gone already, or another user's in a sticky directory (it stays, but unlocked it does not count).
    with contextlib.suppress(FileNotFoundError, PermissionError):
        path.unlink()
    return False


@dataclass(frozen=True)
class Slice:
    cpus: list[int]
    threads: int
    processes: int


class CpuShare:
    """This engine's membership of its CPU set's share directory, and the slice its process holds.

    Slices belong to processes, not engines: engines in one process (offline LLMs) share its threads, so
    they hold one slice between them, the one of the process's oldest lock file."""

    def __init__(
        self,
        cpus: frozenset[int],
        thread_budget: int,
        root: Path | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        """`thread_budget`: threads for the whole set (a cgroup quota may allow fewer CPUs than the
        affinity mask names). `root`: where the share directories live (the temp directory)."""
        self.cpus = cpus
        self.refresh_interval_s = refresh_interval_s
        self.thread_budget = thread_budget
        self.directory = share_directory(cpus, root)
        self.directory.mkdir(exist_ok=True)
        with contextlib.suppress(PermissionError):  # another user's workers made it: they let us in
            self.directory.chmod(0o1777)
        # Locked before it is visible under its final name, so no one takes a newborn file for a dead one.
        name = f"{time.time_ns():020d}-{os.getpid()}"
        staging = self.directory / f"{name}.new"
        self._fd = os.open(staging, os.O_RDONLY | os.O_CREAT, 0o644)
        os.fchmod(self._fd, 0o644)  # whatever the umask: other users' workers probe it read-only
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.path = staging.rename(self.directory / f"{name}.lock")
        self.current: Slice | None = None
        self._checked_at = float("-inf")

    def processes(self) -> list[int]:
        """The pids of the live members, oldest first."""
        pids: list[int] = []
        for path in sorted(self.directory.glob("*.lock")):
            pid = int(path.stem.rsplit("-", 1)[1])
            if pid not in pids and (path == self.path or _is_locked(path)):
                pids.append(pid)
        return pids

    def slice(self) -> Slice:
        processes = self.processes()
        cpus = cpu_slice(self.cpus, processes.index(os.getpid()), len(processes))
        threads = max(1, min(len(cpus), self.thread_budget // len(processes)))
        return Slice(cpus, threads, len(processes))

    def refresh(self) -> None:
        """Take this process's current slice (at most once per refresh interval): every thread's
        affinity and torch's thread count. Call it on the thread that runs the model."""
        now = time.monotonic()
        if now - self._checked_at < self.refresh_interval_s:
            return
        self._checked_at = now
        new = self.slice()
        if new == self.current:
            return
        _set_process_affinity(new.cpus)
        torch.set_num_threads(new.threads)
        log.info("cpu_share", cpus=new.cpus, threads=new.threads, sharing_processes=new.processes)
        self.current = new

    def close(self) -> None:
        """Leave the share; the last engine of its process to leave gives the process its CPU set back."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1
        if os.getpid() not in self.processes():
            _set_process_affinity(sorted(self.cpus))


def _set_process_affinity(cpus: list[int]) -> None:
    """sched_setaffinity(0) moves only the calling thread: move every thread (new ones inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just exited
            os.sched_setaffinity(int(tid), cpus)
