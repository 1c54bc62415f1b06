"""Host time per call of every public call (shipped drafts' features too), and of a plain ``kernel[grid]`` launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from typedkv.core.config import set_debug
from typedkv.core.launch_args import Inputs
from typedkv.core.launcher import in_order
from typedkv.kv import kernel as kv_kernel
from typedkv.kv import launch as kv_launch
from typedkv.kv.api import materialize_kv, materialize_kv_into_pool
from typedkv.mla.api import materialize_mla_kv, materialize_mla_kv_into_pool
from typedkv.projection.materializer import KVMaterializer
from typedkv.projection.mla_materializer import MLAKVMaterializer
from typedkv.tools.cases import GPU_CASES, MAIN, MLA_POOL, POOL, make_inputs, typedkv_call
from typedkv.tools.timing import _discard, host_time_us, paired_host_time_us


def sglang_style_wrapper(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """A wrapper written like sglang's fused_kv_materialize one: hand-written if-checks, then ``kernel[grid](...)``."""
    if kv.dim() != 3:
        raise ValueError(f"kv must be 3-D, got {tuple(kv.shape)}")
    total_ctx, n_layers, width = kv.shape
    head_dim = k_norm_weight.shape[-1]
    if width != 2 * num_kv_heads * head_dim:
        raise ValueError(f"kv last dim {width} != 2*{num_kv_heads}*{head_dim}")
    if k_norm_weight.shape != (n_layers, head_dim):
        raise ValueError(f"bad k_norm_weight shape {tuple(k_norm_weight.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"bad rotary dim {rotary_dim}")
    if eps.shape != (n_layers,):
        raise ValueError(f"bad eps shape {tuple(eps.shape)}")
    if positions.shape != (total_ctx,):
        raise ValueError(f"bad positions shape {tuple(positions.shape)}")
    if positions.device != kv.device:
        positions = positions.to(device=kv.device, dtype=torch.int64)
    elif positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    expected = (n_layers, total_ctx, num_kv_heads, head_dim)
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        if out.shape != expected:
            raise ValueError(f"Invalid {name} shape: got {tuple(out.shape)}, expected {expected}")
        if out.device != kv.device or out.dtype != kv.dtype:
            raise ValueError(f"Invalid {name} device/dtype")
    inputs = (k_norm_weight, eps, cos_sin_cache, positions)
    grid, params, num_warps = _launch(kv, inputs, num_kv_heads, k_out, v_out)
    kernel: Any = kv_kernel.materialize_kv_kernel
    kernel[grid](*params, num_warps=num_warps)


def _launch(
    kv: torch.Tensor, inputs: Inputs, num_kv_heads: int, k_out: torch.Tensor, v_out: torch.Tensor
) -> tuple[tuple[int, int, int], tuple[Any, ...], int]:
    """``(grid, arguments in order, num_warps)`` of the K/V kernel's launch into dense outputs (NeoX)."""
    values = kv_launch.call_values(kv, inputs, None, (k_out, v_out, None))
    k_strides, v_strides = ((out.stride(0), out.stride(1), 0, out.stride(2)) for out in (k_out, v_out))
    geometry = kv_launch.KVGeometry(num_kv_heads, k_out.shape[3], True, k_strides, v_strides, kv.shape[0])
    grid, arguments, num_warps = kv_launch.launch_params(values, geometry)
    return grid, in_order(kv_kernel.materialize_kv_kernel, arguments), num_warps


def host_overhead(device: torch.device) -> dict[str, float]:
    """Host microseconds per call at T = 16 (decode; the materializer's at 64 too): typedkv vs an sglang-style
    wrapper and a bare launch."""
    x = make_inputs(MAIN, 16, device)
    H = MAIN.num_kv_heads

    def production() -> None:
        materialize_kv(x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out)

    def sglang_style() -> None:
        sglang_style_wrapper(x.kv, x.weight, x.eps, x.cos_sin, x.positions, H, x.k_out, x.v_out)

    grid, params, num_warps = _launch(x.kv, (x.weight, x.eps, x.cos_sin, x.positions), H, x.k_out, x.v_out)
    kernel: Any = kv_kernel.materialize_kv_kernel

    def bare() -> None:
        kernel[grid](*params, num_warps=num_warps)

    out = {"bare_launch_us": host_time_us(bare), "sglang_style_wrapper_us": host_time_us(sglang_style)}
    out["typedkv_production_us"] = host_time_us(production)
    set_debug(True)
    try:
        out["typedkv_debug_us"] = host_time_us(production, calls=1000)
    finally:
        set_debug(False)
    # Every public call in production mode, alternated with the bare launch in rounds (the host is
    # bimodal: `paired_host_time_us`); the materializer's calls at T = 64 too, where its fused
    # kernel loads the weight by TMA (on Hopper and later).
    calls = public_calls(device) | feature_calls(device)
    wider = public_calls(device, 64)
    calls |= {f"{name}_t64": wider[name] for name in MATERIALIZER_CALLS}
    ratios = {}
    for name, fn in calls.items():
        out[f"{name}_us"], out[f"{name}_bare_launch_us"], ratios[name] = paired_host_time_us(fn, bare)
    out = {k: round(v, 2) for k, v in out.items()}
    out["production_vs_sglang_style"] = round(out["typedkv_production_us"] / out["sglang_style_wrapper_us"], 3)
    out["debug_vs_bare"] = round(out["typedkv_debug_us"] / out["bare_launch_us"], 3)
    for name, ratio in ratios.items():
        out[f"{name}_vs_bare"] = round(ratio, 3)
    for name, without in FEATURE_CALLS.items():
        out[f"{name}_vs_{without}"] = round(ratios[name] / ratios[without], 3)
    return out


MATERIALIZER_CALLS = ("materializer_call", "materializer_into_pool_per_layer")
"""`public_calls`' names of `KVMaterializer`'s calls (dense outputs; per-layer pools)."""


FEATURE_CALLS = {
    "materialize_kv_v_norm": "materialize_kv",
    "materialize_kv_layer_tables": "materialize_kv",
    "into_pool_stacked_fp8_scales_out": "into_pool_stacked_fp8",
    "into_pool_stacked_int8": "into_pool_stacked_fp8",
    "mla_into_pool_paged_fp8_ds_mla": "mla_into_pool_paged",
}
"""`feature_calls`' calls with a feature of a shipped draft, each with the call it adds to (its host time is
reported over that call's, both over a bare launch timed beside them)."""

_FEATURE_CASES = {
    "materialize_kv_v_norm": "L5 H8 D128 v-norm",
    "materialize_kv_layer_tables": "L5 H8 D128 layer-tables",
    "into_pool_stacked_fp8": "L5 H8 D128 pool fp8",
    "into_pool_stacked_fp8_scales_out": "L5 H8 D128 pool fp8 scales-out",
    "into_pool_stacked_int8": "L5 H8 D128 pool int8 scales-out",
    "mla_into_pool_paged_fp8_ds_mla": "MLA L5 C512 R64 B64 fp8_ds_mla",
}
"""`feature_calls`' bench cases (`typedkv.tools.cases.GPU_CASES`), by call."""


def public_calls(device: torch.device, num_tokens: int = 16) -> dict[str, Callable[[], None]]:
    """Every public call at decode size (the main K/V and MLA shapes), inputs made once."""
    x = make_inputs(POOL, num_tokens, device, num_slots=4096)
    H, L, D = POOL.num_kv_heads, POOL.num_layers, POOL.head_dim
    k_layers, v_layers = list(x.k_pool.unbind(0)), list(x.v_pool.unbind(0))
    hidden_size = 1024
    weights = torch.randn(L, 2 * H * D, hidden_size, device=device, dtype=POOL.dtype) / 32
    m = KVMaterializer(weights, x.weight, 1e-6, x.cos_sin, num_kv_heads=H)
    hidden = torch.randn(num_tokens, hidden_size, device=device, dtype=POOL.dtype)
    y = make_inputs(MLA_POOL, num_tokens, device, num_slots=4096)
    C, R = MLA_POOL.kv_lora_rank, MLA_POOL.rotary_dim
    mla = MLAKVMaterializer(
        torch.randn(L, C + R, hidden_size, device=device, dtype=MLA_POOL.dtype) / 32, y.weight, 1e-6, y.cos_sin,
        rope_style="gptj",
    )  # fmt: skip
    mla_layers = list(y.k_pool.unbind(0))
    return {
        "materialize_kv": lambda: _discard(
            materialize_kv(x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out)
        ),
        "into_pool_stacked": lambda: materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, x.v_pool, num_kv_heads=H
        ),
        "into_pool_per_layer": lambda: materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, x.slots, k_layers, v_layers, num_kv_heads=H
        ),
        "materializer_call": lambda: _discard(m(hidden, x.positions)),
        "materializer_into_pool_per_layer": lambda: m.into_pool(hidden, x.positions, x.slots, k_layers, v_layers),
        "materialize_mla_kv": lambda: _discard(
            materialize_mla_kv(y.kv, y.weight, y.eps, y.cos_sin, y.positions, rope_style="gptj", out=y.k_out)
        ),
        "mla_into_pool_paged": lambda: materialize_mla_kv_into_pool(
            y.kv, y.weight, y.eps, y.cos_sin, y.positions, y.slots, y.k_pool, rope_style="gptj"
        ),
        "mla_into_pool_per_layer": lambda: materialize_mla_kv_into_pool(
            y.kv, y.weight, y.eps, y.cos_sin, y.positions, y.slots, mla_layers, rope_style="gptj"
        ),
        "mla_materializer_call": lambda: _discard(mla(hidden, y.positions)),
        "mla_materializer_into_pool_paged": lambda: mla.into_pool(hidden, y.positions, y.slots, y.k_pool),
    }


def feature_calls(device: torch.device, num_tokens: int = 16) -> dict[str, Callable[[], None]]:
    """The calls of `FEATURE_CALLS` and those they add to that `public_calls` lacks, at decode size: each
    as the bench times its case (`typedkv_call`), inputs made once."""
    by_name = {case.name: case for case in GPU_CASES}
    return {
        name: typedkv_call(by_name[case], make_inputs(by_name[case], num_tokens, device, num_slots=4096))
        for name, case in _FEATURE_CASES.items()
    }
