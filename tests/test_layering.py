"""Imports inside typedkv follow the package's folders, and point one way, with no circle.

- ``core/`` is what every kernel family uses: it imports no family.
- A family (``kv/``, ``mla/``) imports core and itself; ``projection/`` (the materializers) may also use
  the kv and mla families; ``rope`` is core's too.
- ``__init__`` is the table of contents: it imports the public names, from the modules that define them.
- ``tools/`` (bench, demo, command line) is never imported by the library: ``import typedkv`` does not load
  it. It may use the families (a benchmark times the raw kernel launch and the reference beside the ops).
- ``integrations/`` (engine adapters) use the public ``typedkv`` namespace only.

Inside the package, modules are layered (public face -> torch ops -> checked implementation -> checking ->
launch -> kernel): each imports only modules of later layers. Read from the source of every module (every
import a module runs, at its top or inside a function, relative or absolute; imports under
``if TYPE_CHECKING:`` run for type checkers only and are left out). A module is named by its dotted path
in the package: ``kv.api``, ``integrations.sglang``; a package by its ``__init__``.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "typedkv"
ADAPTERS = "integrations"
TOOLS = "tools"
FAMILIES = ("kv", "mla")

# What each folder may import, besides itself ("" is the package's top level: __init__, __main__, rope).
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "kv": {"core"},
    "mla": {"core"},
    "projection": {"core", "kv", "mla"},
    "rope": {"core"},
    TOOLS: {"core", "kv", "mla", "projection", "rope", "__init__"},
}

# Each module may import only modules of later layers (or of its own layer, with no circle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("tools.__init__", "tools.cli"),
    ("tools.bench",),
    ("tools.demo", "tools.host", "tools.plot", "tools.bench_e2e", "tools.drafts"),
    ("tools.cases", "tools.timing", "tools.gpu_state", "tools.draft_shapes"),
    ("__init__",),
    ("projection.__init__", "projection.materializer", "projection.mla_materializer"),
    (
        "projection.paths",
        "projection.dispatch",
        "projection.layers",
        "projection.weights",
    ),  # what the materializers share
    ("kv.__init__", "mla.__init__", "kv.api", "mla.api", "rope"),  # the public face
    ("core.torch_ops",),  # the torch ops
    ("kv.impl", "mla.impl", "projection.fused", "projection.warp_specialized"),  # the checked implementations
    ("core.implementation", "core.device_tables", "core.value_checks"),
    ("core.signature",),
    ("core.checking",),
    ("core.hints", "core.messages", "core.memory"),
    ("kv.reference", "mla.reference", "core.reference"),
    ("kv.launch", "mla.launch", "projection.launch"),
    ("projection.tuning",),
    ("core.launcher", "core.launch_args"),
    ("kv.kernel", "mla.kernel", "projection.kernel", "projection.warp_specialized_kernel"),
    ("core.epilogue",),  # the jit pieces the kernels share
    ("core.__init__", "core.config", "core.errors", "core.tensor_types"),
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
    """The reader itself: kv.api imports the torch ops and kv.impl; kv.impl imports kv.launch; the sglang
    adapter typedkv."""
    graph = _graph()
    assert {"core.torch_ops", "kv.impl"} <= graph["kv.api"]
    assert "kv.launch" in graph["kv.impl"] and "kv.api" not in graph["core.torch_ops"]
    assert graph["integrations.sglang"] == {"__init__", "integrations.sglang_objects"}


def test_the_checker_reads_every_spelling() -> None:
    """Absolute and relative imports, from a subpackage too; TYPE_CHECKING imports left out."""
    known = set(_modules())
    source = """
import typedkv
import typedkv.kv.api
from typedkv import InputError
from typedkv.kv import impl
from typedkv.core.signature import Signature
from ..kv import launch
from ..kv.kernel import something
from ..integrations import sglang
from . import sglang as again
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from ..core.torch_ops import hidden
def later():
    from typedkv.kv.reference import rmsnorm_rope
