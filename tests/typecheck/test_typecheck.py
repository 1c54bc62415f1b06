"""The public types at work: mypy --strict must reject misuse and accept the documented calls.

Each ``cases/reject_*.py`` marks the lines mypy must flag with a trailing
``# E: code [code ...]``: exactly those error codes on that line, and no error on
an unmarked line. Every other case file (``accept_*.py`` and their shared inputs)
must check clean.

All case files go through one mypy run, in-process, with the project's config and
cache: torch's stubs dominate the cost, and a warm cache makes the run take seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from marks import Report, differences, expected
from mypy import api

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "cases"
CASE_FILES = sorted(CASES.glob("*.py"))
# The static shape corpus (test_shapes.py): shape misuse is invisible to mypy, so
# every file there, reject_*.py included, must check clean.
SHAPE_FILES = sorted((Path(__file__).resolve().parent / "shapes").glob("*.py"))

_ERROR = re.compile(r"^(?P<path>.+?):(?P<line>\d+): error: (?P<message>.*?)(?:  \[(?P<code>[a-z-]+)\])?$")


@pytest.fixture(scope="module")
def report() -> Iterator[tuple[Report, str]]:
    """mypy's errors in the case files, and its raw output for failure messages."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # mypy_path = "stubs" is relative to the working directory
        stdout, stderr, status = api.run(
            [
                "--config-file", str(ROOT / "pyproject.toml"),
                "--cache-dir", str(ROOT / ".mypy_cache"),
                "--show-absolute-path",
                "--no-pretty",
                "--no-error-summary",
                *map(str, CASE_FILES + SHAPE_FILES),
            ]
        )  # fmt: skip
    assert status in (0, 1) and not stderr, f"mypy failed to run (status {status}):\n{stderr}\n{stdout}"
    errors: Report = {}
    for text in stdout.splitlines():
        found = _ERROR.match(text)
        if found:
            path = Path(found["path"]).resolve()
            line = errors.setdefault(path, {}).setdefault(int(found["line"]), [])
            line.append(found["code"] or "<no code>")
    for lines in errors.values():
        for codes in lines.values():
            codes.sort()
    yield errors, stdout


def test_cases_exist() -> None:
    names = [p.name for p in CASE_FILES]
    assert any(n.startswith("reject_") for n in names) and any(n.startswith("accept_") for n in names), names
    for path in CASE_FILES:
        marked = bool(expected(path))
        assert marked == path.name.startswith("reject_"), f"{path.name}: only reject_*.py files carry '# E:' marks"


@pytest.mark.parametrize("path", CASE_FILES, ids=[p.name for p in CASE_FILES])
def test_case(path: Path, report: tuple[Report, str]) -> None:
    errors, stdout = report
    problem = differences(path, errors.get(path.resolve(), {}), "mypy", stdout)
    if problem:
        pytest.fail(problem)


@pytest.mark.parametrize("path", SHAPE_FILES, ids=[p.name for p in SHAPE_FILES])
def test_shape_corpus_is_mypy_clean(path: Path, report: tuple[Report, str]) -> None:
    """Shape-correct and shape-misusing code alike are well-typed to mypy --strict."""
    errors, stdout = report
    got = errors.get(path.resolve(), {})
    assert not got, f"{path.name}: mypy reports {got}\n" + "\n".join(t for t in stdout.splitlines() if path.name in t)


def test_no_errors_outside_cases(report: tuple[Report, str]) -> None:
    """Errors elsewhere (typedkv, stubs) belong to the main mypy run; they should not be there either."""
    errors, stdout = report
    others = sorted(str(p) for p in errors if p.parent != CASES and p not in SHAPE_FILES)
    assert not others, "mypy reports errors outside tests/typecheck/cases:\n" + "\n".join(
        t for t in stdout.splitlines() if any(o in t for o in others)
    )
