"""Every public function and class shows a short runnable example, and the example runs.

Each one's numpy-style docstring ends with an ``Examples`` section in doctest format
(``>>> ``), on CPU tensors with printed output that does not depend on random values:
shapes, dtypes, booleans. This runs each section with doctest, in debug and production
mode; under ``TRITON_INTERPRET=1`` (the suite's second run) the examples go through
the Triton kernels. As numpy's examples take ``np`` as imported, these take ``torch``
and ``typedkv``; anything else an example uses it imports itself.

The public functions and classes are those of ``typedkv.__all__`` (the type aliases
``RopeStyle`` and ``KVLayout`` are documented by a string after their assignment, not
a docstring) and sglang's ``FusedKVMaterializeHelper``.
"""

from __future__ import annotations

import doctest
import inspect
from typing import Any

import pytest
import torch
from test_docs import sections

import typedkv
from typedkv.integrations.sglang import FusedKVMaterializeHelper

MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]

PUBLIC: dict[str, Any] = {
    **{name: getattr(typedkv, name) for name in typedkv.__all__},
    "integrations.sglang.FusedKVMaterializeHelper": FusedKVMaterializeHelper,
}
DOCUMENTED = sorted(name for name, obj in PUBLIC.items() if inspect.isclass(obj) or inspect.isfunction(obj))


def own_docstring(obj: Any) -> str:
    """The object's own docstring (a class's, never one inherited from a base), dedented."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc or "")


def examples(name: str) -> doctest.DocTest:
    """The doctest of ``name``'s Examples section (empty when there is none)."""
    obj = PUBLIC[name]
    text = sections(own_docstring(obj)).get("Examples", "")
    source = inspect.getsourcefile(obj)
    return doctest.DocTestParser().get_doctest(
        text, {"torch": torch, "typedkv": typedkv}, f"typedkv.{name}", source, inspect.getsourcelines(obj)[1]
    )


def test_the_public_functions_and_classes_are_found() -> None:
    assert {"materialize_kv", "KVMaterializer", "InputError", "set_debug"} <= set(DOCUMENTED)
    assert "RopeStyle" not in DOCUMENTED


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_name_has_an_examples_section(name: str) -> None:
    test = examples(name)
    assert test.examples, f"typedkv.{name}: add an Examples section with a short runnable `>>> ` example"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DOCUMENTED)
def test_examples_run(name: str, mode: str) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    test = examples(name)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)
