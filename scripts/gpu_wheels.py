"""Wheels for `scripts/gpu_check.sh` on a GPU machine without a network: every package pdserve and
its GPU tests import, at the versions of this environment, for the GPU machine's Python, saved in
``.whl/`` (which gpu_check.sh installs as they are when it builds its `.venv-gpu` on top of the
machine's own CUDA torch).

Left out: torch and numpy, and what only torch requires (sympy, networkx, ...): those of the GPU
machine stay, matched to its CUDA build.

Usage: .venv/bin/python scripts/gpu_wheels.py [--python-version 3.12] [--dest .whl] [--list]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parent.parent
# What the GPU tests need beyond the project's dependencies.
TEST_PACKAGES = ("pytest", "pytest-timeout", "hypothesis")
# The GPU machine's torch comes with these; theirs must stay.
KEPT_FROM_THE_MACHINE = ("torch", "numpy")
PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def requirements(name: str) -> list[str]:
    """The installed distribution ``name``'s unconditional requirements (no extras), by name."""
    names = []
    for line in md.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(canonicalize_name(req.name))
    return names


def closure(roots: list[str], skip: tuple[str, ...] = ()) -> set[str]:
    """``roots`` and everything they require, as installed here, never entering ``skip`` (names
    not installed are left out)."""
    skipped = {canonicalize_name(s) for s in skip}
    seen = set(skipped)
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            md.version(name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        todo.extend(requirements(name))
    return seen - skipped


def project_roots() -> list[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(d).name for d in project["dependencies"]] + list(TEST_PACKAGES)


def pinned() -> list[str]:
    """``name==version`` of every wheel to carry."""
    carried = closure(project_roots(), skip=KEPT_FROM_THE_MACHINE)
    return sorted(f"{name}=={md.version(name)}" for name in carried)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (X.Y)")
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / ".whl")
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args()
    pins = pinned()
    if args.list:
        print("\n".join(pins))
        return 0
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", args.python_version, "--implementation", "cp", *platforms,
        "--dest", str(args.dest), *pins,
    ]  # fmt: skip
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
