"""Layouts whose offsets pass 32 bits: a layer-major kv, a head-major pool, a column of a large tensor.

The kernels form ``index * stride`` products in int32 unless the launch sets their
WIDE constexpr (`typedkv.core.launch_args.wide_offsets`); without it such a layout read and
wrote outside its tensors (Triton's interpreter faults; a GPU would fault or write
another tensor's memory). Each case views a few elements of a buffer of more than
2**31 elements: ``torch.empty`` reserves it, and only the pages the call touches are
ever backed by memory. On the reference path these are ordinary strided calls; under
``TRITON_INTERPRET=1`` they run the kernels themselves, whose int32 arithmetic the
interpreter reproduces. On a GPU (``-m gpu``) the same calls run on CUDA tensors, the
buffers then real allocations of 4-8 GiB each.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from reference64 import materialize_kv64, materialize_mla_kv64
from test_numerics import assert_bitwise_equal, assert_k_close
from torch import Tensor

import typedkv
from typedkv.core import launch_args

BIG = 2**30  # a stride that passes int32 at index 2
T, H, D, P = 3, 3, 16, 32
DTYPE = torch.float16


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _spread(
    shape: tuple[int, ...], strides: tuple[int, ...], device: torch.device, dtype: torch.dtype = DTYPE
) -> Tensor:
    """A view of ``shape`` and ``strides`` into a reserved buffer just large enough, filled with random values."""
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    view = torch.empty(extent, dtype=dtype, device=device).as_strided(shape, strides)
    if dtype.is_floating_point:
        view.copy_(torch.randn(shape).to(dtype))
    return view


def _inputs(num_layers: int, device: torch.device) -> dict[str, Tensor]:
    torch.manual_seed(0)
    return {
        "kv": torch.randn(T, num_layers, 2 * H * D).to(device, DTYPE),
        "k_norm_weight": (torch.rand(num_layers, D) + 0.5).to(device, DTYPE),
        "cos_sin_cache": typedkv.cos_sin_cache(P, D, device=device),
        "positions": torch.tensor([5, 0, 31], device=device),
    }


def _reference(a: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    cpu = {name: t.cpu() for name, t in a.items()}
    return materialize_kv64(cpu["kv"], cpu["k_norm_weight"], 1e-6, cpu["cos_sin_cache"], cpu["positions"], H)


def _check_dense(a: dict[str, Tensor], k: Tensor, v: Tensor) -> None:
    ref_k, ref_v = _reference(a)
    assert_bitwise_equal(v.cpu(), ref_v, "v")
    assert_k_close(k.cpu(), ref_k, D, "neox")


def _materialize(
    a: dict[str, Tensor], k_out: Tensor | None = None, v_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return typedkv.materialize_kv(
        a["kv"], a["k_norm_weight"], 1e-6, a["cos_sin_cache"], a["positions"], num_kv_heads=H, k_out=k_out, v_out=v_out
    )


def test_wide_offsets_counts_the_last_index() -> None:
    assert not launch_args.wide_offsets((2, BIG), (BIG, 1))  # index 1 times 2**30: within int32
    assert launch_args.wide_offsets((3, BIG))  # index 2 times 2**30 = 2**31
    assert launch_args.wide_offsets((2, 2**31))


def test_layer_major_kv(device: torch.device) -> None:
    """kv ``[T, L, 2*H*D]`` as a view of a ``[L, ~2**30, 2*H*D]`` buffer: layer 2 starts 2**31 elements in."""
    a = _inputs(3, device)
    a["kv"] = _spread((T, 3, 2 * H * D), (2 * H * D, BIG, 1), device)
    _check_dense(a, *_materialize(a))


def test_head_major_outputs(device: torch.device) -> None:
    """``k_out``/``v_out`` ``[L, T, H, D]`` whose heads lie 2**30 elements apart (head-major, permuted)."""
    a = _inputs(2, device)
    k_out = _spread((2, T, H, D), (T * D, D, BIG, 1), device)
    v_out = _spread((2, T, H, D), (T * D, D, BIG, 1), device)
    k, v = _materialize(a, k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out
    _check_dense(a, k, v)


@pytest.mark.parametrize("name", ["positions", "k_norm_weight", "cos_sin_cache"])
def test_inputs_read_with_wide_strides(name: str, device: torch.device) -> None:
    """positions a column 2**30 apart; the norm weight's and the cos/sin cache's dims far apart."""
    a = _inputs(2, device)
    if name == "positions":
        a[name] = _spread((T,), (BIG,), device, torch.int32)
        a[name].copy_(torch.tensor([5, 0, 31], dtype=torch.int32))
    elif name == "k_norm_weight":
        a[name] = _spread((2, D), (1, 2**31 // (D - 2)), device)
        a[name].copy_(torch.rand(2, D) + 0.5)
    else:
        table = a[name]
        a[name] = _spread((P, D), (1, 2**31 // (D - 2)), device, table.dtype)
        a[name].copy_(table)
    _check_dense(a, *_materialize(a))


def test_head_major_pool(device: torch.device) -> None:
    """A stacked pool ``[L, S, H, D]`` whose heads lie 2**30 elements apart; V's pool ordinary."""
    a = _inputs(2, device)
    num_slots = 8
    k_pool = _spread((2, num_slots, H, D), (num_slots * D, D, BIG, 1), device)
    v_pool = torch.randn(2, num_slots, H, D).to(device, DTYPE)
    before_k, before_v = k_pool.cpu(), v_pool.cpu()
    cache_loc = torch.tensor([6, -1, 1], device=device)
    typedkv.materialize_kv_into_pool(
        a["kv"], a["k_norm_weight"], 1e-6, a["cos_sin_cache"], a["positions"], cache_loc, k_pool, v_pool,
        num_kv_heads=H,
    )  # fmt: skip
    ref_k, ref_v = _reference(a)
    k_pool, v_pool = k_pool.cpu(), v_pool.cpu()
    written = torch.tensor([0, 2])
    slots = cache_loc.cpu()[written]
    assert_k_close(k_pool[:, slots], ref_k[:, written], D, "neox")
    assert_bitwise_equal(v_pool[:, slots], ref_v[:, written], "v")
    untouched = torch.tensor([s for s in range(num_slots) if s not in slots.tolist()])
    assert torch.equal(k_pool[:, untouched], before_k[:, untouched])
    assert torch.equal(v_pool[:, untouched], before_v[:, untouched])


