"""The error catalogue (docs/errors.md) against the code, so the two cannot drift.

The catalogue is data: one ``## Title { #id }`` section per error, with

- one or more message templates (```` ```text title="Message" ````), where
  ``{name}`` stands for any text;
- examples: a ```` ```python title="Misuse" ```` block, run after the page's
  ```` ```python title="Setup" ```` block, then the exact message it raises
  (```` ```text title="InputError" ````). A message block with no misuse before
  it is an illustration: checked against the templates, not run.

The tests run every example and compare the message word for word, check that
the most specific template matching it is its own entry's, and check that every
``raise InputError(...)`` in typedkv/*.py is reached by some example, so a new
error without a catalogue entry fails here.

When messages change on purpose, refresh the examples' texts with
``TYPEDKV_UPDATE_CATALOGUE=1 pytest tests/test_error_catalogue.py`` and review
the diff of docs/errors.md; templates are never rewritten.
"""

from __future__ import annotations

import ast
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch

import typedkv

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "docs" / "errors.md"
PACKAGE = ROOT / "typedkv"
UPDATE = os.environ.get("TYPEDKV_UPDATE_CATALOGUE", "") == "1"

_FENCE = re.compile(r'^```(\w+)(?: title="([^"]*)")?[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^## (.+?)(?: \{ #([\w-]+) \})?[ \t]*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{[\w.-]*\}")


@dataclass
class Example:
    entry: str
    code: str | None  # None: an illustration, not run
    message: str

    @property
    def debug(self) -> bool:
        """Whether the misuse turns debug mode on itself (value checks need it)."""
        return self.code is not None and "set_debug(True)" in self.code


@dataclass
class Entry:
    id: str
    title: str
    start: int  # offset of the heading in the page
    body: str
    templates: list[re.Pattern[str]] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)

    def specificity(self, message: str) -> int:
        """Literal characters of the longest template matching ``message`` (-1: none matches)."""
        return max((_literal_len(t) for t in self.templates if t.fullmatch(message)), default=-1)


def _literal_len(template: re.Pattern[str]) -> int:
    return len(_PLACEHOLDER.sub("", template.pattern.replace("\\", "").replace("(.*?)", "")))


def compile_template(text: str) -> re.Pattern[str]:
    """``{name}`` matches any text; everything else matches itself."""
    parts = _PLACEHOLDER.split(text)
    return re.compile("(.*?)".join(re.escape(p) for p in parts), re.DOTALL)


def parse(text: str) -> tuple[str, list[Entry]]:
    """The setup code and the entries of a catalogue page."""
    setups = [m.group(3) for m in _FENCE.finditer(text) if m.group(1) == "python" and m.group(2) == "Setup"]
    assert len(setups) == 1, 'docs/errors.md needs exactly one ```python title="Setup" block'
    headings = list(_HEADING.finditer(text))
    entries = []
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        body = text[heading.end() : end]
        blocks = list(_FENCE.finditer(body))
        templates = [compile_template(m.group(3).rstrip("\n")) for m in blocks if m.group(2) == "Message"]
        if not templates:
            continue  # prose: setup, errors that are not InputError
        assert heading.group(2), f"catalogue entry {heading.group(1)!r} has no {{ #id }} anchor"
        entry = Entry(heading.group(2), heading.group(1), heading.start(), body, templates)
        for j, block in enumerate(blocks):
            if block.group(2) == "Misuse":
                after = blocks[j + 1].group(2) if j + 1 < len(blocks) else None
                assert after == "InputError", (
                    f"catalogue entry {heading.group(2)!r}: a Misuse block with no InputError block after it "
                    "is never run; add the message it raises"
                )
            if block.group(2) != "InputError":
                continue
            before = blocks[j - 1] if j else None
            code = before.group(3) if before is not None and before.group(2) == "Misuse" else None
            entry.examples.append(Example(entry.id, code, block.group(3).rstrip("\n")))
        entries.append(entry)
    return setups[0], entries


SETUP, ENTRIES = parse(CATALOGUE.read_text())
BY_ID = {e.id: e for e in ENTRIES}
RUNNABLE = [ex for e in ENTRIES for ex in e.examples if ex.code is not None]


