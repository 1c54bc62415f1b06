"""Tensors of another kind than strided -- sparse (COO, CSR, CSC, BSR, BSC), MKL-DNN, nested (``torch.nested``,
strided or jagged layout) -- in any tensor argument of any public call, list items too: an `InputError` that names
the argument, says what it got and what to pass instead, before anything is written. On a layout's first call, and
after a warm call of the same layout, when a plan cache's fast path (`typedkv.core.checking.LayoutGuard`) sees the call
first.

That fast path hands the call's tensors to torch's C++ ``TensorGuards``, which reads a tensor's sizes and strides
before it compares its dispatch keys: a nested tensor's raise a C++ error there that nothing catches, and the
process aborts. So the nested cases after a warm call run in a child process (`test_nested_after_a_warm_call`),
where such an abort fails a test instead of ending the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv import rope
from typedkv.core import checking, implementation, signature
from typedkv.kv import impl as kv_impl
from typedkv.mla import impl as mla_impl
from typedkv.projection import fused as fused_impl
from typedkv.projection import layers as projection_layers

T, L, H, D, P, S, HIDDEN, C, R = 3, 2, 1, 8, 16, 8, 16, 8, 8
BF16 = torch.bfloat16

MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


def kinds_of(x: Tensor) -> dict[str, Callable[[], Tensor]]:
    """Makers of ``x`` as each kind that is not strided, by what a message calls it (one nested kind per layout)."""
    return {
        "a sparse COO tensor": lambda: x.to_sparse(),
        "a sparse CSR tensor": lambda: x.to_sparse_csr(),
        "a sparse CSC tensor": lambda: x.to_sparse_csc(),
        "a sparse BSR tensor": lambda: x.to_sparse_bsr((1, 1)),
        "a sparse BSC tensor": lambda: x.to_sparse_bsc((1, 1)),
        "an MKL-DNN tensor": lambda: x.to_mkldnn(),
        "a nested tensor": lambda: torch.nested.nested_tensor([x, x]),
        "a nested tensor (jagged)": lambda: torch.nested.nested_tensor([x, x[:1]], layout=torch.jagged),
    }


def made(maker: Callable[[], Tensor]) -> Tensor | None:
    """The tensor ``maker`` makes, or None where torch makes no such tensor of that dtype or rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is beta, nested tensors a prototype
        try:
            return maker()
        except Exception:  # IndexError, RuntimeError, NotImplementedError...: none such
            return None


# ------------------------------------------------------------------ the calls


def _rows(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return (torch.rand(*shape) + 0.5).to(dtype)


def _dense() -> dict[str, Any]:
    return {
        "kv": _rows(T, L, 2 * H * D, dtype=BF16),
        "k_norm_weight": _rows(L, D),
        "eps": torch.full((L,), 1e-6),
        "cos_sin_cache": typedkv.cos_sin_cache(P, D),
        "positions": torch.arange(T),
        "num_kv_heads": H,
        "k_out": torch.zeros(L, T, H, D, dtype=BF16),
        "v_out": torch.zeros(L, T, H, D, dtype=BF16),
    }


def _pool(pools: str) -> dict[str, Any]:
    args = {k: v for k, v in _dense().items() if k not in ("k_out", "v_out")}
    args["cache_loc"] = torch.arange(T)
    if pools == "fp8":
        zeros = torch.zeros(L, S, H, D, dtype=torch.float8_e4m3fn)
        args.update(k_pool=zeros, v_pool=zeros.clone(), k_scale=torch.ones(L), v_scale=torch.ones(L))
    elif pools == "per-layer":
        args.update(k_pool=list(torch.zeros(L, S, H, D, dtype=BF16)), v_pool=list(torch.zeros(L, S, H, D, dtype=BF16)))
    else:
        args.update(k_pool=torch.zeros(L, S, H, D, dtype=BF16), v_pool=torch.zeros(L, S, H, D, dtype=BF16))
    return args


def _mla() -> dict[str, Any]:
    return {
        "ckv": _rows(T, L, C + R, dtype=BF16),
        "kv_norm_weight": _rows(L, C),
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, R),
        "positions": torch.arange(T),
        "rope_style": "neox",
        "out": torch.zeros(L, T, C + R, dtype=BF16),
    }


