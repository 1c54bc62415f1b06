"""An eps or FP8 scale out of range is an `InputError`, before anything is written.

Numbers (NaN, infinite, negative; a scale of 0) are checked at every call, and an
eps when a materializer is built; ``[L]`` tensors in debug mode only (their values
need a device sync), in production they pass as before.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import typedkv

L, T, H, D, P, S = 2, 3, 2, 16, 8, 8
FP8 = torch.float8_e4m3fn


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


BAD_EPS = [math.nan, math.inf, -1e-6, -1, [1e-6, math.nan]]


@pytest.mark.parametrize("eps", BAD_EPS, ids=str)
def test_eps_numbers_out_of_range(eps: Any) -> None:
    args = _args() | {"eps": eps}
    name = r"eps\[1\]" if isinstance(eps, list) else "eps"
    out = torch.zeros(2, L, T, H, D)
    with pytest.raises(typedkv.InputError, match=rf"^{name}: expected a finite number >= 0, got "):
        _dense(args, k_out=out[0], v_out=out[1])
    assert not out.any()
    for norm_weight in (args["k_norm_weight"], list(args["k_norm_weight"])):  # stacked, or one per layer
        with pytest.raises(typedkv.InputError, match=rf"^{name}: expected a finite number >= 0"):
            typedkv.KVMaterializer(
                torch.randn(L, 2 * H * D, 8), norm_weight, eps, args["cos_sin_cache"], num_kv_heads=H
            )


@pytest.mark.parametrize("eps", [0.0, 0, 1e-5, [0.0, 1e-6]], ids=str)
def test_eps_zero_and_small_pass(eps: Any) -> None:
    args = _args() | {"eps": eps}
    k, _ = _dense(args)
    assert torch.isfinite(k).all()


@pytest.mark.parametrize("scale", [0.0, -0.5, math.inf, math.nan], ids=str)
def test_scale_numbers_out_of_range(scale: float) -> None:
    args = _args()
    with pytest.raises(typedkv.InputError, match=r"^v_scale: expected a finite number > 0, got "):
        _into_fp8(args, 1.0, scale)
    ckv = torch.randn(T, L, 24)
    pool = torch.zeros(L, S, 24, dtype=FP8)
    with pytest.raises(typedkv.InputError, match=r"^kv_scale: expected a finite number > 0"):
        typedkv.materialize_mla_kv_into_pool(
            ckv, None, 1e-6, typedkv.cos_sin_cache(P, 8), args["positions"], torch.arange(T), pool,
            rope_style="gptj", kv_scale=scale,
        )  # fmt: skip
    assert not pool.view(torch.uint8).any()


def test_mla_eps_out_of_range() -> None:
    with pytest.raises(typedkv.InputError, match=r"^eps: expected a finite number >= 0, got -1.0"):
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
    with pytest.raises(typedkv.InputError, match=r"^eps: expected finite values >= 0, got nan at layer 1"):
        _dense(args, k_out=out[0], v_out=out[1])
    assert not out.any()
    with pytest.raises(typedkv.InputError, match=r"^k_scale: expected finite values > 0, got 0.0 at layer 1"):
        _into_fp8(_args(), bad_scales, 1.0)
    _into_fp8(_args(), torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0]))  # in range: passes


def test_eps_without_a_norm_is_not_checked() -> None:
    """A RoPE-only draft (no norm weight) never reads eps: any number passes, as before."""
    args = _args() | {"k_norm_weight": None, "eps": math.nan}
    k, _ = _dense(args)
    assert torch.isfinite(k).all()
    m = typedkv.KVMaterializer(torch.randn(L, 2 * H * D, 8), None, -1.0, args["cos_sin_cache"], num_kv_heads=H)
    k, _ = m(torch.randn(T, 8), args["positions"])
    assert torch.isfinite(k).all()