# ---------------------------------------------------------------- running examples


def _raise_site(tb: TracebackType | None) -> tuple[str, int] | None:
    """Where in typedkv the error was raised: the innermost frame in the package."""
    site = None
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if path.is_relative_to(PACKAGE):
            site = (str(path.relative_to(PACKAGE)), tb.tb_lineno)
        tb = tb.tb_next
    return site


def run(example: Example, debug: bool) -> tuple[str, tuple[str, int] | None]:
    """Run the setup and the misuse; the message and raise site of the InputError it raises."""
    assert example.code is not None
    typedkv.set_debug(debug)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(SETUP, f"{CATALOGUE}:Setup", "exec"), namespace)
        exec(compile(example.code, f"{CATALOGUE}:{example.entry}", "exec"), namespace)
    except typedkv.InputError as err:
        return str(err), _raise_site(err.__traceback__)
    finally:
        typedkv.set_debug(False)
    pytest.fail(f"this misuse of entry {example.entry!r} raised nothing:\n{example.code}")


def _update(example: Example, actual: str) -> None:
    """Replace the example's documented message with ``actual`` in docs/errors.md."""
    assert example.code is not None
    pattern = re.compile(
        "("
        + re.escape(f'```python title="Misuse"\n{example.code}```')
        + r'\s*```text title="InputError"\n)'
        + re.escape(example.message)
        + r"(\n```)"
    )
    text, count = pattern.subn(lambda m: m.group(1) + actual + m.group(2), CATALOGUE.read_text(), count=1)
    assert count == 1, f"could not find the example of {example.entry!r} to update"
    CATALOGUE.write_text(text)
    warnings.warn(f"docs/errors.md: updated the message of an example of {example.entry!r}", stacklevel=2)


def _ids(examples: list[Example]) -> Iterator[str]:
    seen: dict[str, int] = {}
    for ex in examples:
        seen[ex.entry] = seen.get(ex.entry, 0) + 1
        yield f"{ex.entry}-{seen[ex.entry]}"


# ---------------------------------------------------------------- the tests


def test_catalogue_is_well_formed() -> None:
    assert ENTRIES, "no entries found in docs/errors.md"
    assert len(BY_ID) == len(ENTRIES), "two entries share an id"
    index = CATALOGUE.read_text()[: ENTRIES[0].start]
    for entry in ENTRIES:
        assert "**What it means.**" in entry.body, f"{entry.id}: say what the error means"
        assert "**Fix.**" in entry.body, f"{entry.id}: say how to fix it"
        assert entry.examples, f"{entry.id}: give at least one example"
        assert f"(#{entry.id})" in index, f"{entry.id}: link it from the index at the top of the page"


@pytest.mark.parametrize("example", RUNNABLE, ids=list(_ids(RUNNABLE)))
def test_example_raises_the_documented_message(example: Example) -> None:
    """The misuse raises exactly the message shown, in production and in debug mode alike."""
    actual, _ = run(example, debug=example.debug)
    if actual != example.message and UPDATE:
        _update(example, actual)
    else:
        assert actual == example.message
    if not example.debug:
        assert run(example, debug=True)[0] == actual, "debug mode words this misuse differently"


ALL = [ex for e in ENTRIES for ex in e.examples]


@pytest.mark.parametrize("example", ALL, ids=list(_ids(ALL)))
def test_message_finds_its_entry(example: Example) -> None:
    """A reader searching the catalogue with this message lands on this entry: among the
    templates that match it, the most specific one (most literal text) is this entry's."""
    ranked = sorted(((e.specificity(example.message), e.id) for e in ENTRIES), reverse=True)
    assert ranked[0][0] >= 0, f"no template matches:\n{example.message}"
    assert ranked[0][1] == example.entry, (
        f"the message reads as entry {ranked[0][1]!r} before {example.entry!r}: make the templates more specific"
    )
    assert ranked[1][0] < ranked[0][0], f"entries {ranked[0][1]!r} and {ranked[1][1]!r} match it equally"


