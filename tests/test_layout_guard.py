"""The plan caches' fast path: a kept layout found again by its `LayoutGuard`, never a call of another layout.

A call whose layout was checked before skips the checks; the last layout a cache
kept or found is recognised by torch's C++ tensor check instead of the
fingerprint. Every way a layout can differ (a tensor's dtype, shape, strides,
device, Python type; a list's type or length; an int's or a string's value; a
tensor changed in place since) must miss it, and a miss must check in full.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import typedkv
from typedkv import InputError
from typedkv.core import checking
from typedkv.core.checking import CheckedLayouts, LayoutGuard, fingerprint


def _args() -> tuple[Any, ...]:
    """A per-layer pool call's shape of arguments: tensors, two lists of tensors, plain values."""
    pools = [torch.zeros(8, 2, 4) for _ in range(3)]
    return ("auto", torch.randn(5, 16), 1e-6, torch.arange(5), pools, [p.clone() for p in pools], 2, "neox", None)


def _replaced(args: tuple[Any, ...], at: int, value: Any) -> tuple[Any, ...]:
    return (*args[:at], value, *args[at + 1 :])


def _in_list(args: tuple[Any, ...], at: int, item: int, value: Any) -> tuple[Any, ...]:
    items = list(args[at])
    items[item] = value
    return _replaced(args, at, type(args[at])(items))


# Each one a different layout from `_args()` (so a different fingerprint, or one the guard may not trust).
OTHER_LAYOUTS: dict[str, Callable[[tuple[Any, ...]], tuple[Any, ...]]] = {
    "dtype": lambda a: _replaced(a, 1, a[1].half()),
    "shape": lambda a: _replaced(a, 1, torch.randn(6, 16)),
    "strides": lambda a: _replaced(a, 1, torch.randn(16, 5).t()),
    "device": lambda a: _replaced(a, 1, a[1].to("meta")),
    "not a tensor": lambda a: _replaced(a, 1, 3),
    "a subclass": lambda a: _replaced(a, 1, torch.nn.Parameter(a[1], requires_grad=False)),
    "requires_grad": lambda a: _replaced(a, 1, a[1].clone().requires_grad_()),
    "list item dtype": lambda a: _in_list(a, 4, 2, a[4][2].double()),
    "list item strides": lambda a: _in_list(a, 5, 0, torch.zeros(8, 4, 2).transpose(1, 2)),
    "list item not a tensor": lambda a: _in_list(a, 4, 1, None),
    "list shorter": lambda a: _replaced(a, 4, a[4][:2]),
    "tuple for list": lambda a: _replaced(a, 4, tuple(a[4])),
    "int value": lambda a: _replaced(a, 6, 3),
    "bool for int": lambda a: _replaced(a, 6, True),
    "float for int": lambda a: _replaced(a, 6, 2.0),
    "string value": lambda a: _replaced(a, 7, "gptj"),
    "None for a float": lambda a: _replaced(a, 2, None),
    "tensor for None": lambda a: _replaced(a, 8, torch.ones(2)),
    "fewer arguments": lambda a: a[:-1],
    # Tensors of other kinds (strided nested ones: `test_a_nested_tensor_misses`, in a child process).
    "sparse COO": lambda a: _replaced(a, 1, a[1].to_sparse()),
    "sparse CSR": lambda a: _replaced(a, 1, a[1].to_sparse_csr()),
    "MKL-DNN": lambda a: _replaced(a, 1, a[1].to_mkldnn()),
    "nested, jagged": lambda a: _replaced(a, 1, torch.nested.nested_tensor([a[1], a[1][:2]], layout=torch.jagged)),
    "list item sparse COO": lambda a: _in_list(a, 4, 1, a[4][1].to_sparse()),
}


# Facts the guard compares beyond the fingerprint.
SAME_FINGERPRINT = ("a subclass", "requires_grad")


def test_this_torch_has_the_guard() -> None:
    # torch 2.11 and 2.13 do; without it every call pays the fingerprint (correct, slower on a CUDA host).
    assert checking._TENSOR_GUARDS is not None


def test_the_same_layout_matches_another_call_of_it() -> None:
    args = _args()
    guard = LayoutGuard.of(args)
    assert guard is not None
    assert guard.matches(args)
    # New tensors of the same layout, another float: the same fingerprint, so the guard matches.
    again = _replaced(_args(), 2, 1e-5)
    assert fingerprint(again) == fingerprint(args)
    assert guard.matches(again)


@pytest.mark.parametrize("change", list(OTHER_LAYOUTS))
def test_another_layout_misses(change: str) -> None:
    args = _args()
    guard = LayoutGuard.of(args)
    assert guard is not None
    assert not guard.matches(OTHER_LAYOUTS[change](args))


@pytest.mark.parametrize("change", ["t_", "unsqueeze_", "resize_", "as_strided_", "set_"])
def test_a_tensor_changed_in_place_misses(change: str) -> None:
    # The same Python objects, their shape or strides changed in place: a new layout.
    args = _args()
    guard = LayoutGuard.of(args)
    assert guard is not None
    pool = args[4][1]
    {
        "t_": lambda: pool.view(8, 8).t_(),  # a view: the list's own item changed below instead
        "unsqueeze_": lambda: pool.unsqueeze_(0),
        "resize_": lambda: pool.resize_(4, 2, 4),
        "as_strided_": lambda: pool.as_strided_((8, 4, 2), (8, 1, 4)),
        "set_": lambda: pool.set_(torch.zeros(8, 2, 4, dtype=pool.dtype).transpose(0, 1).contiguous().transpose(0, 1)),
    }[change]()
    if change == "t_":
        args[1].t_()
    assert not guard.matches(args)


