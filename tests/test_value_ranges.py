"""An eps or FP8 scale out of range is an `InputError`, before anything is written.

Both are computed with in float32: an eps is from 0 to float32's max, a scale in float32's normal range
(its reciprocal finite). Numbers (NaN, infinite, negative, past float32's max; a scale of 0 or below
float32's smallest normal; an int no float holds) are checked at every call, and an eps when a
materializer is built; ``[L]`` tensors in debug mode only (their values need a device sync), in
production they pass as before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import typedkv

L, T, H, D, P, S = 2, 3, 2, 16, 8, 8
FP8 = torch.float8_e4m3fn
F32 = torch.finfo(torch.float32)
EPS_RANGE = "a number from 0 to float32's max"
SCALE_RANGE = "a number in float32's normal range"


def _args() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "kv": torch.randn(T, L, 2 * H * D),
        "k_norm_weight": torch.rand(L, D) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, D),
        "positions": torch.arange(T),
    }


@pytest.fixture(autouse=True, params=["debug", "production"])
def mode(request: pytest.FixtureRequest) -> str:
    """Every test in both modes (the suite's own fixture turns debug mode on first)."""
    typedkv.set_debug(request.param == "debug")
    return str(request.param)


def _dense(args: dict[str, Any], **outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    a = args
    return typedkv.materialize_kv(
        a["kv"], a["k_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], num_kv_heads=H, **outputs
    )


def _into_fp8(args: dict[str, Any], k_scale: Any, v_scale: Any) -> torch.Tensor:
    a = args
    pools = torch.zeros(2, L, S, H, D, dtype=FP8)
    typedkv.materialize_kv_into_pool(
        a["kv"], a["k_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], torch.arange(T), pools[0],
        pools[1], num_kv_heads=H, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return pools


# Past float32's max an eps is infinite where it is used (every K zero); numpy's float64 is a float too.
BAD_EPS = [math.nan, math.inf, -1e-6, -1, [1e-6, math.nan], 3.5e38, 1e39, 10**39, [1e-6, 1e300], np.float64(math.nan)]


@pytest.mark.parametrize("eps", BAD_EPS, ids=str)
def test_eps_numbers_out_of_range(eps: Any) -> None:
    args = _args() | {"eps": eps}
    name = r"eps\[1\]" if isinstance(eps, list) else "eps"
    out = torch.zeros(2, L, T, H, D)
    with pytest.raises(typedkv.InputError, match=rf"^{name}: expected {EPS_RANGE} \(3.4028234663852886e\+38\), got "):
        _dense(args, k_out=out[0], v_out=out[1])
    assert not out.any()
    for norm_weight in (args["k_norm_weight"], list(args["k_norm_weight"])):  # stacked, or one per layer
        with pytest.raises(typedkv.InputError, match=rf"^{name}: expected {EPS_RANGE}"):
            typedkv.KVMaterializer(
                torch.randn(L, 2 * H * D, 8), norm_weight, eps, args["cos_sin_cache"], num_kv_heads=H
            )


@pytest.mark.parametrize("eps", [0.0, 0, 1e-5, [0.0, 1e-6], 1e-50, F32.max, [F32.max, 1e-6]], ids=str)
def test_eps_zero_and_small_pass(eps: Any) -> None:
    """Zero, small, and up to float32's max; one that rounds to 0 in float32 acts as 0."""
    args = _args() | {"eps": eps}
    k, _ = _dense(args)
    assert torch.isfinite(k).all()


# Below float32's smallest normal a scale's reciprocal is infinite in float32 (zero rows stored as NaN; the
# interpreter failed after K was written); past its max the scale itself is.
BAD_SCALES = [0.0, -0.5, math.inf, math.nan, 1e-45, 1e-40, F32.tiny / 2, 3.5e38, 1e39, 1e300, 2**128]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=str)
def test_scale_numbers_out_of_range(scale: float) -> None:
    args = _args()
    with pytest.raises(typedkv.InputError, match=rf"^v_scale: expected {SCALE_RANGE} \(1.1754943508222875e-38 to "):
        _into_fp8(args, 1.0, scale)
    ckv = torch.randn(T, L, 24)
    pool = torch.zeros(L, S, 24, dtype=FP8)
    with pytest.raises(typedkv.InputError, match=rf"^kv_scale: expected {SCALE_RANGE}"):
        typedkv.materialize_mla_kv_into_pool(
            ckv, None, 1e-6, typedkv.cos_sin_cache(P, 8), args["positions"], torch.arange(T), pool,
            rope_style="gptj", kv_scale=scale,
        )  # fmt: skip
    assert not pool.view(torch.uint8).any()


def test_scales_at_float32_limits_pass() -> None:
    """float32's smallest normal and its max are scales: a zero row stays zero (no NaN), nothing fails."""
    args = _args()
    args["kv"][0] = 0  # token 0: every layer's K and V zero
    for scale in (F32.tiny, F32.max):
        pools = _into_fp8(args, scale, scale)
        stored = pools[:, :, :T].float()
        assert not stored.isnan().any()
        assert not stored[:, :, 0].any()


HUGE = 10**400  # an int past float64's range


def _huge_eps(norm: bool, listed: bool) -> tuple[torch.Tensor, Callable[[], object]]:
    args = _args() | {"eps": [1e-6, HUGE] if listed else HUGE}
    if not norm:
        args["k_norm_weight"] = None
    out = torch.zeros(2, L, T, H, D)
    return out, lambda: _dense(args, k_out=out[0], v_out=out[1])


def _huge_k_scale() -> tuple[torch.Tensor, Callable[[], object]]:
    a = _args()
    pools = torch.zeros(2, L, S, H, D, dtype=FP8)
    return pools, lambda: typedkv.materialize_kv_into_pool(
        a["kv"], a["k_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], torch.arange(T), pools[0],
        pools[1], num_kv_heads=H, k_scale=HUGE,
    )  # fmt: skip


def _huge_kv_scale() -> tuple[torch.Tensor, Callable[[], object]]:
    pool = torch.zeros(L, S, 24, dtype=FP8)
    return pool, lambda: typedkv.materialize_mla_kv_into_pool(
        torch.randn(T, L, 24), None, 1e-6, typedkv.cos_sin_cache(P, 8), torch.arange(T), torch.arange(T), pool,
        rope_style="gptj", kv_scale=HUGE,
    )  # fmt: skip


def _huge_materializer_eps() -> tuple[torch.Tensor, Callable[[], object]]:
    weight = torch.randn(L, 2 * H * D, 8)
    return torch.zeros(1), lambda: typedkv.KVMaterializer(
        weight, None, [1e-6, HUGE], typedkv.cos_sin_cache(P, D), num_kv_heads=H
    )


HUGE_MISUSE: dict[str, tuple[str, Callable[[], tuple[torch.Tensor, Callable[[], object]]]]] = {
    "eps": ("eps", lambda: _huge_eps(norm=True, listed=False)),
    "eps-no-norm": ("eps", lambda: _huge_eps(norm=False, listed=False)),
    "eps-list": ("eps[1]", lambda: _huge_eps(norm=True, listed=True)),
    "eps-list-no-norm": ("eps[1]", lambda: _huge_eps(norm=False, listed=True)),
    "k_scale": ("k_scale", _huge_k_scale),
    "kv_scale": ("kv_scale", _huge_kv_scale),
    "materializer-eps": ("eps[1]", _huge_materializer_eps),
}


@pytest.mark.parametrize("misuse", sorted(HUGE_MISUSE))
def test_ints_no_float_holds(misuse: str) -> None:
    """An int past float64's range where a float goes: refused, with or without a norm weight (every path
    converts it to a float, which raised OverflowError), before anything is written."""
    name, make = HUGE_MISUSE[misuse]
    written, call = make()
    message = rf"^{re.escape(name)}: expected a float, got an int of 401 digits: past float64's range"
    with pytest.raises(typedkv.InputError, match=message):
        call()
    assert not written.view(torch.uint8).any()


def test_mla_eps_out_of_range() -> None:
    with pytest.raises(typedkv.InputError, match=rf"^eps: expected {EPS_RANGE} \(3.4028234663852886e\+38\), got -1.0"):
        typedkv.materialize_mla_kv(
            torch.randn(T, L, 24), torch.ones(L, 16), -1.0, typedkv.cos_sin_cache(P, 8), torch.arange(T),
            rope_style="gptj",
        )  # fmt: skip


def test_tensors_out_of_range_in_debug_mode_only(mode: str) -> None:
    """Production reads no tensor's values (no sync): what is out of range is computed with; debug mode names
    the layer, before anything is written."""
    args = _args() | {"eps": torch.tensor([1e-6, math.nan])}
    out = torch.zeros(2, L, T, H, D)
    bad_scales = torch.tensor([1.0, 0.0])
    if mode == "production":
        k, _ = _dense(args, k_out=out[0], v_out=out[1])
        assert torch.isnan(k[1]).all()
        _into_fp8(_args(), bad_scales, 1.0)
        return
    with pytest.raises(
        typedkv.InputError, match=r"^eps: expected values from 0 to float32's max .*, got nan at layer 1"
    ):
        _dense(args, k_out=out[0], v_out=out[1])
    assert not out.any()
    with pytest.raises(
        typedkv.InputError, match=r"^k_scale: expected values in float32's normal .*, got 0.0 at layer 1"
    ):
        _into_fp8(_args(), bad_scales, 1.0)
    _into_fp8(_args(), torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0]))  # in range: passes


@pytest.mark.parametrize(
    ("name", "values", "layer"),
    [
        ("k_scale", torch.tensor([1.0, 1e-39]), 1),  # a float32 subnormal: its reciprocal is infinite
        ("k_scale", torch.tensor([1.0, 1e-39], dtype=torch.bfloat16), 1),  # bfloat16 has them too
        ("v_scale", torch.tensor([1e-300, 1.0], dtype=torch.float64), 0),  # 0 in float32
        ("v_scale", torch.tensor([1.0, 1e300], dtype=torch.float64), 1),  # infinite in float32
        ("eps", torch.tensor([1e300, 1e-6], dtype=torch.float64), 0),  # infinite in float32: every K zero
    ],
    ids=["f32-subnormal", "bf16-subnormal", "f64-tiny", "f64-huge", "eps-f64-huge"],
)
def test_tensor_values_outside_float32_in_debug_mode(mode: str, name: str, values: torch.Tensor, layer: int) -> None:
    """Debug mode reads a tensor's values as the kernels do, in float32: finite there, a scale normal too."""
    args = _args()
    out = torch.zeros(2, L, T, H, D)
    call: Callable[[], object]
    if name == "eps":
        args["eps"] = values
        call = lambda: _dense(args, k_out=out[0], v_out=out[1])  # noqa: E731
    else:
        scales: dict[str, Any] = {"k_scale": 1.0, "v_scale": 1.0} | {name: values}
        call = lambda: _into_fp8(args, scales["k_scale"], scales["v_scale"])  # noqa: E731
    if mode == "production":
        call()  # values not read: computed with, as before
        return
    shown = re.escape(repr(float(values[layer])))
    with pytest.raises(typedkv.InputError, match=rf"^{name}: expected values .*, got {shown} at layer {layer}: "):
        call()
    assert not out.any()


def test_eps_without_a_norm_is_not_checked() -> None:
    """A RoPE-only draft (no norm weight) never reads eps: any number passes, as before."""
    args = _args() | {"k_norm_weight": None, "eps": math.nan}
    k, _ = _dense(args)
    assert torch.isfinite(k).all()
    m = typedkv.KVMaterializer(torch.randn(L, 2 * H * D, 8), None, -1.0, args["cos_sin_cache"], num_kv_heads=H)
    k, _ = m(torch.randn(T, 8), args["positions"])
    assert torch.isfinite(k).all()
