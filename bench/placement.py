"""Where a benchmark's worker, router and client processes run, on a machine with few cores.

With fewer cores than busy processes, the placement decides whose CPU a cost is taken from, and so what a
run measures. `router-alone` gives the router a CPU of its own: the router is then the bound, as it is on a
GPU machine, where the worker's host work is light and the router streams tens of thousands of tokens a
second.
"""

from __future__ import annotations

import os
from collections.abc import Callable

CpuSets = tuple[set[int] | None, set[int] | None, set[int]]  # the worker's, the router's, the client's

# Given this process's CPUs (at least two, but for `shared`); None: every CPU this process may use.
PLACEMENTS: dict[str, Callable[[list[int]], CpuSets]] = {
    "shared": lambda cpus: (None, None, set(cpus)),
    "pin-worker": lambda cpus: ({cpus[0]}, set(cpus[1:]), set(cpus[1:])),
    "router-alone": lambda cpus: (set(cpus[:-1]), {cpus[-1]}, set(cpus[:-1])),
    "client-alone": lambda cpus: (set(cpus[:-1]), set(cpus[:-1]), {cpus[-1]}),
}

PLACEMENT_HELP = (
    "where the worker, the router and the clients run: shared (every CPU), pin-worker (the worker on the "
    "first CPU, the rest on the others), router-alone (the router on the last CPU), client-alone (the "
    "clients on the last CPU)"
)


def place(placement: str) -> CpuSets:
    """The CPU sets of `placement`, with this process (the client) moved onto its own. ValueError when
    the placement needs two CPUs and this process may use one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 and placement != "shared":
        raise ValueError(f"--placement {placement} needs 2 CPUs at least, this process may use {len(cpus)}")
    worker, router, client = PLACEMENTS[placement](cpus)
    os.sched_setaffinity(0, client)
    return worker, router, client
