"""The wheel holds every package: pyproject.toml maps nanovllm.* onto the design card's folders
(nanovllm.worker -> worker/, ...) and lists the packages by hand, so a new sub-package left off that list
would be missing from an installed nanovllm while the tests, run from the checkout, still pass."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project supports 3.10, where the same parser is the tomli package
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *relative)))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages without a folder"
