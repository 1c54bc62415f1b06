"""Imports inside typedkv point one way: public face -> torch ops -> checked implementation ->
checking -> launch -> kernel, with no circle.

Read from the source (every import a module runs, at its top or inside a function; imports under
``if TYPE_CHECKING:`` run for type checkers only and are left out).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "typedkv"

# Each module may import only modules of later layers (or of its own layer, with no circle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "__main__", "_cli"),
    ("_demo", "_bench"),
    ("_materializer",),
    ("_api", "_rope_tables"),  # the public face
    ("_torch_ops",),  # the torch ops
    ("_impl",),  # the checked implementation
    ("_device_tables", "_value_checks"),
    ("_checking",),
    ("_annotations", "_messages"),
    ("_reference", "_launch"),
    ("_kernel",),
    ("_config", "_errors", "_types"),
)


def _runtime_imports(path: Path) -> set[str]:
    """The typedkv modules ``path`` imports when it runs."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            # The body is for type checkers; an `else:` branch runs.
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        if node.module is None:  # from . import _launch, _reference
            found.update(alias.name for alias in node.names)
        else:  # from ._checking import Signature
            found.add(node.module.split(".")[0])
    return found


def _graph() -> dict[str, set[str]]:
    return {path.stem: _runtime_imports(path) for path in sorted(PACKAGE.glob("*.py"))}


def test_every_module_has_a_layer() -> None:
    placed = {name for layer in LAYERS for name in layer}
    assert set(_graph()) == placed, "a module was added or removed: give it a place in LAYERS"


def test_no_import_circle() -> None:
    graphlib.TopologicalSorter(_graph()).static_order()  # raises CycleError on a circle


def test_imports_point_down_the_layers() -> None:
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{module} (layer {rank[module]}) imports {other} (layer {rank[other]})"
        for module, imports in _graph().items()
        for other in imports
        if rank[other] < rank[module]
    ]
    assert not upward, "\n".join(upward)


def test_the_checker_sees_imports() -> None:
    """The reader itself: _api imports _torch_ops and _impl; _impl imports _launch."""
    graph = _graph()
    assert {"_torch_ops", "_impl"} <= graph["_api"]
    assert "_launch" in graph["_impl"] and "_api" not in graph["_torch_ops"]
