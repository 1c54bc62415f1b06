"""The static shape corpus: pyrefly must flag every marked shape misuse, at its line, and nothing else.

``shapes/reject_*.py`` mark each line pyrefly must flag with ``# E: code ...``
(exactly those codes); ``shapes/accept_shapes.py`` must check clean. A
``bad-argument-type`` or ``bad-return`` counts only if pyrefly's message speaks of
tensor shapes: a misuse flagged for another reason would hide a shape the
checker no longer reads. (mypy --strict must accept the whole corpus:
test_typecheck.py.)

pyrefly runs with the project's ``[tool.pyrefly]`` configuration, which finds
pyrefly-torch-stubs in ``.pyrefly/site`` (installed there by ``nox -s tests`` and
``nox -s typecheck``: docs/static-checking.md says why not into the environment).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from marks import Report, differences, expected

ROOT = Path(__file__).resolve().parents[2]
SHAPES = Path(__file__).resolve().parent / "shapes"
SHAPE_FILES = sorted(SHAPES.glob("*.py"))
STUBS = ROOT / ".pyrefly" / "site"
_SHAPE_CODES = frozenset({"bad-argument-type", "bad-return"})


def _pyrefly() -> str:
    found = shutil.which("pyrefly", path=str(Path(sys.executable).parent)) or shutil.which("pyrefly")
    if found is None:
        pytest.fail("pyrefly is not installed: pip install -e '.[dev]'")
    return found


@pytest.fixture(scope="module")
def report() -> Iterator[tuple[Report, str]]:
    """pyrefly's errors in the corpus (``{file: {line: codes}}``) and its output, for failure messages."""
    if not (STUBS / "torch-stubs").is_dir():
        pytest.fail(f"pyrefly-torch-stubs is not in {STUBS}: run `nox -s typecheck` once (it installs them there)")
    run = subprocess.run(
        [_pyrefly(), "check", "--python-interpreter-path", sys.executable, "--output-format", "json",
         *map(str, SHAPE_FILES)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode in (0, 1), f"pyrefly failed to run (status {run.returncode}):\n{run.stderr}"
    errors: Report = {}
    lines = []
    for error in json.loads(run.stdout)["errors"]:
        if error["severity"] != "error":
            continue
        path = (ROOT / error["path"]).resolve()
        code = error["name"]
        if code in _SHAPE_CODES and "Tensor[[" not in error["description"]:
            code += "(not a shape)"
        errors.setdefault(path, {}).setdefault(error["line"], []).append(code)
        lines.append(f"{path.name}:{error['line']}: [{error['name']}] {error['description']}")
    for by_line in errors.values():
        for codes in by_line.values():
            codes.sort()
    yield errors, "\n".join(lines)


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
