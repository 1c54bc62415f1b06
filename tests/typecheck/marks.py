"""The ``# E: code [code ...]`` marks of the static case files, shared by the mypy and pyrefly tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

_MARK = re.compile(r"#\s*E:\s*(?P<codes>[a-z][a-z-]*(?:\s+[a-z][a-z-]*)*)\s*$")

# {file: {line: sorted error codes}}
Report = dict[Path, dict[int, list[str]]]

_SHAPE_CODES = frozenset({"bad-argument-type", "bad-return"})


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


def pyrefly_report(json_output: str, root: Path) -> tuple[Report, str]:
    """pyrefly's errors from its ``--output-format json`` output, paths resolved against ``root``,
    and one line per error for failure messages.

    A ``bad-argument-type`` or ``bad-return`` counts only if pyrefly's message speaks
    of tensor shapes (``Tensor[[...]]``); otherwise its code reads ``code(not a shape)``:
    a misuse flagged for another reason would hide a shape the checker no longer reads.
    """
    errors: Report = {}
    lines = []
    for error in json.loads(json_output)["errors"]:
        if error["severity"] != "error":
            continue
        path = (root / error["path"]).resolve()
        code = error["name"]
        if code in _SHAPE_CODES and "Tensor[[" not in error["description"]:
            code += "(not a shape)"
        errors.setdefault(path, {}).setdefault(error["line"], []).append(code)
        lines.append(f"{path.name}:{error['line']}: [{error['name']}] {error['description']}")
    for by_line in errors.values():
        for codes in by_line.values():
            codes.sort()
    return errors, "\n".join(lines)
