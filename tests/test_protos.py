"""The committed stubs under pdserve/v1 are exactly what `make protos` generates from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_generator() -> object:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_are_fresh(tmp_path: Path) -> None:
    generator = load_generator()
    generated = generator.generate(tmp_path)  # type: ignore[attr-defined]
    committed = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "pdserve" / "v1").glob("*.py*"))
    assert sorted(generated) == committed, "stubs added or removed: run `make protos`"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (REPO_ROOT / p).read_bytes()]
    assert not stale, f"stale generated stubs (run `make protos`): {stale}"