def _mla_pool() -> dict[str, Any]:
    args = {k: v for k, v in _mla().items() if k != "out"}
    return {**args, "cache_loc": torch.arange(T), "kv_pool": list(torch.zeros(L, S, C + R, dtype=BF16))}


def _materializer() -> typedkv.KVMaterializer:
    weights = _rows(L, 2 * H * D, HIDDEN, dtype=BF16) - 1
    return typedkv.KVMaterializer(weights, _rows(L, D), 1e-6, typedkv.cos_sin_cache(P, D), num_kv_heads=H)


def _mla_materializer() -> typedkv.MLAKVMaterializer:
    weights = _rows(L, C + R, HIDDEN, dtype=BF16) - 1
    return typedkv.MLAKVMaterializer(weights, _rows(L, C), 1e-6, typedkv.cos_sin_cache(P, R), rope_style="neox")


def _materialized(args: dict[str, Any]) -> Any:
    module, hidden, rest = (
        args["module"],
        args["hidden"],
        {k: v for k, v in args.items() if k not in ("module", "hidden")},
    )
    return module.into_pool(hidden, **rest) if "k_pool" in rest else module(hidden, **rest)


# Each public entry point: how to make a valid call's arguments, and how to call it with them.
CALLS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], Any]]] = {
    "materialize_kv": (_dense, lambda a: typedkv.materialize_kv(**a)),
    "materialize_kv_into_pool": (lambda: _pool("stacked"), lambda a: typedkv.materialize_kv_into_pool(**a)),
    "per-layer pools": (lambda: _pool("per-layer"), lambda a: typedkv.materialize_kv_into_pool(**a)),
    "fp8 pools": (lambda: _pool("fp8"), lambda a: typedkv.materialize_kv_into_pool(**a)),
    "materialize_mla_kv": (_mla, lambda a: typedkv.materialize_mla_kv(**a)),
    "materialize_mla_kv_into_pool": (_mla_pool, lambda a: typedkv.materialize_mla_kv_into_pool(**a)),
    "KVMaterializer": (
        lambda: {"module": _materializer(), "hidden": _rows(T, HIDDEN, dtype=BF16), "positions": torch.arange(T)},
        _materialized,
    ),
    "KVMaterializer.into_pool": (
        lambda: {
            "module": _materializer(),
            "hidden": _rows(T, HIDDEN, dtype=BF16),
            **{k: v for k, v in _pool("per-layer").items() if k in ("positions", "cache_loc", "k_pool", "v_pool")},
        },
        _materialized,
    ),
    "MLAKVMaterializer": (
        lambda: {"module": _mla_materializer(), "hidden": _rows(T, HIDDEN, dtype=BF16), "positions": torch.arange(T)},
        _materialized,
    ),
    "cos_sin_cache_from_hf": (
        lambda: {"cos": torch.ones(P, D), "sin": torch.zeros(P, D)},
        lambda a: typedkv.cos_sin_cache_from_hf(**a),
    ),
    "KVMaterializer()": (
        lambda: {
            "kv_weight": list(_rows(L, 2 * H * D, HIDDEN, dtype=BF16)),
            "k_norm_weight": _rows(L, D),
            "eps": 1e-6,
            "cos_sin_cache": typedkv.cos_sin_cache(P, D),
            "num_kv_heads": H,
        },
        lambda a: typedkv.KVMaterializer(**a),
    ),
}

