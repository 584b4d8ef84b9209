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
