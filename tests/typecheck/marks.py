"""The ``# E: code [code ...]`` marks of the static case files, shared by the mypy and pyrefly tests."""

from __future__ import annotations

import re
from pathlib import Path

_MARK = re.compile(r"#\s*E:\s*(?P<codes>[a-z][a-z-]*(?:\s+[a-z][a-z-]*)*)\s*$")

# {file: {line: sorted error codes}}
Report = dict[Path, dict[int, list[str]]]


def expected(path: Path) -> dict[int, list[str]]:
    """``{line: sorted codes}`` the checker must report in ``path``; unmarked lines must be clean."""
    marks: dict[int, list[str]] = {}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        found = _MARK.search(text)
        if found:
            marks[number] = sorted(found["codes"].split())
    return marks


def differences(path: Path, got: dict[int, list[str]], checker: str, output: str) -> str | None:
    """``None`` when ``got`` is exactly the marks of ``path``, else a report of each line that differs."""
    want = expected(path)
    if got == want:
        return None
    lines = path.read_text().splitlines()
    problems = []
    for number in sorted(set(got) | set(want)):
        if got.get(number) != want.get(number):
            problems.append(
                f"  line {number}: expected {want.get(number, [])}, {checker} reported {got.get(number, [])}\n"
                f"    {lines[number - 1].strip()}"
            )
    ours = "\n".join(t for t in output.splitlines() if path.name in t)
    return f"{path.name}: {checker}'s errors differ from the '# E:' marks:\n" + "\n".join(problems) + "\n" + ours
