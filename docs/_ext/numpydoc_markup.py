"""A griffe extension for the API reference: numpydoc's reStructuredText markup as Markdown.

typedkv's docstrings follow the numpydoc convention, which reads well in
``help()``: ``double backticks`` for code and ``:func:`name``` roles for
cross-references. mkdocstrings renders docstrings as Markdown, where both show
up as literal markup. This extension rewrites them before rendering, and
splits a group of parameters documented together (``kv, eps`` with no type),
which griffe would otherwise show with the first one's annotation for all.

Loaded from mkdocs.yml (``extensions:`` of the python handler); not part of
the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|obj|mod|exc):`(~?)([\w.]+)`")
_LITERAL = re.compile(r"(?<!`)``(?!`)(.+?)(?<!`)``(?!`)")
_TYPED_ITEM = re.compile(r"^(\S[^\n]*? : )([^\n]*)$", re.MULTILINE)  # "name : type" at the left margin
_SECTION = re.compile(r"^(Parameters|Other Parameters)\n-+\n", re.MULTILINE)


class NumpydocMarkup(griffe.Extension):
    """Rewrite every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = {name for name in pkg.members if not name.startswith("_")}
        for obj in _walk(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = _markdown(obj.docstring.value, pkg.name, public)


def _walk(obj: griffe.Object, seen: set[str]) -> list[griffe.Object]:
    if obj.path in seen:
        return []
    seen.add(obj.path)
    found = [obj]
    for member in obj.members.values():
        if isinstance(member, griffe.Alias):
            continue  # documented where it is defined
        found += _walk(member, seen)
    return found


def _markdown(text: str, package: str, public: set[str]) -> str:
    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target
        head = target.split(".", 1)[0]
        if head in public:
            return f"[`{shown}`][{package}.{target}]"
        if head == package:
            return f"[`{shown}`][{target}]"
        return f"`{shown}`"

    text = _LITERAL.sub(r"`\1`", _ROLE.sub(role, text))
    text = _TYPED_ITEM.sub(lambda m: m.group(1) + _plain_type(m.group(2)), text)
    return _split_grouped_parameters(text)


def _plain_type(text: str) -> str:
    """A docstring type as griffe should show it: as written, without markup."""
    # It is shown as code already: markup inside it would show literally.
    text = text.replace("`", "")
    if text.startswith("{"):
        # A set of choices ({"neox", "gptj"}): griffe takes the first as the default, split at ", ".
        return text
    # griffe re-renders a type that parses as Python: "Tensor, shape [T], int32 | int64" would
    # come out as a tuple. No-break spaces (which look the same) keep it from parsing.
    if " " in text:
        try:
            compile(text, "<type>", "eval")
        except SyntaxError:
            return text
        return text.replace(" ", "\u00a0")
    return text


def _split_grouped_parameters(text: str) -> str:
    """``a, b`` (no `` : type``) followed by a description -> one entry per name."""
    match = _SECTION.search(text)
    if match is None:
        return text
    start = match.end()
    lines = text[start:].split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        j = i + 1
        while j < len(lines) and lines[j].startswith((" ", "\t")):
            j += 1
        if not line.startswith(" ") and " : " not in line and ", " in line:
            for name in line.split(", "):
                out += [name.strip(), *lines[i + 1 : j]]
        else:
            out += lines[i:j]
        i = j
    return text[:start] + "\n".join(out + lines[i:])
