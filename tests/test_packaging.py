"""The wheel ships every typedkv module: subpackages (typedkv.integrations) are found, not listed.

Built from a copy of the sources (pyproject.toml, README.md, typedkv/) in a temporary folder, with
the environment's setuptools and no build isolation: no network, a few seconds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> set[str]:
    """Every file the wheel must hold: the package's modules and its py.typed marker."""
    files = {p for p in (ROOT / "typedkv").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return {p.relative_to(ROOT).as_posix() for p in files if p.suffix == ".py" or p.name == "py.typed"}


def test_wheel_ships_every_subpackage(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in the environment")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "typedkv", source / "typedkv", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
         str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("typedkv-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_sources() - shipped)
    assert not missing, f"the wheel leaves out {missing}"
    assert "typedkv/integrations/sglang.py" in shipped
    assert not [name for name in shipped if name.startswith(("tests/", "docs/", "benchmarks/", "examples/"))]