# (call, argument, item of a per-layer list or None, whether the call writes it)
ARGUMENTS: list[tuple[str, str, int | None, bool]] = [
    ("materialize_kv", "kv", None, False),
    ("materialize_kv", "k_norm_weight", None, False),
    ("materialize_kv", "eps", None, False),
    ("materialize_kv", "cos_sin_cache", None, False),
    ("materialize_kv", "positions", None, False),
    ("materialize_kv", "k_out", None, True),
    ("materialize_kv", "v_out", None, True),
    ("materialize_kv_into_pool", "cache_loc", None, False),
    ("materialize_kv_into_pool", "k_pool", None, True),
    ("materialize_kv_into_pool", "v_pool", None, True),
    ("per-layer pools", "kv", None, False),
    ("per-layer pools", "k_pool", 1, True),
    ("per-layer pools", "v_pool", 0, True),
    ("fp8 pools", "k_scale", None, False),
    ("materialize_mla_kv", "ckv", None, False),
    ("materialize_mla_kv", "out", None, True),
    ("materialize_mla_kv_into_pool", "kv_pool", 1, True),
    ("KVMaterializer", "hidden", None, False),
    ("KVMaterializer.into_pool", "hidden", None, False),
    ("KVMaterializer.into_pool", "k_pool", 1, True),
    ("MLAKVMaterializer", "hidden", None, False),
    ("cos_sin_cache_from_hf", "sin", None, False),
    ("KVMaterializer()", "kv_weight", 1, False),
    ("KVMaterializer()", "k_norm_weight", None, False),
]


@dataclass
class Case:
    call: str
    argument: str
    item: int | None
    written: bool
    kind: str

    @property
    def id(self) -> str:
        label = self.argument if self.item is None else f"{self.argument}[{self.item}]"
        return f"{self.call}-{label}-{self.kind.removeprefix('a ').removeprefix('an ')}"

    def arguments(self) -> tuple[dict[str, Any], Tensor | None]:
        """A valid call's arguments with this case's argument made this kind (None: torch makes none such)."""
        args = CALLS[self.call][0]()
        value = args[self.argument]
        strided = value if self.item is None else value[self.item]
        bad = made(kinds_of(strided)[self.kind])
        if bad is not None:
            if self.item is None:
                args[self.argument] = bad
            else:
                args[self.argument] = [bad if i == self.item else x for i, x in enumerate(value)]
        return args, bad

    def message(self) -> str:
        label = self.argument if self.item is None else f"{self.argument}[{self.item}]"
        nested = self.kind.startswith("a nested")
        conversion = f"torch.cat({label}.unbind())" if nested else f"{label}.to_dense()"
        if self.written:
            fix = f"allocate it as a strided tensor ({conversion} would write into a copy)"
        elif nested:
            fix = f"join its pieces into one tensor, {conversion}"
        else:
            fix = f"pass {conversion}"
        return f"{label}: expected a strided tensor, got {'a nested tensor' if nested else self.kind}: {fix}"


CASES = [Case(*a, kind) for a in ARGUMENTS for kind in kinds_of(torch.zeros(2, 2))]
NESTED = [c for c in CASES if c.kind.startswith("a nested")]
OTHERS = [c for c in CASES if not c.kind.startswith("a nested")]


def written_tensors(args: dict[str, Any]) -> Iterator[Tensor]:
    """Every strided tensor the call would write: each must be left as it was (zeros)."""
    for name in ("k_out", "v_out", "k_pool", "v_pool", "out", "kv_pool"):
        value = args.get(name)
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, Tensor) and x.layout == torch.strided and not x.is_nested:
                yield x


def forget_layouts() -> None:
    """Every plan cache of the package emptied: the next call of any layout is its first."""
    for module in (kv_impl, mla_impl, fused_impl, projection_layers, rope):
        for value in vars(module).values():
            if isinstance(value, implementation.Implementation):
                value.signature._plans.clear()
            elif isinstance(value, signature.Signature):
                value._plans.clear()


