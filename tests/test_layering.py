"""Imports inside typedkv point one way: public face -> torch ops -> checked implementation ->
checking -> launch -> kernel, with no circle. Engine adapters (``typedkv/integrations/``) sit
apart: they use the public ``typedkv`` namespace only, and nothing in the core imports them.

Read from the source of every module, subpackages included (every import a module runs, at its
top or inside a function, relative or absolute; imports under ``if TYPE_CHECKING:`` run for type
checkers only and are left out). A module is named by its path in the package, dotted:
``_ops``, ``integrations.sglang``; a package by its ``__init__`` (``__init__`` is ``typedkv``).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "typedkv"
ADAPTERS = "integrations"

# Each core module may import only modules of later layers (or of its own layer, with no circle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "__main__", "_cli"),
    ("_demo", "_bench", "_bench_e2e", "_gpu_state"),
    ("_materializer", "_mla_materializer"),
    ("_projection",),  # what the materializers share
    ("_api", "_rope_tables", "_mla"),  # the public face
    ("_torch_ops",),  # the torch ops
    ("_impl", "_mla_impl", "_fused_impl"),  # the checked implementation
    ("_device_tables", "_value_checks"),
    ("_checking",),
    ("_annotations", "_messages", "_memory"),
    ("_reference", "_launch", "_fused_ws"),
    ("_kernel", "_mla_kernel", "_fused_kernel", "_fused_ws_kernel"),
    ("_epilogue",),  # the jit pieces the kernels share
    ("_config", "_errors", "_types"),
)


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (``_ops``, ``integrations.__init__``)."""
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _resolve(parts: list[str], known: set[str]) -> str:
    """The module that ``typedkv.<parts>`` names: a module, or a package's ``__init__``."""
    dotted = ".".join(parts)
    if dotted in known:
        return dotted
    return ".".join([*parts, "__init__"])


def runtime_imports(source: str, module: str, known: set[str]) -> set[str]:
    """The typedkv modules a module's source imports when it runs.

    ``from typedkv import X`` (or ``from .. import X``) is module ``X`` when X is one,
    else the package itself: a name it exports.
    """
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            # The body is for type checkers; an `else:` branch runs.
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = module.split(".")[:-1]  # the package holding the module, as parts below typedkv
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):  # import typedkv, import typedkv._ops
            for alias in node.names:
                head, *rest = alias.name.split(".")
                if head == "typedkv":
                    found.add(_resolve(rest, known))
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:  # from . import _launch; from .._ops import x; from .. import InputError
            base = package[: len(package) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
        elif node.module and node.module.split(".")[0] == "typedkv":  # from typedkv._ops import x
            target = node.module.split(".")[1:]
        else:
            continue
        for alias in node.names:
            named = ".".join([*target, alias.name])
            found.add(named if named in known else _resolve(target, known))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: runtime_imports(path.read_text(), name, known) - {name} for name, path in modules.items()}


def _is_adapter(module: str) -> bool:
    return module.split(".")[0] == ADAPTERS


def test_every_module_has_a_layer() -> None:
    placed = {name for layer in LAYERS for name in layer}
    core = {name for name in _graph() if not _is_adapter(name)}
    assert core == placed, "a module was added or removed: give it a place in LAYERS (adapters go in integrations/)"


def test_no_import_circle() -> None:
    graphlib.TopologicalSorter(_graph()).static_order()  # raises CycleError on a circle


def test_imports_point_down_the_layers() -> None:
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{module} (layer {rank[module]}) imports {other} (layer {rank[other]})"
        for module, imports in _graph().items()
        if module in rank
        for other in imports
        if other in rank and rank[other] < rank[module]
    ]
    assert not upward, "\n".join(upward)


def test_the_core_never_imports_an_adapter() -> None:
    found = [
        f"{module} imports {other}"
        for module, imports in _graph().items()
        if not _is_adapter(module)
        for other in imports
        if _is_adapter(other)
    ]
    assert not found, "\n".join(found)


def test_adapters_use_the_public_namespace_only() -> None:
    """An adapter may import ``typedkv`` (its re-exports) and other adapters, never ``typedkv._x``."""
    found = [
        f"{module} imports typedkv.{other}"
        for module, imports in _graph().items()
        if _is_adapter(module)
        for other in imports
        if other != "__init__" and not _is_adapter(other)
    ]
    assert not found, "\n".join(found)


def test_the_checker_sees_imports() -> None:
    """The reader itself: _api imports _torch_ops and _impl; _impl imports _launch; the sglang adapter typedkv."""
    graph = _graph()
    assert {"_torch_ops", "_impl"} <= graph["_api"]
    assert "_launch" in graph["_impl"] and "_api" not in graph["_torch_ops"]
    assert graph["integrations.sglang"] == {"__init__"}


def test_the_checker_reads_every_spelling() -> None:
    """Absolute and relative imports, from a subpackage too; TYPE_CHECKING imports left out."""
    known = set(_modules())
    source = """
import typedkv
import typedkv._api
from typedkv import _impl, InputError
from typedkv._checking import Signature
from .. import _launch
from .._kernel import something
from ..integrations import sglang
from . import sglang as again
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from .._torch_ops import hidden
def later():
    from typedkv._reference import rmsnorm_rope
"""
    found = runtime_imports(source, "integrations.example", known)
    assert found == {
        "__init__", "_api", "_impl", "_checking", "_launch", "_kernel", "integrations.sglang", "_reference",
    }  # fmt: skip


# How often a pool-op parameter is written in the core's code (docs/architecture.md's table):
# the public signatures, docstrings and call bundles, and where the checks and kernels use it.
# A pass-through that names it again (a positional forwarding call, a restated declaration)
# raises the count and fails here.
SPELLINGS = {"kv_layout": 7, "v_scale": 10, "k_scale": 10}


def test_pool_parameters_are_spelled_where_they_are_used_only() -> None:
    import re

    core = [path for name, path in _modules().items() if not name.startswith((ADAPTERS, "_bench"))]
    for word, most in SPELLINGS.items():
        pattern = re.compile(rf"\b{word}\b")
        found = {path.name: len(pattern.findall(path.read_text())) for path in core}
        total = sum(found.values())
        where = {name: n for name, n in found.items() if n}
        assert total <= most, f"{word} is spelled {total} times (at most {most}): {where}"