def test_layer_major_latent_rows(device: torch.device) -> None:
    """MLA: ckv ``[T, L, C+R]`` whose layers lie 2**30 elements apart."""
    torch.manual_seed(1)
    latent, rope = 32, 16
    ckv = _spread((T, 3, latent + rope), (latent + rope, BIG, 1), device)
    weight = (torch.rand(3, latent) + 0.5).to(device, DTYPE)
    table = typedkv.cos_sin_cache(P, rope, device=device)
    positions = torch.tensor([5, 0, 31], device=device)
    out = typedkv.materialize_mla_kv(ckv, weight, 1e-6, table, positions, rope_style="neox").cpu()
    ref = materialize_mla_kv64(ckv.cpu(), weight.cpu(), 1e-6, table.cpu(), positions.cpu(), "neox")
    assert_bitwise_equal(out[..., :latent], ref[..., :latent].to(DTYPE), "latent")
    torch.testing.assert_close(out[..., latent:].double(), ref[..., latent:], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("path", ["fused", "gemm"])
def test_materializer_into_a_head_major_pool(path: Literal["fused", "gemm"], device: torch.device) -> None:
    """A `KVMaterializer` (each projection path) into a pool whose heads lie 2**30 elements apart."""
    torch.manual_seed(2)
    hidden_size, num_layers, num_slots = 32, 2, 8
    weight = (torch.randn(num_layers, 2 * H * D, hidden_size) / hidden_size**0.5).to(device, DTYPE)
    norm = (torch.rand(num_layers, D) + 0.5).to(device, DTYPE)
    table = typedkv.cos_sin_cache(P, D, device=device)
    m = typedkv.KVMaterializer(weight, norm, 1e-6, table, num_kv_heads=H, rope_style="neox")
    m.projection_path = path
    hidden = torch.randn(T, hidden_size).to(device, DTYPE)
    positions, cache_loc = torch.tensor([5, 0, 31], device=device), torch.tensor([6, 3, 1], device=device)
    k_pool = _spread((num_layers, num_slots, H, D), (num_slots * D, D, BIG, 1), device)
    v_pool = _spread((num_layers, num_slots, H, D), (num_slots * D, D, BIG, 1), device)
    m.into_pool(hidden, positions, cache_loc, k_pool, v_pool)
    k, v = m(hidden, positions)  # dense, ordinary outputs: the same projection
    assert torch.equal(k_pool[:, cache_loc], k)
    assert torch.equal(v_pool[:, cache_loc], v)
