"""The public surface is a contract: names, signatures and torch op schemas stay as recorded.

``tests/data/public_surface.json`` was taken from the package before its modules moved into
family folders; a move of code must leave everything here equal. A deliberate change of the API
regenerates it (``python tests/test_public_surface.py``) in the same commit that changes the API.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

import typedkv
import typedkv.integrations.sglang

SNAPSHOT = Path(__file__).parent / "data" / "public_surface.json"


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


def _members(cls: type) -> dict[str, str]:
    """A class's public methods and properties, each with its signature."""
    found: dict[str, str] = {}
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, property):
            found[name] = "<property>"
        elif callable(value):
            found[name] = _signature(value)
    return dict(sorted(found.items()))


def _surface_of(module: Any, names: list[str]) -> dict[str, Any]:
    surface: dict[str, Any] = {}
    for name in names:
        value = getattr(module, name)
        if inspect.isclass(value):
            surface[name] = {"class": _signature(value), "members": _members(value)}
        elif callable(value) and not hasattr(value, "__origin__"):
            surface[name] = _signature(value)
        else:
            surface[name] = repr(value)
    return surface


def _op_schemas() -> dict[str, list[str]]:
    namespace = torch.ops.typedkv
    schemas: dict[str, list[str]] = {}
    for name in sorted(dir(namespace)):
        packet = getattr(namespace, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        overloads: list[str] = packet.overloads()  # type: ignore[no-untyped-call]
        schemas[name] = sorted(str(getattr(packet, overload)._schema) for overload in overloads)
    return schemas


def current() -> dict[str, Any]:
    """The surface as the installed package shows it now."""
    sglang = typedkv.integrations.sglang
    sglang_names = sorted(getattr(sglang, "__all__", [n for n in vars(sglang) if not n.startswith("_")]))
    return {
        "__all__": sorted(typedkv.__all__),
        "typedkv": _surface_of(typedkv, sorted(typedkv.__all__)),
        "typedkv.integrations.sglang": _surface_of(sglang, sglang_names),
        "torch.ops.typedkv": _op_schemas(),
    }


def test_public_surface_is_unchanged() -> None:
    recorded = json.loads(SNAPSHOT.read_text())
    now = current()
    for section in recorded:
        assert now[section] == recorded[section], f"{section} changed"
    assert set(now) == set(recorded)


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    sys.stdout.write(f"wrote {SNAPSHOT}\n")
