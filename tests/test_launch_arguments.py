"""Kernel arguments by name (`typedkv.core.launcher.KernelLaunch`): each parameter given once, by its name,
and a call's values, named once, filled in by position.

A launch is built once per layout from every argument by name and the names of those each call
passes; the kernel's positional order is read from its signature there, so a family writes no
argument list in the kernel's order. These tests run anywhere: nothing is launched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from typedkv.core import launcher
from typedkv.core.launch_args import INPUT_VALUES
from typedkv.kv import launch as kv_launch
from typedkv.kv.kernel import materialize_kv_kernel
from typedkv.mla import launch as mla_launch
from typedkv.mla.kernel import materialize_mla_kv_kernel
from typedkv.projection import launch as fused_launch
from typedkv.projection.kernel import project_kv_kernel


@triton.jit
def _add(x_ptr, y_ptr, scale, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * scale, mask=offsets < n)


def _arguments(**changed: Any) -> dict[str, Any]:
    return {"x_ptr": torch.zeros(4), "y_ptr": torch.zeros(4), "scale": 2.0, "n": 4, "BLOCK": 4, **changed}


def test_values_fill_their_names_in_any_order() -> None:
    """A call's values land at their parameters' places, whatever order the call gives them in."""
    x, y = torch.zeros(4), torch.ones(4)
    launch = launcher.KernelLaunch(_add, (1, 1, 1), _arguments(), ("scale", "y_ptr", "x_ptr"), 1)
    assert launch.arguments((3.0, y, x)) == (x, y, 3.0, 4, 4)
    with pytest.raises(ValueError, match="expected 3 per-call values, got 2"):
        launch.arguments((3.0, y))


def test_every_parameter_once_by_name() -> None:
    with pytest.raises(TypeError, match=r"missing \['n'\], unknown \[\]"):
        launcher.KernelLaunch(_add, (1, 1, 1), {k: v for k, v in _arguments().items() if k != "n"}, ("x_ptr",), 1)
    with pytest.raises(TypeError, match=r"missing \[\], unknown \['m'\]"):
        launcher.KernelLaunch(_add, (1, 1, 1), _arguments(m=1), ("x_ptr", "y_ptr", "scale"), 1)


def test_per_call_values_are_run_time_arguments_and_hold_every_tensor() -> None:
    """A constexpr is the layout's; a tensor or a float left to the layout would be the first call's at every call."""
    with pytest.raises(ValueError, match=r"\['BLOCK'\] given per call"):
        launcher.KernelLaunch(_add, (1, 1, 1), _arguments(), ("x_ptr", "y_ptr", "BLOCK"), 1)
    with pytest.raises(ValueError, match=r"\['z_ptr'\] given per call"):
        launcher.KernelLaunch(_add, (1, 1, 1), _arguments(), ("x_ptr", "y_ptr", "z_ptr"), 1)
    with pytest.raises(ValueError, match=r"\['y_ptr'\] hold tensors or floats"):
        launcher.KernelLaunch(_add, (1, 1, 1), _arguments(), ("x_ptr", "scale"), 1)
    with pytest.raises(ValueError, match=r"\['scale'\] hold tensors or floats"):
        launcher.KernelLaunch(_add, (1, 1, 1), _arguments(), ("x_ptr", "y_ptr"), 1)


def test_families_name_their_values_once() -> None:
    """Each family's per-call names are its kernel's parameters, none twice, the inputs' among them alike."""
    kernels = (
        (kv_launch.VALUES, materialize_kv_kernel),
        (mla_launch.VALUES, materialize_mla_kv_kernel),
        (fused_launch.VALUES, project_kv_kernel),
    )
    for names, kernel in kernels:
        assert len(set(names)) == len(names)
        assert set(names) <= set(launcher.parameter_names(kernel))
        assert set(INPUT_VALUES) <= set(names)


def test_launch_arguments_keep_their_python_types() -> None:
    """What Triton specialises on is the arguments' types too: ints stay ints, bools bools, None None."""
    kv = torch.randn(3, 2, 2 * 2 * 16)
    out = torch.empty(2, 3, 2, 16)
    strides = (out.stride(0), out.stride(1), 0, out.stride(2))
    values = kv_launch.call_values(
        kv, (None, 1e-6, torch.randn(8, 16), torch.zeros(3, dtype=torch.int64)), None, (out, out, None)
    )
    _, arguments, _ = kv_launch.launch_params(values, kv_launch.KVGeometry(2, 16, True, strides, strides, 3))
    assert type(arguments["eps"]) is float and arguments["eps_ptr"] is None and arguments["weight_ptr"] is None
    assert type(arguments["NORM"]) is bool and type(arguments["INDEXED"]) is bool
    assert all(type(arguments[name]) is int for name in ("k_stride_l", "v_stride_h", "num_rows", "weight_stride_d"))
    assert arguments["LAYER_TABLE"] == 0 and arguments["slots_stride"] == 0
