"""The static shape corpus: pyrefly must flag every marked shape misuse, at its line, and nothing else.

``shapes/reject_*.py`` mark each line pyrefly must flag with ``# E: code ...``
(exactly those codes, shape messages only: `marks.pyrefly_report`);
``shapes/accept_shapes.py`` must check clean. (mypy --strict must accept the
whole corpus: test_typecheck.py.)

pyrefly runs with the project's ``[tool.pyrefly]`` configuration, which finds
pyrefly-torch-stubs in ``.pyrefly/site`` (installed there by ``nox -s tests`` and
``nox -s typecheck``: docs/static-checking.md says why not into the environment).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from marks import Report, differences, expected, pyrefly_report

ROOT = Path(__file__).resolve().parents[2]
SHAPES = Path(__file__).resolve().parent / "shapes"
SHAPE_FILES = sorted(SHAPES.glob("*.py"))
STUBS = ROOT / ".pyrefly" / "site"


def _pyrefly() -> str:
    found = shutil.which("pyrefly", path=str(Path(sys.executable).parent)) or shutil.which("pyrefly")
    if found is None:
        pytest.fail("pyrefly is not installed: pip install -e '.[dev]'")
    return found


@pytest.fixture(scope="module")
def report() -> tuple[Report, str]:
    """pyrefly's errors in the corpus (``{file: {line: codes}}``) and its output, for failure messages."""
    if not (STUBS / "torch-stubs").is_dir():
        pytest.fail(f"pyrefly-torch-stubs is not in {STUBS}: run `nox -s typecheck` once (it installs them there)")
    run = subprocess.run(
        [_pyrefly(), "check", "--python-interpreter-path", sys.executable, "--output-format", "json",
         *map(str, SHAPE_FILES)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode in (0, 1), f"pyrefly failed to run (status {run.returncode}):\n{run.stderr}"
    return pyrefly_report(run.stdout, ROOT)


def test_corpus_exists() -> None:
    names = [p.name for p in SHAPE_FILES]
    assert "accept_shapes.py" in names and sum(n.startswith("reject_") for n in names) >= 2, names
    for path in SHAPE_FILES:
        assert bool(expected(path)) == path.name.startswith("reject_"), f"{path.name}: only reject_*.py carry marks"


@pytest.mark.parametrize("path", SHAPE_FILES, ids=[p.name for p in SHAPE_FILES])
def test_shapes(path: Path, report: tuple[Report, str]) -> None:
    errors, output = report
    problem = differences(path, errors.get(path.resolve(), {}), "pyrefly", output)
    if problem:
        pytest.fail(problem)


def test_pinned_together() -> None:
    """pyrefly, its shape extensions and its torch stubs are released in lockstep: one version of the three."""
    version = subprocess.run([_pyrefly(), "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
    stubs = [metadata.Distribution.at(p) for p in STUBS.glob("pyrefly_torch_stubs-*.dist-info")]
    assert len(stubs) == 1, f"expected one pyrefly-torch-stubs in {STUBS}, found {len(stubs)}"
    assert {version, metadata.version("pyrefly-shape-extensions"), stubs[0].version} == {version}, (
        version,
        metadata.version("pyrefly-shape-extensions"),
        stubs[0].version,
    )
