"""The documentation cannot drift from the code: every flag, NANOVLLM_* variable and metric it names
exists, every relative link resolves, and the flag tables of docs/configuration.md are the ones
docs/flags.py generates from the config dataclasses (so every flag is documented)."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import pytest

from nanovllm.cli import COMMANDS
from nanovllm.router.calls.metrics import RouterMetrics
from nanovllm.worker.service.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
# Flags of the other tools the documentation shows commands of: pip, docker, helm, pyright, argparse's own.
OTHER_TOOLS_FLAGS = {
    "--index-url",
    "--no-deps",
    "--build-arg",
    "--target",  # docker build's (the router's image)
    "--create-namespace",
    "--set",
    "--pythonpath",
    "--help",
    "--dist",  # pytest-xdist's, as `make test` runs the suite
    "--pdb",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
VARIABLE = re.compile(r"NANOVLLM_[A-Z0-9_]+")
METRIC = re.compile(r"nanovllm:[a-z][a-z0-9_]*")  # not an image tag (nanovllm:0.1.0)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _flags_doc():
    spec = importlib.util.spec_from_file_location("docs_flags", REPO / "docs" / "flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(path: Path) -> str:
    return path.read_text()


def _bench_flags() -> set[str]:
    """The flags the benchmark scripts define (their argparse declarations)."""
    declared = re.compile(r"add_argument\(\s*\"(--[a-z0-9-]+)\"")
    return {flag for path in (REPO / "bench").glob("*.py") for flag in declared.findall(path.read_text())}


def _nanovllm_flags() -> set[str]:
    names = {flag.name for _, flags, _ in COMMANDS for flag in flags}
    return names | {flag.off_name for _, flags, _ in COMMANDS for flag in flags if flag.kind == "tristate"}


def _metric_names() -> set[str]:
    """Every name the router and the worker export, with the suffixes Prometheus adds."""
    names = set()
    router = RouterMetrics()
    router.watch_workers(list)  # as the router does at start: the per-worker gauges
    worker = WorkerMetrics()
    worker.watch_kv_tiers()  # as a worker with KV tiers
    for registry in (router.registry, worker.registry):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in ("_total", "_bucket", "_sum", "_count", "_created"))
    return names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documented_flags_exist(path: Path) -> None:
    known = _nanovllm_flags() | _bench_flags() | OTHER_TOOLS_FLAGS
    unknown = sorted(set(FLAG.findall(_text(path))) - known)
    assert unknown == [], f"{path.name} names flags that no command or benchmark has: {unknown}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documented_variables_exist(path: Path) -> None:
    """A NANOVLLM_* variable is a flag's; one ending in `_` stands for a family (NANOVLLM_WORKER_TLS_*)."""
    known = {flag.env for _, flags, _ in COMMANDS for flag in flags}
    named = set(VARIABLE.findall(_text(path)))
    unknown = sorted(
        v for v in named if v not in known and not (v.endswith("_") and any(k.startswith(v) for k in known))
    )
    assert unknown == [], f"{path.name} names variables no flag reads: {unknown}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documented_metrics_are_exported(path: Path) -> None:
    unknown = sorted(set(METRIC.findall(_text(path))) - _metric_names())
    assert unknown == [], f"{path.name} names metrics neither the router nor the worker exports: {unknown}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    targets = [t for t in LINK.findall(_text(path)) if not re.match(r"[a-z]+:|#", t)]
    broken = [t for t in targets if not (path.parent / t.split("#")[0]).exists()]
    assert broken == [], f"{path.name} links to files that do not exist: {broken}"


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation but hyphens and
    underscores dropped, spaces to hyphens; a repeated heading's anchor numbered -1, -2, ..."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    in_code = False
    for line in _text(path).splitlines():
        in_code ^= line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not in_code:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            repeats[slug] = repeats.get(slug, -1) + 1
            anchors.add(f"{slug}-{repeats[slug]}" if repeats[slug] else slug)
    return frozenset(anchors)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_to_a_section_find_its_heading(path: Path) -> None:
    """A section renamed or lost leaves its links pointing at the top of the page: every `file.md#anchor`
    (and `#anchor`) names a heading there."""
    lost = []
    for target in LINK.findall(_text(path)):
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        local = anchor and not re.match(r"[a-z]+:", target) and linked.suffix == ".md" and linked.exists()
        if local and anchor not in _anchors(linked):
            lost.append(target)
    assert lost == [], f"{path.name} links to headings that do not exist: {lost}"


def test_every_flag_is_in_the_configuration_doc() -> None:
    """docs/configuration.md ends with the tables docs/flags.py generates; run it after changing a flag."""
    flags_doc = _flags_doc()
    current = flags_doc.DOC.read_text()
    assert current == flags_doc.rendered(current), "stale flag tables: run `python docs/flags.py`"
    missing = sorted(name for name in _nanovllm_flags() if f"`{name}`" not in current)
    assert missing == []