def run_case(case: Case, warm: bool) -> str | None:
    """The case's call, after a valid call of the same layout when ``warm``; its InputError's message, or None
    where torch makes no tensor of the case's kind. Fails the test on any other outcome or on a write."""
    args, bad = case.arguments()
    if bad is None:
        return None
    call = CALLS[case.call][1]
    if warm:
        valid = CALLS[case.call][0]()
        if "module" in args:
            valid["module"] = args["module"]  # the module's own plans, warmed
        call(valid)
        call(valid)  # the second call finds its plan by the guard
    else:
        forget_layouts()
    with pytest.raises(typedkv.InputError) as caught:
        call(args)
    for tensor in written_tensors(args):
        assert not tensor.float().any(), f"{case.id}: written before the error"
    return str(caught.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("warm", [False, True], ids=["first call", "after a warm call"])
@pytest.mark.parametrize("case", OTHERS, ids=[c.id for c in OTHERS])
def test_sparse_and_mkldnn(case: Case, warm: bool, mode: str) -> None:
    message = run_case(case, warm)
    if message is None:
        pytest.skip(f"torch makes no {case.kind.split(' ', 1)[1]} of this dtype and rank")
    assert message == case.message()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", NESTED, ids=[c.id for c in NESTED])
def test_nested_on_a_first_call(case: Case, mode: str) -> None:
    message = run_case(case, warm=False)
    assert message == case.message()


def test_nested_after_a_warm_call() -> None:
    # In a child process: before the fix the first of these aborted it (`LayoutGuard`).
    # The child imports the typedkv this process imported.
    root = str(Path(typedkv.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, __file__, "--nested-after-a-warm-call"], capture_output=True, text=True, env=env, timeout=600
    )
    results = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    assert child.returncode == 0, (
        f"the child ended with {child.returncode} after {results[-1:]}:\n{child.stderr[-3000:]}"
    )
    assert len(results) == len(NESTED)
    for result, case in zip(results, NESTED, strict=True):
        assert result == {"case": case.id, "message": case.message()}


# ------------------------------------------------------------ the plan cache


def test_a_sparse_tensor_with_a_kept_layouts_facts_is_checked() -> None:
    # A sparse COO tensor's strides are all 0: its fingerprint is an expanded tensor's. The fingerprint
    # alone must not find that layout's plan for it (the guard, which compares dispatch keys, misses).
    layouts: checking.CheckedLayouts[str] = checking.CheckedLayouts(8)
    expanded = (torch.ones(1).expand(4), 2)
    layouts.keep(expanded, "plan")
    other = (torch.ones(4).to_sparse(), 2)
    assert checking.fingerprint(other) == checking.fingerprint(expanded)
    assert layouts.get(other) is None
    assert layouts.get((torch.ones(1).expand(4), 2)) == "plan"


def test_an_mkldnn_tensor_with_a_kept_layouts_facts_is_checked() -> None:
    layouts: checking.CheckedLayouts[str] = checking.CheckedLayouts(8)
    layouts.keep((torch.ones(4),), "plan")
    other = (torch.ones(4).to_mkldnn(),)
    assert checking.fingerprint(other) == checking.fingerprint((torch.ones(4),))
    assert layouts.get(other) is None


def test_without_a_guard_a_sparse_tensor_is_checked() -> None:
    # A list of numbers makes no guard: the fingerprint alone finds plans.
    layouts: checking.CheckedLayouts[str] = checking.CheckedLayouts(8)
    layouts.keep((torch.ones(1).expand(4), [1e-6, 1e-6]), "plan")
    assert checking.LayoutGuard.of((torch.ones(4), [1e-6])) is None
    assert layouts.get((torch.ones(4).to_sparse(), [1e-6, 1e-6])) is None
    assert layouts.get((torch.ones(1).expand(4), [1e-5, 1e-6])) == "plan"


def test_a_tensor_without_sizes_has_no_plan() -> None:
    # A nested tensor's sizes (and a sparse CSR tensor's strides) raise when read: no plan, not that error.
    layouts: checking.CheckedLayouts[str] = checking.CheckedLayouts(8)
    layouts.keep((torch.ones(2, 2),), "plan")
    for other in (torch.nested.nested_tensor([torch.ones(2), torch.ones(2)]), torch.ones(2, 2).to_sparse_csr()):
        layouts.clear()
        assert layouts.get((other,)) is None


def _nested_after_a_warm_call() -> None:
    """The child of `test_nested_after_a_warm_call`: each nested case after a warm call, one JSON line each."""
    typedkv.set_debug(False)
    for case in NESTED:
        try:
            message = run_case(case, warm=True)
        except BaseException as err:  # pytest.fail and friends: the parent compares the message
            message = f"{type(err).__name__}: {err}"
        print(json.dumps({"case": case.id, "message": message}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--nested-after-a-warm-call"]:
    _nested_after_a_warm_call()
