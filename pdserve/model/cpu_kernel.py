"""Operators written in C++ (``*.cpp`` beside their Python side), built with the machine's compiler when
an engine loads its model and loaded into its process.

A build takes a few seconds; its shared library is cached under the cache directory by a key of the
source, torch, the compiler's options and the CPU (``-march=native``), so a later start loads it at
once. Where there is no compiler (a bare GPU image) or the build fails, ``load`` logs it and the caller
runs its operator's fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "kernels"
COMPILER_ENV = "CXX"  # the C++ compiler to build with (default: c++, as torch's builds)
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++20", "-shared", "-fPIC", "-w")


def compiler() -> str:
    """The C++ compiler the operators are built with: ``$CXX``, else ``c++``."""
    return os.environ.get(COMPILER_ENV) or "c++"


def load(source: Path, cache_dir: Path, name: str, fallback: str) -> bool:
    """Builds ``source`` under ``cache_dir`` (once per source, torch and CPU) and loads its library into
    this process; returns whether it loaded. A build or load that fails is logged with ``name`` (the
    operator, in words) and ``fallback`` (what runs instead)."""
    try:
        library = build(source, cache_dir / CACHE_SUBDIR)
        torch.ops.load_library(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("%s not loaded (%s): %s", name, exc, fallback)
        return False
    logger.info("%s loaded from %s", name, library)
    return True


def build(source: Path, directory: Path) -> Path:
    """The shared library of ``source`` under ``directory``, compiled there first when missing."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"no C++ compiler {cxx!r} on PATH")
    torch_lib = Path(torch.__file__).parent / "lib"
    command = [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        str(source),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]
    key = hashlib.sha256()  # what the library depends on: not where this checkout lies
    options = [part for part in command if part != str(source) and not part.startswith(("-I", "-L", "-Wl"))]
    for part in (source.read_bytes(), torch.__version__.encode(), " ".join(options).encode(), _cpu_id()):
        key.update(part)
    library = directory / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / library.name
        result = subprocess.run([*command, "-o", str(built)], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise subprocess.SubprocessError(f"{cxx} exited {result.returncode}: {result.stderr[-2000:]}")
        os.replace(built, library)  # atomic: processes building at once each publish a whole library
    logger.info("%s built: %s", source.name, library)
    return library


def _cpu_id() -> bytes:
    """What ``-march=native`` compiles for: the machine and its CPU's model and flags."""
    identity = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    identity.append(line.strip())
                if line.strip() == "":
                    break  # the first processor's lines
    except OSError:
        pass
    return "\n".join(identity).encode()