"""
    found = runtime_imports(source, "integrations.example", known)
    assert found == {
        "__init__", "kv.api", "kv.impl", "core.signature", "kv.launch", "kv.kernel", "integrations.sglang",
        "kv.reference",
    }  # fmt: skip


# How often a pool-op parameter is written in the core's code (docs/architecture.md's table):
# the public signatures, docstrings and call bundles, and where the checks and kernels use it.
# A pass-through that names it again (a positional forwarding call, a restated declaration)
# raises the count and fails here.
SPELLINGS = {"kv_layout": 7, "v_scale": 10, "k_scale": 10, "k_scale_out": 18, "v_scale_out": 18}


def test_pool_parameters_are_spelled_where_they_are_used_only() -> None:
    import re

    core = [path for name, path in _modules().items() if not name.startswith((ADAPTERS, TOOLS))]
    for word, most in SPELLINGS.items():
        pattern = re.compile(rf"\b{word}\b")
        found = {path.name: len(pattern.findall(path.read_text())) for path in core}
        total = sum(found.values())
        where = {name: n for name, n in found.items() if n}
        assert total <= most, f"{word} is spelled {total} times (at most {most}): {where}"


def _folder(module: str) -> str:
    """The folder a module lives in ("" for the top level), ``rope`` standing for itself."""
    head = module.split(".")[0]
    return head if "." in module or head == "rope" else ""


def test_folders_import_only_what_they_may() -> None:
    found = [
        f"{module} imports {other}"
        for module, imports in _graph().items()
        if _folder(module) in MAY_IMPORT
        for other in imports
        if _folder(other) != _folder(module)
        and _folder(other) not in MAY_IMPORT[_folder(module)]
        and not (other == "__init__" and "__init__" in MAY_IMPORT[_folder(module)])
    ]
    assert not found, "\n".join(found)


def test_the_families_do_not_import_each_other() -> None:
    found = [
        f"{module} imports {other}"
        for module, imports in _graph().items()
        if _folder(module) in FAMILIES
        for other in imports
        if _folder(other) in FAMILIES and _folder(other) != _folder(module)
    ]
    assert not found, "\n".join(found)


def test_nothing_in_the_library_imports_the_tools() -> None:
    found = [
        f"{module} imports {other}"
        for module, imports in _graph().items()
        if _folder(module) != TOOLS and module != "__main__"
        for other in imports
        if _folder(other) == TOOLS
    ]
    assert not found, "\n".join(found)


def test_import_typedkv_loads_no_tool() -> None:
    """What the graph says, seen in a fresh interpreter: the tools are not loaded by ``import typedkv``."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, typedkv; print(sorted(m for m in sys.modules if m.startswith('typedkv')))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "typedkv.tools" not in loaded and "typedkv.kv.api" in loaded


# The sizes a reader meets first, kept small: kernel modules aside (a kernel reads best whole), no package
# module holds more than this many lines; the README and the performance page stay pages, not logs; the
# benchmarks folder holds maintained tools only (each in benchmarks/README.md); a decision record is short.
MODULE_LINES = 500
KERNEL_MODULES = {"kv.kernel", "mla.kernel", "projection.kernel", "projection.warp_specialized_kernel"}
PAGE_LINES = {"README.md": 150, "docs/performance.md": 400}
BENCHMARK_FILES = 10
DECISION_LINES = 60


def test_modules_pages_and_benchmarks_stay_small() -> None:
    root = PACKAGE.parent
    long = {
        name: n
        for name, path in _modules().items()
        if name not in KERNEL_MODULES and (n := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"package modules over {MODULE_LINES} lines (split them by what they do): {long}"
    pages = {page: len((root / page).read_text().splitlines()) for page in PAGE_LINES}
    assert all(pages[page] <= most for page, most in PAGE_LINES.items()), (pages, PAGE_LINES)
    records = {p.name: len(p.read_text().splitlines()) for p in (root / "docs" / "decisions").glob("*.md")}
    assert records and all(n <= DECISION_LINES for n in records.values()), records
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=root, capture_output=True, text=True, check=False)
    files = tracked.stdout.split() if tracked.returncode == 0 else [p.name for p in (root / "benchmarks").iterdir()]
    assert len(files) <= BENCHMARK_FILES, files
    readme = (root / "benchmarks" / "README.md").read_text()
    assert all(Path(f).name in readme for f in files if Path(f).name != "README.md"), "undocumented benchmark files"
