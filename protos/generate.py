"""Generate the Python gRPC stubs from protos/ (`make protos`); `--check` fails when they are stale.

Each proto's directory names the Python package of its stubs, which setuptools' package-dir puts in this
repository's layout: nanovllm/v1/ -> nanovllm/v1/, nanovllm/common/v1/ -> common/v1/ (the router-worker
link, imported by both sides; its proto package stays nanovllm.worker.v1, the link's name on the wire).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
# proto directory (relative to protos/) -> where its generated modules live in the repository
OUTPUT_DIRS = {
    Path("nanovllm/v1"): REPO / "nanovllm" / "v1",
    Path("nanovllm/common/v1"): REPO / "common" / "v1",
}


def generate(out_root: Path) -> None:
    """Run protoc for every .proto, writing modules under out_root/<proto directory>/."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")  # well-known types shipped with grpcio-tools
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}"]
    args += [f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


def generated_files(root: Path) -> dict[Path, Path]:
    """Generated module -> its destination in the repository."""
    files = {}
    for proto_dir, dest in OUTPUT_DIRS.items():
        for path in sorted((root / proto_dir).glob("*_pb2*.py*")):
            files[path] = dest / path.name
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        files = generated_files(Path(tmp))
        stale = [
            dest for src, dest in files.items() if not dest.exists() or not filecmp.cmp(src, dest, False)
        ]
        if args.check:
            for dest in stale:
                print(f"stale: {dest.relative_to(REPO)} (run `make protos`)", file=sys.stderr)
            return 1 if stale else 0
        for src, dest in files.items():
            dest.parent.mkdir(parents=True, exist_ok=True)
            (dest.parent / "__init__.py").touch()
            shutil.copyfile(src, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
