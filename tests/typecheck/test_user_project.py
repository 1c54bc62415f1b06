"""docs/static-checking.md's recipe, from a user's project: typedkv installed, the project elsewhere.

A project directory and a virtual environment side by side in a temporary directory, both outside
the checkout (a configuration of the checkout's must not be what makes it work). The project holds
the page's pyproject.toml (its ``toml`` block), the torch stubs in ``.pyrefly/site`` and
``user_project/drafts.py``: the page's example, then misuse marked ``# E: code``. typedkv goes
into the environment the two ways a user installs it: built from the checkout (``pip install``),
then editable (``pip install -e`` in setuptools' strict mode, as the docs give it). Each way:

- only ``typedkv`` is importable: not the checkout's ``tests``, ``benchmarks`` or ``examples``;

- pyrefly flags exactly the marked lines, with shape messages (`marks.pyrefly_report`), run the two
  ways the page gives: ``pyrefly check`` with no file names, and ``pyrefly check -c pyproject.toml
  drafts.py``;
- ``mypy --strict drafts.py`` finds typedkv and reports nothing (shapes are invisible to it).

The environment reuses this one's packages (torch, jaxtyping, pyrefly-shape-extensions) through a
path file, so nothing is downloaded; typedkv itself is a real install of the checkout into it.
``nox -s typecheck`` runs this; ``nox -s tests`` leaves it out (it builds typedkv twice).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from marks import differences, pyrefly_report

ROOT = Path(__file__).resolve().parents[2]
DRAFT = Path(__file__).resolve().parent / "user_project" / "drafts.py"
PAGE = ROOT / "docs" / "static-checking.md"
STUBS = ROOT / ".pyrefly" / "site"
PYREFLY = Path(sys.executable).parent / "pyrefly"


def _block(language: str) -> str:
    """The page's first fenced block in ``language``."""
    found = re.search(rf"^```{language}\n(.*?)^```$", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert found, f"{PAGE.name} has no {language} block"
    return found.group(1)


def _run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(map(str, command)), cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def _pip(python: Path, *args: str | Path) -> None:
    # This environment's pip, pointed at the other interpreter: the user's environment needs none.
    run = _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", *args, cwd=ROOT)
    assert run.returncode == 0, f"pip install {' '.join(map(str, args))} failed:\n{run.stdout}\n{run.stderr}"


@pytest.fixture(scope="module")
def env_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment outside the checkout that sees this one's packages but not its typedkv."""
    env = tmp_path_factory.mktemp("user") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=env).stdout.strip())
    # A plain path file is not read for further path files, so this environment's own typedkv
    # (an editable install's path file) stays out; named to come after typedkv's own path file.
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "reuse_packages.pth").write_text("".join(f"{path}\n" for path in ours))
    return python


@pytest.fixture(scope="module")
def project(env_python: Path) -> Path:
    """The user's project: the page's configuration, the torch stubs where the page puts them, the example."""
    if not (STUBS / "torch-stubs").is_dir():
        pytest.fail(f"pyrefly-torch-stubs is not in {STUBS}: run `nox -s typecheck` once (it installs them there)")
    project = env_python.parents[2] / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(_block("toml"))
    shutil.copytree(STUBS, project / ".pyrefly" / "site")
    shutil.copy(DRAFT, project / DRAFT.name)
    for place in (project, env_python):
        assert not place.resolve().is_relative_to(ROOT), f"{place} is inside the checkout"
    return project


@pytest.fixture(scope="module", params=["plain", "editable"])
def installed(request: pytest.FixtureRequest, env_python: Path, project: Path) -> Path:
    """typedkv installed into the environment, built from the checkout or editable; the project's path."""
    # --no-build-isolation: the build backend comes from the reused packages, not from the index.
    # Editable as the docs install it: setuptools' strict mode, a link tree of typedkv's files alone.
    editable = ["-e", ROOT, "--config-settings", "editable_mode=strict"] if request.param == "editable" else [ROOT]
    _pip(env_python, "--no-build-isolation", *editable)
    where = _run(env_python, "-c", "import typedkv; print(typedkv.__file__)", cwd=project).stdout.strip()
    assert Path(where).is_relative_to(env_python.parents[1] if request.param == "plain" else ROOT), where
    return project


def test_only_typedkv_is_importable(installed: Path, env_python: Path) -> None:
    """The install exposes the package alone: the checkout's other folders are not the user's imports."""
    for name in ("tests", "benchmarks", "examples", "docs", "stubs"):
        run = _run(env_python, "-c", f"import {name}", cwd=installed)
        assert run.returncode != 0 and "ModuleNotFoundError" in run.stderr, f"import {name} found the checkout's folder"
    assert _run(env_python, "-c", "import typedkv.kv.api", cwd=installed).returncode == 0


@pytest.mark.parametrize(
    "command",
    [["check"], ["check", "-c", "pyproject.toml", DRAFT.name]],
    ids=["project", "named-file"],
)
def test_pyrefly_flags_the_misuse(installed: Path, env_python: Path, command: list[str]) -> None:
    run = _run(PYREFLY, *command, "--python-interpreter-path", env_python, "--output-format", "json", cwd=installed)
    assert run.returncode in (0, 1), f"pyrefly failed to run (status {run.returncode}):\n{run.stderr}"
    errors, output = pyrefly_report(run.stdout, installed)
    draft = installed / DRAFT.name
    others = sorted(str(path) for path in errors if path != draft)
    assert not others, f"pyrefly reports errors outside {DRAFT.name}:\n{output}"
    problem = differences(draft, errors.get(draft, {}), "pyrefly", output)
    if problem:
        pytest.fail(problem)


def test_mypy_finds_typedkv(installed: Path, env_python: Path) -> None:
    cache = installed.parent / "mypy-cache"  # shared by both installs: torch's part stays warm
    run = _run(
        sys.executable, "-m", "mypy", "--strict", "--python-executable", env_python, "--cache-dir", cache, DRAFT.name,
        cwd=installed,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.startswith("Success"), f"mypy:\n{run.stdout}\n{run.stderr}"


def test_example_is_the_pages() -> None:
    assert DRAFT.read_text().startswith(_block("python")), f"{DRAFT.name} must open with {PAGE.name}'s example"
