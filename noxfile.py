"""Developer sessions. They run in the current environment (no virtualenv of
their own): install the project first with
``pip install torch==2.13.0 -e '.[dev]' --config-settings editable_mode=strict``
(CPU) or into the environment that already holds a CUDA torch (GPU machine, no
network needed)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "typecheck", "lint"]

PY = sys.executable
ROOT = Path(__file__).parent
PYREFLY_STUBS = ROOT / ".pyrefly" / "site"


def _pyrefly_stubs(session: nox.Session) -> None:
    """pyrefly-torch-stubs into .pyrefly/site, once (pyproject.toml says why not into the environment).

    Needs the package index the first time only; later runs find them there.
    """
    # The pin is [tool.typedkv]'s (read as text: tomllib is Python 3.11+, typedkv supports 3.10).
    found = re.search(r'^pyrefly-torch-stubs = "(.+==(.+))"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert found, "pyproject.toml: [tool.typedkv] pyrefly-torch-stubs is missing"
    pin, version = found.groups()
    if (PYREFLY_STUBS / f"pyrefly_torch_stubs-{version}.dist-info").is_dir():
        return
    session.run(
        PY, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(PYREFLY_STUBS), pin
    )  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """CPU suite twice: the PyTorch reference path, then the Triton kernel under its interpreter."""
    _pyrefly_stubs(session)
    # The user-project check installs typedkv twice into an environment of its own:
    # `nox -s typecheck` runs it, with the other static checks.
    session.run(PY, "-m", "pytest", "-m", "not gpu", "--ignore=tests/typecheck/test_user_project.py", *session.posargs)
    # The static cases in tests/typecheck do not touch the kernel: run once.
    session.run(
        PY, "-m", "pytest", "-m", "not gpu", "--ignore=tests/typecheck", *session.posargs,
        env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU suite (CUDA numerics, graphs, sync-free check, memcheck); needs a CUDA device."""
    session.run(PY, "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session
def tp(session: nox.Session) -> None:
    """The two-GPU tensor-parallel test; needs two CUDA devices."""
    session.run(PY, "-m", "pytest", "-m", "gpu", "tests/test_tp.py", *session.posargs)


# sglang's DFlash helper, compared against by tests/test_sglang.py: one wheel, fetched without its
# dependencies (only one file of it is loaded, by path). .whl/ carries it to machines without network.
SGLANG_PIN = "sglang==0.5.23"
SGLANG_DIRS = (ROOT / ".whl", ROOT / ".sglang")


def _sglang_wheel(session: nox.Session) -> Path:
    """The pinned sglang wheel: found in .whl/ or .sglang/, else downloaded into .sglang/; fails without one."""
    version = SGLANG_PIN.split("==")[1]
    for folder in SGLANG_DIRS:
        found = sorted(folder.glob(f"sglang-{version}-*.whl"))
        if found:
            return found[0]
    # The wheel is tagged cp311 / manylinux_2_34: ask for that one whatever this interpreter is.
    session.run(
        PY, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64",
        "--dest", str(SGLANG_DIRS[1]), SGLANG_PIN,
    )  # fmt: skip
    found = sorted(SGLANG_DIRS[1].glob(f"sglang-{version}-*.whl"))
    if not found:
        session.error(f"no {SGLANG_PIN} wheel in .whl/ or .sglang/, and none could be downloaded")
    return found[0]


@nox.session
def sglang(session: nox.Session) -> None:
    """typedkv's sglang adapter against sglang's own DFlash helper from the pinned wheel, on CPU (both
    Triton kernels under the interpreter); a missing wheel fails the session instead of skipping."""
    session.log(f"sglang wheel: {_sglang_wheel(session)}")
    session.run(
        PY, "-m", "pytest", "-m", "not gpu", "tests/test_sglang.py", *session.posargs,
        env={"TRITON_INTERPRET": "1", "TYPEDKV_REQUIRE_SGLANG": "1"},
    )  # fmt: skip


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package and the tests, stubs/ checked against the installed
    Triton, pyrefly's shape checker over the shape-correct corpus and the example, and
    the static cases of tests/typecheck (the misuse mypy and pyrefly must flag), the
    static-checking page's recipe from a project outside the checkout included."""
    _pyrefly_stubs(session)
    session.run(PY, "-m", "mypy")
    session.run(
        PY, "-m", "mypy.stubtest", "triton",
        "--mypy-config-file", "pyproject.toml",
        "--allowlist", "stubs/stubtest-allowlist.txt",
        # The stubs declare only what typedkv uses; the rest of Triton is left out.
        "--ignore-missing-stub",
    )  # fmt: skip
    session.run(str(Path(PY).parent / "pyrefly"), "check", "--python-interpreter-path", PY)
    session.run(PY, "-m", "pytest", "tests/typecheck", "-q")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.run(PY, "-m", "ruff", "check", ".")
    session.run(PY, "-m", "ruff", "format", "--check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """mkdocs build --strict of docs/ into site/ (needs the docs extra: pip install -e '.[docs]')."""
    if importlib.util.find_spec("mkdocs") is None:
        session.error("mkdocs is not installed: pip install -e '.[docs]'")
    # NO_MKDOCS_2_WARNING: material's banner about mkdocs 2, printed on every build.
    session.run(PY, "-m", "mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """typedkv bench: sweep T and shapes against the copy roofline; writes JSON and a PNG."""
    session.run(PY, "-m", "typedkv", "bench", *session.posargs, env={"PYTHONUNBUFFERED": "1", **os.environ})