NESTED_CHILD = """
import torch
from typedkv.core.checking import LayoutGuard
kept = (torch.ones(2, 3), [torch.zeros(4), torch.zeros(4)], 2)
guard = LayoutGuard.of(kept)
nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(3)])
print(guard.matches((nested, kept[1], 2)), guard.matches((kept[0], [torch.zeros(4), nested], 2)))
"""


def test_a_nested_tensor_misses() -> None:
    # torch's TensorGuards reads a tensor's strides before its dispatch keys, and a strided nested
    # tensor's raise a C++ error nothing catches: the process would abort, so this runs in a child.
    root = str(Path(typedkv.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", NESTED_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False", "False"]


def test_tensors_alone() -> None:
    # No plain value and no list (the stacked-pool op's shape of arguments is close to it).
    args = (torch.ones(2, 3), torch.arange(4))
    guard = LayoutGuard.of(args)
    assert guard is not None
    assert guard.matches((torch.zeros(2, 3), torch.arange(4)))
    assert not guard.matches((torch.zeros(3, 2), torch.arange(4)))
    lists = LayoutGuard.of(([torch.ones(2)], [torch.ones(3)]))
    assert lists is not None and lists.matches(([torch.ones(2)], [torch.ones(3)]))
    assert not lists.matches(([torch.ones(3)], [torch.ones(3)]))


def test_keeps_no_tensor_alive() -> None:
    args = _args()
    gone = weakref.ref(args[4][0])
    guard = LayoutGuard.of(args)
    assert guard is not None
    del args
    gc.collect()
    assert gone() is None


def test_no_guard_for_arguments_it_cannot_compare() -> None:
    # A value of a type the fingerprint keys by identity, or a list holding something else than tensors.
    assert LayoutGuard.of((torch.ones(2), object())) is None
    assert LayoutGuard.of((torch.ones(2), [torch.ones(2), 3])) is None


def test_cache_finds_kept_layouts_and_only_them() -> None:
    layouts: CheckedLayouts[str] = CheckedLayouts(8)
    a, b = _args(), OTHER_LAYOUTS["shape"](_args())
    assert layouts.get(a) is None
    layouts.keep(a, "plan a")
    layouts.keep(b, "plan b")
    # Alternating layouts: each found (the guard of the last one, the fingerprint of the other).
    for _ in range(2):
        assert layouts.get(_args()) == "plan a"
        assert layouts.get(OTHER_LAYOUTS["shape"](_args())) == "plan b"
    for change, other in OTHER_LAYOUTS.items():
        if change in SAME_FINGERPRINT:
            # The guard misses; the fingerprint (what the checks' verdict depends on) finds the plan.
            assert layouts.get(other(_args())) == "plan a", change
        elif change != "shape":
            assert layouts.get(other(_args())) is None, change
    layouts.clear()
    assert layouts.get(a) is None and len(layouts) == 0


def test_cache_remakes_a_guard_the_thread_state_changed() -> None:
    # Kept outside inference_mode, called inside it: found by the fingerprint once, then by a new guard.
    layouts: CheckedLayouts[str] = CheckedLayouts(8)
    layouts.keep(_args(), "plan")
    with torch.inference_mode():
        assert layouts.get(_args()) == "plan"
        last = layouts._last
        assert last is not None and last[0].matches(_args())
        assert layouts.get(_args()) == "plan"
    assert not last[0].matches(_args())  # outside it again: the fingerprint finds it, and so on


def test_cache_without_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checking, "_TENSOR_GUARDS", None)
    layouts: CheckedLayouts[str] = CheckedLayouts(8)
    layouts.keep(_args(), "plan")
    assert layouts.get(_args()) == "plan"
    assert layouts.get(OTHER_LAYOUTS["strides"](_args())) is None


def test_cache_drops_everything_past_its_size() -> None:
    layouts: CheckedLayouts[int] = CheckedLayouts(2)
    for n in range(1, 4):
        layouts.keep((torch.ones(n),), n)
    assert len(layouts) == 1
    assert layouts.get((torch.ones(3),)) == 3 and layouts.get((torch.ones(1),)) is None


def test_per_layer_pool_changed_in_place_is_checked_again() -> None:
    # The public op: a layout that passed, then one of its pools reshaped in place -> the full check's error.
    torch.manual_seed(0)
    num_layers, num_tokens, num_kv_heads, head_dim = 2, 3, 2, 8
    kv = torch.randn(num_tokens, num_layers, 2 * num_kv_heads * head_dim)
    cos_sin_cache = torch.randn(16, head_dim)
    positions = torch.tensor([0, 5, 9])
    cache_loc = torch.tensor([4, 0, 2])
    k_pool = [torch.zeros(6, num_kv_heads, head_dim) for _ in range(num_layers)]
    v_pool = [torch.zeros(6, num_kv_heads, head_dim) for _ in range(num_layers)]

    def call() -> None:
        typedkv.materialize_kv_into_pool(
            kv, None, 1e-6, cos_sin_cache, positions, cache_loc, k_pool, v_pool, num_kv_heads=num_kv_heads
        )

    call()
    call()
    k_pool[1].unsqueeze_(0)
    with pytest.raises(InputError, match="k_pool"):
        call()
