"""The package's shape: no import circle between its modules (a module-level or a lazy, function-level
import both count), and the symlinks that let static analysers follow `nanovllm.<folder>` to the design
card's folders (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"nanovllm": "nanovllm", "common": "nanovllm.common", "worker": "nanovllm.worker"}
FOLDERS |= {"kernels": "nanovllm.kernels", "router": "nanovllm.router"}


def _modules() -> dict[str, Path]:
    """Module name -> file, for the hand-written modules (not the generated gRPC stubs)."""
    modules = {}
    for folder, package in FOLDERS.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).with_suffix("")
            if "v1" in relative.parts or (folder == "nanovllm" and relative.parts[0] in FOLDERS):
                continue
            parts = [p for p in relative.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                circles.append(sorted([module, *component]))

    for module in graph:
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert len(graph) > 50  # the walk found the package
    assert _circles(graph) == []


def test_static_analysers_see_the_folders_as_nanovllm_subpackages() -> None:
    for folder in FOLDERS.keys() - {"nanovllm"}:
        link = REPO / "nanovllm" / folder
        assert link.is_symlink() and link.resolve() == (REPO / folder).resolve(), link


# The worker's rooms, top to bottom (docs/architecture.md#layout): a module imports from its own room and
# the rooms below it, never from one above. `step` (the step's contract) and the request, configuration
# and device types that it and every room use are at the bottom.
WORKER_ROOMS = (
    {"service", "llm"},
    {"core"},
    {"runner"},
    {"sample"},
    {"models"},
    {"layers"},
    {"step", "sequence", "model_config", "config", "device"},
)
# The router's wings, top to bottom (docs/architecture.md#the-routers-wings): the public faces, one call's
# life, the fleet of workers; a module imports its own wing and those below it.
ROUTER_WINGS = ({"faces"}, {"calls"}, {"fleet"})
# Outside the worker: the router never imports it, and what both sides share imports neither side.
FORBIDDEN = {
    "nanovllm.router": ("nanovllm.worker",),
    "nanovllm.common": ("nanovllm.worker", "nanovllm.router"),
    "nanovllm.kernels": ("nanovllm.worker", "nanovllm.router"),
}


def _room(module: str) -> tuple[str, int] | None:
    """The side (worker or router) of a worker or router module and the index of its room or wing there
    (0 is the top), None elsewhere."""
    parts = module.split(".")
    if parts[:2] not in (["nanovllm", "worker"], ["nanovllm", "router"]) or len(parts) < 3:
        return None
    side = parts[1]
    for level, rooms in enumerate(WORKER_ROOMS if side == "worker" else ROUTER_WINGS):
        if parts[2] in rooms:
            return side, level
    raise AssertionError(f"{module} is in no room of WORKER_ROOMS or wing of ROUTER_WINGS")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a room, or across a boundary FORBIDDEN names."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = _room(module), _room(target)
            if here is not None and there is not None and here[0] == there[0] and there[1] < here[1]:
                wrong.append(f"{module} imports {target}, a room above it")
            for side, banned in FORBIDDEN.items():
                if module.startswith(side + ".") and target.startswith(banned):
                    wrong.append(f"{module} imports {target}")
    return wrong


def test_rooms_import_only_downwards() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert sum(_room(m) is not None and _room(m)[0] == "worker" for m in graph) > 30  # the walk found them
    assert sum(_room(m) is not None and _room(m)[0] == "router" for m in graph) > 20
    assert _upward_imports(graph) == []


def test_an_upward_import_is_noticed() -> None:
    """The check itself: a sampler importing the scheduler, a layer importing a model, the fleet importing
    a call's module, a call's module importing a face, the router importing the worker and common importing
    the router are each reported; imports downwards are not."""
    graph = {
        "nanovllm.worker.sample.sampler": {"nanovllm.worker.core.scheduler", "nanovllm.worker.step"},
        "nanovllm.worker.layers.linear": {"nanovllm.worker.models.loader"},
        "nanovllm.worker.core.engine": {"nanovllm.worker.runner.model_runner", "nanovllm.worker.sequence"},
        "nanovllm.router.calls.call": {"nanovllm.worker.step", "nanovllm.common.v1.worker_pb2"},
        "nanovllm.router.fleet.pool": {"nanovllm.router.calls.limits", "nanovllm.router.fleet.routing"},
        "nanovllm.router.calls.validation": {"nanovllm.router.faces.auth", "nanovllm.router.fleet.tokenizer"},
        "nanovllm.router.faces.server": {"nanovllm.router.calls.call", "nanovllm.router.fleet.pool"},
        "nanovllm.common.wire": {"nanovllm.router.calls.validation"},
    }
    assert _upward_imports(graph) == [
        "nanovllm.common.wire imports nanovllm.router.calls.validation",
        "nanovllm.router.calls.call imports nanovllm.worker.step",
        "nanovllm.router.calls.validation imports nanovllm.router.faces.auth, a room above it",
        "nanovllm.router.fleet.pool imports nanovllm.router.calls.limits, a room above it",
        "nanovllm.worker.layers.linear imports nanovllm.worker.models.loader, a room above it",
        "nanovllm.worker.sample.sampler imports nanovllm.worker.core.scheduler, a room above it",
    ]