def raise_sites() -> dict[tuple[str, int], str]:
    """Every ``raise InputError(...)`` in the package: (file, line) -> source line."""
    sites = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ("integrations", "tools"):
            continue  # the adapters' and tools' own errors are not the library's
        source = path.read_text()
        lines = source.splitlines()
        nodes = list(ast.walk(ast.parse(source)))
        raised = {id(n.exc) for n in nodes if isinstance(n, ast.Raise)}
        for node in nodes:
            if isinstance(node, ast.Call) and _names_input_error(node.func):
                assert id(node) in raised, (
                    f"typedkv/{path.relative_to(PACKAGE)}:{node.lineno}: build and raise an InputError in one statement "
                    "(`raise InputError(...)`), so this test can find it"
                )
                source_text = " ".join(line.strip() for line in lines[node.lineno - 1 : node.end_lineno])
                sites[(str(path.relative_to(PACKAGE)), node.lineno)] = source_text[:200]
    return sites


def _names_input_error(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "InputError") or (
        isinstance(func, ast.Attribute) and func.attr == "InputError"
    )


def _internal_debug_annotation() -> tuple[str, tuple[str, int] | None]:
    """The debug pass's own beartype error. Production mode rejects every misuse it
    would catch first, so no public call reaches it; call the check directly."""
    from typedkv.kv import impl as kv_impl

    namespace: dict[str, Any] = {}
    exec(compile(SETUP, f"{CATALOGUE}:Setup", "exec"), namespace)
    ns = namespace
    good = (
        ns["kv"], ns["k_norm_weight"], ns["eps"], ns["cos_sin_cache"], ns["positions"], ns["H"], "neox", None, None, None
    )  # fmt: skip
    bound = kv_impl.check_dense(kv_impl.DenseCall(*good))
    bad = (*good[:4], ns["positions"].float(), *good[5:])  # float positions
    try:
        kv_impl.DENSE.signature.debug_check(bad, bound)
    except typedkv.InputError as err:
        return str(err), _raise_site(err.__traceback__)
    raise AssertionError("the debug pass accepted float positions")


# Raise sites no public misuse reaches, with the entry that documents them and a
# direct trigger. Keep this short: each one is a check that can never fire for users.
INTERNAL: dict[str, Callable[[], tuple[str, tuple[str, int] | None]]] = {
    "debug-annotation": _internal_debug_annotation,
}


@pytest.mark.parametrize("entry", sorted(INTERNAL))
def test_internal_errors_match_their_entry(entry: str) -> None:
    message, _ = INTERNAL[entry]()
    assert BY_ID[entry].specificity(message) >= 0, f"{entry}: no template matches:\n{message}"


def test_every_raise_site_is_catalogued() -> None:
    """Each ``raise InputError`` in the package (its adapters and tools aside) is reached by a catalogue example."""
    sites = raise_sites()
    assert sites, "found no `raise InputError(` in the package"
    reached = {}
    for example in RUNNABLE:
        reached[run(example, debug=example.debug)[1]] = example.entry
    for entry, trigger in INTERNAL.items():
        reached[trigger()[1]] = entry
    missing = {site: line for site, line in sites.items() if site not in reached}
    assert not missing, (
        "errors no catalogue example raises: add an entry or an example to docs/errors.md\n"
        + "\n".join(f"  typedkv/{file}:{line}: {src}" for (file, line), src in sorted(missing.items()))
    )


def test_setup_runs_cleanly() -> None:
    """The page's setup is a valid call: every example breaks exactly one thing."""
    namespace: dict[str, Any] = {}
    exec(compile(SETUP, f"{CATALOGUE}:Setup", "exec"), namespace)
    ns = namespace
    typedkv.set_debug(True)
    try:
        k, v = typedkv.materialize_kv(
            ns["kv"], ns["k_norm_weight"], 1e-6, ns["cos_sin_cache"], ns["positions"], num_kv_heads=ns["H"]
        )
        typedkv.materialize_kv_into_pool(
            ns["kv"], ns["k_norm_weight"], 1e-6, ns["cos_sin_cache"], ns["positions"], ns["cache_loc"],
            ns["k_pool"], ns["v_pool"], num_kv_heads=ns["H"],
        )  # fmt: skip
    finally:
        typedkv.set_debug(False)
    assert k.shape == v.shape == (ns["L"], ns["T"], ns["H"], ns["D"])
    assert isinstance(k, torch.Tensor)
