"""Outputs and pools made under ``torch.inference_mode()`` and written by a call outside it.

torch refuses an in-place update of an inference tensor outside inference mode; the kernel writes
through pointers and never asks. The reference path (CPU tensors) writes as the kernel does: every
call here succeeds with the values a call into ordinary tensors gives, bit for bit, on both paths
(the file also runs under ``TRITON_INTERPRET=1``), and what is written carries no autograd history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv

T, L, H, D, P, S, HIDDEN, C, R = 3, 2, 2, 16, 16, 8, 32, 16, 16
BF16 = torch.bfloat16


def _inputs(requires_grad: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(T, L, 2 * H * D, generator=g).to(BF16).requires_grad_(requires_grad)
    return {
        "kv": kv,
        "k_norm_weight": torch.rand(L, D, generator=g) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, D),
        "positions": torch.tensor([3, 0, 7]),
        "num_kv_heads": H,
    }


def _mla_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "ckv": torch.randn(T, L, C + R, generator=g).to(BF16),
        "kv_norm_weight": torch.rand(L, C, generator=g) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, R),
        "positions": torch.tensor([3, 0, 7]),
        "rope_style": "neox",
    }


def _materializer() -> typedkv.KVMaterializer:
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(L, 2 * H * D, HIDDEN, generator=g) / HIDDEN**0.5).to(BF16)
    return typedkv.KVMaterializer(weight, torch.ones(L, D), 1e-6, typedkv.cos_sin_cache(P, D), num_kv_heads=H)


def _zeros(*shape: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.zeros(*shape, dtype=dtype)


# Each case: what to allocate (the written tensors), and the call that writes them.
Written = dict[str, Any]
CASES: dict[str, tuple[Callable[[], Written], Callable[[Written], Any]]] = {
    "k_out, v_out": (
        lambda: {"k_out": _zeros(L, T, H, D), "v_out": _zeros(L, T, H, D)},
        lambda w: typedkv.materialize_kv(**_inputs(), **w),
    ),
    "v_out only": (
        lambda: {"v_out": _zeros(L, T, H, D)},
        lambda w: typedkv.materialize_kv(**_inputs(), k_out=_zeros(L, T, H, D), **w),
    ),
    "stacked pools": (
        lambda: {"k_pool": _zeros(L, S, H, D), "v_pool": _zeros(L, S, H, D)},
        lambda w: typedkv.materialize_kv_into_pool(**_inputs(), cache_loc=torch.tensor([5, 1, 2]), **w),
    ),
    "per-layer pools, paged": (
        lambda: {"k_pool": list(_zeros(L, 2, 4, H, D)), "v_pool": list(_zeros(L, 2, 4, H, D))},
        lambda w: typedkv.materialize_kv_into_pool(**_inputs(), cache_loc=torch.tensor([5, 1, 2]), **w),
    ),
    "views of one combined cache": (
        lambda: {"cache": _zeros(L, 2, S, H, D)},
        lambda w: typedkv.materialize_kv_into_pool(
            **_inputs(), cache_loc=torch.tensor([5, 1, 2]), k_pool=w["cache"][:, 0], v_pool=w["cache"][:, 1]
        ),
    ),
    "fp8 pools": (
        lambda: {
            "k_pool": _zeros(L, S, H, D, dtype=torch.float8_e4m3fn),
            "v_pool": _zeros(L, S, H, D, dtype=torch.float8_e4m3fn),
        },
        lambda w: typedkv.materialize_kv_into_pool(
            **_inputs(), cache_loc=torch.tensor([5, 1, 2]), k_scale=0.5, v_scale=torch.full((L,), 0.25), **w
        ),
    ),
    "mla out": (
        lambda: {"out": _zeros(L, T, C + R)},
        lambda w: typedkv.materialize_mla_kv(**_mla_inputs(), **w),
    ),
    "mla pool": (
        lambda: {"kv_pool": _zeros(L, S, C + R)},
        lambda w: typedkv.materialize_mla_kv_into_pool(**_mla_inputs(), cache_loc=torch.tensor([5, 1, 2]), **w),
    ),
    "KVMaterializer k_out, v_out": (
        lambda: {"k_out": _zeros(L, T, H, D), "v_out": _zeros(L, T, H, D)},
        lambda w: _materializer()(torch.randn(T, HIDDEN).to(BF16), torch.tensor([3, 0, 7]), **w),
    ),
}


def _tensors(written: Written) -> list[Tensor]:
    return [t for value in written.values() for t in (value if isinstance(value, list) else [value])]


def _as_floats(written: Written) -> list[Tensor]:
    return [t.float() for t in _tensors(written)]


@pytest.mark.parametrize("case", list(CASES))
def test_written_outside_inference_mode(case: str) -> None:
    make, call = CASES[case]
    want = make()
    torch.manual_seed(0)
    call(want)
    with torch.inference_mode():
        got = make()
    assert all(t.is_inference() for t in _tensors(got))
    torch.manual_seed(0)
    call(got)  # outside inference mode: written like ordinary tensors
    for g, w in zip(_as_floats(got), _as_floats(want), strict=True):
        assert torch.equal(g.nan_to_num(), w.nan_to_num()) and bool(w.any())


@pytest.mark.parametrize("case", list(CASES))
def test_written_inside_inference_mode(case: str) -> None:
    # Ordinary tensors written from inside inference mode (a serving loop under it): unchanged behaviour.
    make, call = CASES[case]
    want, got = make(), make()
    torch.manual_seed(0)
    call(want)
    torch.manual_seed(0)
    with torch.inference_mode():
        call(got)
    assert not any(t.is_inference() for t in _tensors(got))
    for g, w in zip(_as_floats(got), _as_floats(want), strict=True):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


def test_no_autograd_history() -> None:
    # kv requires grad; outputs allocated by the call, given, and given as a leaf that requires grad.
    inputs = _inputs(requires_grad=True)
    k, v = typedkv.materialize_kv(**inputs)
    k_out, v_out = _zeros(L, T, H, D).requires_grad_(), _zeros(L, T, H, D)
    given = typedkv.materialize_kv(**inputs, k_out=k_out, v_out=v_out)
    for t in (k, v, *given):
        assert t.grad_fn is None
    assert not k.requires_grad and not v.requires_grad and not v_out.requires_grad
    assert given[0] is k_out and k_out.is_leaf and k_out.grad_fn is None
    assert not k.is_inference() and not k_out.is_inference()
    k_pool = _zeros(L, S, H, D)
    typedkv.materialize_kv_into_pool(
        **inputs, cache_loc=torch.tensor([5, 1, 2]), k_pool=k_pool, v_pool=_zeros(L, S, H, D)
    )
    assert k_pool.grad_fn is None and not k_pool.requires_grad and bool(k_pool.any())


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_compiled_into_outputs_made_under_inference_mode() -> None:
    # The compiled graph calls the same op: outputs made under inference mode are written as eagerly.
    inputs = _inputs()

    def fn(kv: Tensor, k_out: Tensor, v_out: Tensor) -> tuple[Tensor, Tensor]:
        rest = {k: v for k, v in inputs.items() if k != "kv"}
        return typedkv.materialize_kv(kv, **rest, k_out=k_out, v_out=v_out)

    want = _zeros(L, T, H, D), _zeros(L, T, H, D)
    fn(inputs["kv"], *want)
    with torch.inference_mode():
        got = _zeros(L, T, H, D), _zeros(L, T, H, D)
    torch.compile(fn, fullgraph=True)(inputs["kv"], *got)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
