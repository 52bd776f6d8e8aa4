"""Generate the Python gRPC stubs of protos/ into pdserve/v1/ (the one build step for them).

Usage: python scripts/gen_protos.py [OUTPUT_ROOT]

OUTPUT_ROOT defaults to the repository root; the stubs land in OUTPUT_ROOT/pdserve/v1/.
The staleness test runs this into a temporary directory and compares the files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_DIR = Path("pdserve") / "v1"
INIT_TEXT = '"""Generated gRPC stubs of protos/pdserve/v1 (run `make protos`; do not edit)."""\n'


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(output_root: Path) -> list[Path]:
    """Writes the stubs under output_root and returns the paths written, relative to it."""
    out_dir = output_root / PACKAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    grpc_tools_include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{grpc_tools_include}",
        f"--python_out={output_root}",
        f"--pyi_out={output_root}",
        f"--grpc_python_out={output_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    (out_dir / "__init__.py").write_text(INIT_TEXT)
    return sorted(p.relative_to(output_root) for p in out_dir.iterdir() if p.is_file())


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(root):
        print(path)


if __name__ == "__main__":
    main()
