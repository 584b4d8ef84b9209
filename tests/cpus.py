"""The CPUs the suite runs on, read before anything loads torch: conftest pins the test process to its share
first, because libgomp (torch's OpenMP) counts the CPUs it may spin on once, as torch loads it. Counting two
while the process had one, its threads spun away whole time slices waiting for each other wherever a test
ran two threads (tests/helpers.py's decode_layers_on_and_off: 4-11 s a case instead of 0.1-0.4)."""

from __future__ import annotations

import os


def worker_cpus(cpus: frozenset[int]) -> frozenset[int]:
    """The share of `cpus` this test process runs on: under pytest-xdist, worker gw<i> of n takes the i-th
    of n near-equal parts (a CPU of its own on a 2-core machine with -n 2), so the engines of two workers
    never wait on each other's threads (worker/runner/cpu_share.py); all of them otherwise."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None:
        return cpus
    index, n, ordered = int(worker.removeprefix("gw")), int(count), sorted(cpus)
    part = ordered[index * len(ordered) // n : (index + 1) * len(ordered) // n]
    return frozenset(part or [ordered[index % len(ordered)]])


HOST_CPUS = frozenset(os.sched_getaffinity(0))  # every CPU the suite was given
# The CPUs this test process and the servers it starts use, pinned by conftest before any engine runs. An
# offline engine in the test process takes its slice of them (worker/runner/cpu_share.py) by pinning the
# process's threads, often to one CPU, so each test gives the process all of them back; servers are given
# them by name (`start`), whatever the test process holds then.
SUITE_CPUS = worker_cpus(HOST_CPUS)
