"""The documentation against the code: commands, docstrings, pages and the site build.

- ``typedkv --help`` and ``python -m typedkv --help`` list the commands;
- every public name has a numpy-style docstring that documents each parameter, with a shape and
  a dtype for tensors, and what it returns; ``help()`` on a materializer shows its own
  constructor docs (its examples run in tests/test_examples.py);
- docs/api.md renders exactly the public names;
- the Quickstart's code runs as written (and its demo output is what the demo prints), every
  Python block of the docs parses, and the guide's tensor-parallel sharding is right;
- ``mkdocs build --strict`` succeeds, when mkdocs is installed (the ``docs`` extra). The build
  takes a few seconds, so it stays in the default run.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import pydoc
import re
import shutil
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import typedkv

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_FENCE = re.compile(r'^```(\w+)(?: title="([^"]*)")?[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)


def code_blocks(page: str, language: str = "python") -> list[str]:
    """The top-level fenced blocks of a docs page in one language, in order."""
    return [m.group(3) for m in _FENCE.finditer((DOCS / page).read_text()) if m.group(1) == language]


# --------------------------------------------------------------------------- the command line


def _console_script() -> str:
    script = Path(sys.executable).parent / "typedkv"
    found = str(script) if script.exists() else shutil.which("typedkv")
    if found is None:
        pytest.skip("the typedkv console script is not installed (pip install -e .)")
    return found


@pytest.mark.parametrize("command", ["typedkv", "python -m typedkv"])
def test_help_lists_the_commands(command: str) -> None:
    argv = [_console_script()] if command == "typedkv" else [sys.executable, "-m", "typedkv"]
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("demo", "bench"):
        assert re.search(rf"^\s+{name}\s", result.stdout, re.MULTILINE), f"{name!r} missing from:\n{result.stdout}"


def test_bench_help_shows_the_documented_options() -> None:
    """docs/performance.md's option table is what ``typedkv bench --help`` offers."""
    result = subprocess.run([sys.executable, "-m", "typedkv", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    documented = re.findall(r"^\| `(--[\w-]+)", (DOCS / "performance.md").read_text(), re.MULTILINE)
    offered = re.findall(r"(--[\w-]+)", result.stdout)
    assert documented and set(documented) == set(offered) - {"--help"}


# --------------------------------------------------------------------------- docstrings

_SECTION = re.compile(r"^(\w[\w ]*)\n-{3,}\n", re.MULTILINE)


def sections(doc: str) -> dict[str, str]:
    """A numpy-style docstring's sections by title ("Parameters", "Returns", ...)."""
    found = list(_SECTION.finditer(doc))
    return {
        m.group(1): doc[m.end() : found[i + 1].start() if i + 1 < len(found) else len(doc)] for i, m in enumerate(found)
    }


def items(section: str) -> dict[str, str]:
    """``name[, name] : type`` entries at the left margin -> the entry's whole text, per name."""
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in section.splitlines():
        if line and not line[0].isspace():
            names = [n.strip() for n in line.split(" : ", 1)[0].split(",")]
            for name in names:
                entries[name] = line
        elif line.strip():
            for name in names:
                entries[name] += "\n" + line
    return entries


_SHAPE = re.compile(r"\[[^\]]*\]")
_DTYPE = re.compile(r"float|int32|int64|dtype")
_DELEGATES = re.compile(r"\b[Aa]s in\b|\bsame\b")


def check_callable(name: str, fn: Callable[..., Any]) -> list[str]:
    """What the docstring of ``fn`` lacks: parameters, shapes and dtypes of tensors, returns."""
    return check_docstring(name, inspect.getdoc(fn) or "", inspect.signature(fn))


def check_docstring(name: str, doc: str, signature: inspect.Signature) -> list[str]:
    """What ``doc`` lacks to document ``signature``."""
    if not doc:
        return [f"{name}: no docstring"]
    problems = []
    found = sections(doc)
    documented = items(found.get("Parameters", ""))
    for param in signature.parameters.values():
        if param.name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        entry = documented.get(param.name)
        if entry is None:
            problems.append(f"{name}: parameter {param.name!r} is not in a numpy-style Parameters section")
        elif "Tensor" in str(param.annotation) and not _DELEGATES.search(entry):
            if not _SHAPE.search(entry):
                problems.append(f"{name}: parameter {param.name!r} is a tensor: give its shape, [T, L, ...]")
            if not _DTYPE.search(entry):
                problems.append(f"{name}: parameter {param.name!r} is a tensor: give its dtypes")
    returns = signature.return_annotation
    if returns not in (None, "None", inspect.Signature.empty) and not name.endswith("__init__"):
        if "Returns" not in found:
            problems.append(f"{name}: returns {returns}: add a Returns section")
        elif "Tensor" in str(returns) and not _SHAPE.search(found["Returns"]):
            problems.append(f"{name}: returns tensors: give their shapes")
    return problems


def _attribute_docstring(name: str) -> str | None:
    """The string literal after a module-level ``name = ...`` in the package (a type alias's docs)."""
    for path in sorted((ROOT / "typedkv").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        for node, after in itertools.pairwise(body):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    return str(after.value.value)
    return None


def _own_public_methods(cls: type) -> list[str]:
    """Methods the class adds to its API: defined in it, public, and not overriding a base's
    (``forward`` always: it is what calling an ``nn.Module`` runs)."""
    inherited = {n for base in cls.__mro__[1:] for n in vars(base)}
    return [
        n
        for n, v in vars(cls).items()
        if callable(v) and not n.startswith("_") and (n not in inherited or n == "forward")
    ]


@pytest.mark.parametrize("name", typedkv.__all__)
def test_public_name_has_a_numpy_docstring(name: str) -> None:
    obj = getattr(typedkv, name)
    problems: list[str] = []
    if inspect.isclass(obj):
        if not inspect.getdoc(obj):
            problems.append(f"{name}: no docstring")
        init = vars(obj).get("__init__")
        if init is not None and len(inspect.signature(init).parameters) > 1:
            # numpydoc documents the constructor's parameters in the class docstring.
            doc = (inspect.getdoc(obj) or "") + "\n\n" + (inspect.getdoc(init) or "")
            problems += check_docstring(f"{name}.__init__", doc, inspect.signature(init))
        for method in _own_public_methods(obj):
            problems += check_callable(f"{name}.{method}", getattr(obj, method))
    elif callable(obj) and not typing.get_origin(obj):
        problems += check_callable(name, obj)
    else:  # a type alias: documented by the string after its assignment
        if not _attribute_docstring(name):
            problems.append(f"{name}: add a docstring (a string literal right after the assignment)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cls", [typedkv.KVMaterializer, typedkv.MLAKVMaterializer], ids=lambda c: c.__name__)
def test_help_shows_the_constructors_own_docstring(cls: Any) -> None:
    """``help(cls)`` and ``help(cls.__init__)`` show typedkv's constructor docs, not nn.Module's."""
    own = vars(cls)["__init__"].__doc__
    assert own, f"{cls.__name__}.__init__: give it a docstring (else help() shows nn.Module's)"
    assert inspect.getdoc(cls.__init__) == inspect.cleandoc(own)
    page = pydoc.render_doc(cls)
    assert inspect.cleandoc(own).splitlines()[0] in page
    # nn.Module.__init__'s own first line, as written (torch.compile's tests may wrap the method, doc and all).
    assert "Initialize internal Module state" not in page


def test_api_reference_renders_exactly_the_public_names() -> None:
    rendered = re.findall(r"^::: typedkv\.(\w+)", (DOCS / "api.md").read_text(), re.MULTILINE)
    assert sorted(rendered) == sorted(typedkv.__all__), "docs/api.md needs one `::: typedkv.NAME` per public name"


# --------------------------------------------------------------------------- pages


def test_every_python_block_parses() -> None:
    for page in sorted(DOCS.glob("*.md")):
        for block in code_blocks(page.name):
            try:
                ast.parse(block)
            except SyntaxError as err:
                pytest.fail(f"docs/{page.name}: a Python block does not parse: {err}\n{block}")


def test_quickstart_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """Steps 3 to 5 of the Quickstart, in order, in one namespace; the messages its comments
    promise are the ones printed."""
    typedkv.set_debug(False)
    namespace: dict[str, Any] = {}
    for block in code_blocks("quickstart.md"):
        exec(compile(block, str(DOCS / "quickstart.md"), "exec"), namespace)
    printed = capsys.readouterr().out
    for block in code_blocks("quickstart.md"):
        for promised in re.findall(r"print\(err\)\s+# (.+)$", block, re.MULTILINE):
            assert promised in printed


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="the Quickstart shows the demo's output on a CPU machine without the interpreter",
)
def test_quickstart_shows_what_the_demo_prints() -> None:
    shown = next(b for b in code_blocks("quickstart.md", "text") if b.startswith("typedkv demo:"))
    result = subprocess.run([sys.executable, "-m", "typedkv", "demo"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert len(printed) == len(shown.splitlines())
    for want, got in zip(shown.splitlines(), printed, strict=True):
        assert re.fullmatch(".*".join(map(re.escape, want.split("..."))), got), f"shown: {want}\nprinted: {got}"


def test_tensor_parallel_sharding_in_the_guide() -> None:
    """integration.md's `local_kv_weight`: each rank's KVMaterializer gives that rank's heads."""
    (block,) = [b for b in code_blocks("integration.md") if "def local_kv_weight" in b]
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOCS / "integration.md"), "exec"), namespace)
    local_kv_weight = namespace["local_kv_weight"]
    gen = torch.Generator().manual_seed(0)
    L, H, D, hidden_size, T, tp = 2, 4, 16, 32, 6, 2
    kv_weight = torch.randn(L, 2 * H * D, hidden_size, generator=gen)
    k_norm_weight = torch.rand(L, D, generator=gen) + 0.5
    cos_sin_cache = torch.randn(64, D, generator=gen)
    hidden = torch.randn(T, hidden_size, generator=gen)
    positions = torch.randint(0, 64, (T,), generator=gen)
    k, v = typedkv.KVMaterializer(kv_weight, k_norm_weight, 1e-6, cos_sin_cache, num_kv_heads=H)(hidden, positions)
    for rank in range(tp):
        local = [local_kv_weight(w, rank, tp, H, D) for w in kv_weight]
        m = typedkv.KVMaterializer(local, k_norm_weight, 1e-6, cos_sin_cache, num_kv_heads=H // tp)
        k_rank, v_rank = m(hidden, positions)
        heads = slice(rank * H // tp, (rank + 1) * H // tp)
        torch.testing.assert_close(k_rank, k[:, :, heads])
        torch.testing.assert_close(v_rank, v[:, :, heads])


def titled_blocks(page: str) -> dict[str, str]:
    """The titled Python blocks of a docs page, by title."""
    found = _FENCE.finditer((DOCS / page).read_text())
    return {m.group(2): m.group(3) for m in found if m.group(1) == "python" and m.group(2)}


# Per engine snippet: K and V of layer i at slot s, read back through the engine's own indexing.
_ENGINE_SLOTS: dict[str, Callable[[dict[str, Any], int, int, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "sglang: per-layer token pools": lambda ns, i, s, b: (ns["k_buffer"][i][s], ns["v_buffer"][i][s]),
    "vLLM: flash-attention layout": lambda ns, i, s, b: (
        ns["kv_caches"][i][0, s // b, s % b],
        ns["kv_caches"][i][1, s // b, s % b],
    ),
    "vLLM and FlashInfer: FlashInfer's NHD layout": lambda ns, i, s, b: (
        ns["kv_caches"][i][s // b, 0, s % b],
        ns["kv_caches"][i][s // b, 1, s % b],
    ),
    "FlashInfer: HND layout": lambda ns, i, s, b: (
        ns["kv_caches"][i][s // b, 0, :, s % b],
        ns["kv_caches"][i][s // b, 1, :, s % b],
    ),
    "One HND cache for all draft layers": lambda ns, i, s, b: (
        ns["kv_cache"][i, s // b, 0, :, s % b],
        ns["kv_cache"][i, s // b, 1, :, s % b],
    ),
}


def test_every_engine_snippet_is_run() -> None:
    blocks = titled_blocks("integration.md")
    assert set(_ENGINE_SLOTS) <= set(blocks), "a snippet of the guide's engine section is missing"
    assert {t for t in blocks if t not in _ENGINE_SLOTS} == set(), "a titled snippet no test runs"


@pytest.mark.parametrize("title", list(_ENGINE_SLOTS))
def test_engine_cache_snippet(title: str) -> None:
    """integration.md's snippet for one engine layout writes exactly materialize_kv's rows at the named slots."""
    block = titled_blocks("integration.md")[title]
    gen = torch.Generator().manual_seed(len(title))
    L, N, B, H, D, P, T = 3, 5, 4, 2, 16, 64, 9
    angles = torch.rand(P, D // 2, generator=gen) * 6.2
    kv = torch.randn(T, L, 2 * H * D, generator=gen).to(torch.bfloat16)
    cache_loc = torch.randperm(N * B, generator=gen)[:T]
    cache_loc[2] = -1  # padding: not written
    namespace: dict[str, Any] = {
        "torch": torch, "typedkv": typedkv, "num_layers": L, "num_pages": N, "page_size": B,
        "num_kv_heads": H, "head_dim": D, "dtype": torch.bfloat16, "device": "cpu", "kv": kv,
        "k_norm_weight": torch.rand(L, D, generator=gen) + 0.5, "eps": 1e-6,
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1),
        "positions": torch.randint(0, P, (T,), generator=gen), "cache_loc": cache_loc,
    }  # fmt: skip
    k, v = typedkv.materialize_kv(
        kv, namespace["k_norm_weight"], 1e-6, namespace["cos_sin_cache"], namespace["positions"], num_kv_heads=H
    )
    exec(compile(block, f"{DOCS / 'integration.md'}:{title}", "exec"), namespace)
    slots = cache_loc.tolist()
    for layer in range(L):
        for slot in range(N * B):
            k_got, v_got = _ENGINE_SLOTS[title](namespace, layer, slot, B)
            if slot in slots:
                token = slots.index(slot)
                assert torch.equal(k_got, k[layer, token]) and torch.equal(v_got, v[layer, token]), (layer, slot)
            else:
                assert not k_got.any() and not v_got.any(), f"slot {slot} of layer {layer} was written"


@pytest.mark.gpu
def test_cuda_graph_recipe_in_the_guide() -> None:
    """integration.md's CUDA-graph recipe captures, replays, and writes what an eager call writes."""
    (block,) = [b for b in code_blocks("integration.md") if "torch.cuda.CUDAGraph()" in b]
    gen = torch.Generator().manual_seed(0)
    L, H, D, S, P, n = 3, 2, 128, 256, 512, 40
    angles = torch.rand(P, D // 2, generator=gen) * 6.2
    setup: dict[str, Any] = {
        "torch": torch,
        "typedkv": typedkv,
        "L": L,
        "H": H,
        "D": D,
        "k_norm_weight": (torch.rand(L, D, generator=gen) + 0.5).cuda(),
        "eps": 1e-6,
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1).cuda(),
        "k_pool": torch.zeros(L, S, H, D, dtype=torch.bfloat16, device="cuda"),
        "v_pool": torch.zeros(L, S, H, D, dtype=torch.bfloat16, device="cuda"),
        "kv": torch.randn(n, L, 2 * H * D, generator=gen).to("cuda", torch.bfloat16),
        "positions": torch.randint(0, P, (n,), generator=gen).cuda(),
        "cache_loc": torch.randperm(S, generator=gen)[:n].cuda(),
    }
    exec(compile(block, str(DOCS / "integration.md"), "exec"), setup)
    torch.cuda.synchronize()
    k_want = torch.zeros_like(setup["k_pool"])
    v_want = torch.zeros_like(setup["v_pool"])
    typedkv.materialize_kv_into_pool(
        setup["kv"], setup["k_norm_weight"], 1e-6, setup["cos_sin_cache"], setup["positions"], setup["cache_loc"],
        k_want, v_want, num_kv_heads=H,
    )  # fmt: skip
    assert torch.equal(setup["k_pool"].view(torch.int16), k_want.view(torch.int16))
    assert torch.equal(setup["v_pool"].view(torch.int16), v_want.view(torch.int16))


# --------------------------------------------------------------------------- the site


def test_docs_build_strictly(tmp_path: Path) -> None:
    """``nox -s docs`` in a test: broken links, anchors, references or docstrings fail it."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "errors" / "index.html").exists()


def test_readme_lists_every_nox_session() -> None:
    """One line per session in the README's developer section (the issue's "each with one line")."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    sessions = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("nox.session" in ast.unparse(d) for d in node.decorator_list)
    ]
    readme = (ROOT / "README.md").read_text()
    missing = [s for s in sessions if not re.search(rf"^- `nox -s {s}`", readme, re.MULTILINE)]
    assert not missing, f"README.md lists no `nox -s` line for: {missing}"


def test_reliability_page_counts_the_fuzz_misuses() -> None:
    """docs/reliability.md says how many kinds of misuse the fuzz suite mixes in: the number it has."""
    import test_fuzz

    page = (DOCS / "reliability.md").read_text()
    said = re.findall(r"(\d+) kinds of misuse", page)
    assert said == [str(len(test_fuzz.MUTATIONS))], (
        f"the page says {said}, tests/test_fuzz.py has {len(test_fuzz.MUTATIONS)}"
    )
