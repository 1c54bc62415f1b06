"""Numerics of ``typedkv.materialize_kv`` against an independent float64 reference.

The same file runs twice in CI: on plain CPU it checks the PyTorch reference path,
with ``TRITON_INTERPRET=1`` it checks the Triton kernel itself under Triton's CPU
interpreter. The interpreter costs ~10 ms per program (one per token block, layer
and, with split launches, K/V half), so the parametrisation is shaped for it: the
full grid over ``D x R x dtype x rope_style`` runs at one small ``T``, and ``T`` is
varied on a smaller sub-grid.

Tolerances
----------
Let ``eps`` be the storage dtype's machine epsilon (``torch.finfo(dtype).eps``: 2**-7
for bfloat16, 2**-10 for float16, 2**-23 for float32), so one rounding to the
storage dtype moves a value ``x`` by at most ``eps/2 * |x|``. K is rounded to the
storage dtype twice, as the unfused model path does: after the norm and at the
store. The float64 reference does the first rounding too (from the exact norm
rather than from a float32 one, so the two can land one ulp apart when the float32
norm sits next to a rounding boundary), but not the second. For an element of a
rotated pair ``(a, b)`` with ``cos**2 + sin**2 = 1`` the error is therefore at most

    eps * (|a| |cos| + |b| |sin|)   (the normed values one ulp apart)
  + eps/2 * |out|                   (the store)
  <= 1.5 * eps * m,   m = hypot(out_a, out_b)  (the pair's length, kept by the rotation)

and ``m = |out|`` for a dim that passes through. The float32 math inside (a
D-long sum of squares, rsqrt, a few products: ~2**-24 each) is far below a 16-bit
ulp. Hence, per element, ``|k - ref| <= ulps * eps * m`` (plus two of the
smallest subnormals, for float16's subnormal range) with ``ulps`` = 2 for
bfloat16/float16. For float32 storage the float32 math *is* the error: the sum of
up to 256 squares (a tree reduction, ~log2(D) roundings), the rsqrt (approximate on
GPU, ~1-2 ulp), the norm and rotation products: ``ulps`` = 32 leaves room for all of
it and still fails on any real bug (a wrong weight, eps, angle or partner is off by
orders of magnitude more). Over the whole tensor the rounding errors average out:
``||k - ref|| / ||ref||`` is about ``0.2 * eps`` for the 16-bit dtypes; the bound
is ``1 * eps`` (16-bit) and ``8 * eps`` (float32). Measured over ``test_grid``'s
inputs, both paths: at most 0.74 ``eps * m`` per element and 0.22 ``eps`` overall
(16-bit), 2.3 and 0.66 (float32).

The tolerances cannot tell one rounding from two, nor round-to-nearest from
truncation (Triton's interpreter truncates float32 -> bfloat16; the kernel rounds
by hand so that it does not): `test_rounds_between_norm_and_rope` compares bits.

V is compared bit for bit (as integers), so ``-0.0``, NaN payloads and
subnormals count.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference64 import BOUNDARY, materialize_kv64, rotation_pairs
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.core import launcher
from typedkv.kv import kernel as kv_kernel
from typedkv.kv import launch as kv_launch

STORAGE = (torch.bfloat16, torch.float16, torch.float32)
STYLES: tuple[RopeStyle, ...] = ("neox", "gptj")
HEAD_DIMS = (64, 80, 96, 128, 256)

# See the module docstring for where these come from.
ELEMENT_ULPS = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 32.0}
NORM_ULPS = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 8.0}

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Case:
    """One set of ``materialize_kv`` inputs, and how to run the op and the reference on them."""

    kv: Tensor
    k_norm_weight: Tensor | None  # None: a RoPE-only draft
    eps: float | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    num_kv_heads: int
    rope_style: RopeStyle

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        num_tokens, num_layers, width = self.kv.shape
        return (num_layers, num_tokens, self.num_kv_heads, width // (2 * self.num_kv_heads))

    def run(self, k_out: Tensor | None = None, v_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(
            self.kv,
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            self.positions,
            num_kv_heads=self.num_kv_heads,
            rope_style=self.rope_style,
            k_out=k_out,
            v_out=v_out,
        )

    def reference(self, *, round_after_norm: bool = True) -> tuple[Tensor, Tensor]:
        return materialize_kv64(
            self.kv,
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            self.positions,
            self.num_kv_heads,
            self.rope_style,
            round_after_norm=round_after_norm,
        )


def _seed(*key: object) -> int:
    # A stable seed per parameter set: every case gets its own data, and a failure
    # reproduces (Python's hash() of a str is salted per process).
    return zlib.crc32(repr(key).encode())


def make_case(
    num_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    rope_style: RopeStyle = "neox",
    *,
    num_positions: int = 61,
    positions_dtype: torch.dtype = torch.int64,
    weight_dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype = torch.float32,
    eps: float | Tensor = 1e-6,
    seed: int | None = None,
    norm: bool = True,
) -> Case:
    """Random inputs (never zeros) for one shape.

    Each ``(token, layer, head)`` row of K gets its own scale (a power of two in
    ``[1/16, 16]``): RMSNorm is invariant to it only if the norm is taken over
    exactly that row, so a reduction over the wrong axis shows. The cos/sin cache
    holds random angles (every quadrant, cos and sin unrelated across columns),
    so a swapped cos/sin, a wrong frequency column or a wrong position row shows.
    """
    if seed is None:
        seed = _seed(num_tokens, num_layers, num_kv_heads, head_dim, rotary_dim, dtype, rope_style)
    gen = torch.Generator().manual_seed(seed)
    width = num_kv_heads * head_dim
    kv = torch.randn(num_tokens, num_layers, 2, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    row_scale = torch.exp2(torch.randint(-4, 5, (num_tokens, num_layers, 2, num_kv_heads, 1), generator=gen))
    kv = (kv * row_scale).reshape(num_tokens, num_layers, 2 * width).to(dtype)
    weight = (torch.rand(num_layers, head_dim, generator=gen, dtype=torch.float64) + 0.5).to(weight_dtype)
    angles = torch.rand(num_positions, rotary_dim // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
    cache = torch.cat((angles.cos(), angles.sin()), dim=1).to(cache_dtype)
    positions = torch.randint(0, num_positions, (num_tokens,), generator=gen).to(positions_dtype)
    return Case(kv, weight if norm else None, eps, cache, positions, num_kv_heads, rope_style)


# --------------------------------------------------------------------------- checks


def bits(t: Tensor) -> Tensor:
    """``t``'s bits as integers of the same width, so equality is bit for bit."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def assert_bitwise_equal(got: Tensor, want: Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    same = bits(got) == bits(want)
    if not bool(same.all()):
        i = tuple(int(j) for j in (~same).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {same.numel()} elements differ in their bits; "
            f"first at {i}: got {got[i].item()!r}, want {want[i].item()!r}"
        )


def pair_length(k: Tensor, rotary_dim: int, rope_style: RopeStyle) -> Tensor:
    """Per element, the length of the vector RoPE rotates it in (``|k|`` past ``R``)."""
    length = k.abs()
    first, second = rotation_pairs(rotary_dim, rope_style)
    pair = torch.hypot(k[..., first], k[..., second])
    length[..., first] = pair
    length[..., second] = pair
    return length


def assert_k_close(k: Tensor, ref: Tensor, rotary_dim: int, rope_style: RopeStyle) -> None:
    """``k`` (storage dtype) within the documented tolerance of ``ref`` (float64, NaN rows allowed)."""
    dtype = k.dtype
    assert k.shape == ref.shape, f"k: shape {tuple(k.shape)} != {tuple(ref.shape)}"
    nan = ref.isnan()
    got_nan = k.isnan()
    if not torch.equal(got_nan, nan):
        i = tuple(int(j) for j in (got_nan != nan).nonzero()[0])
        raise AssertionError(f"k: NaN pattern differs, first at {i}: got {k[i].item()}, want {ref[i].item()}")
    finite = ~nan
    if not bool(finite.any()):
        return
    info = torch.finfo(dtype)
    eps = info.eps
    got = k.to(torch.float64)
    err = (got - ref).abs()
    scale = pair_length(ref, rotary_dim, rope_style)
    bound = ELEMENT_ULPS[dtype] * eps * scale + 2 * info.smallest_normal * eps
    bad = (err > bound) & finite
    if bool(bad.any()):
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(
            f"k ({dtype}): {int(bad.sum())} of {int(finite.sum())} elements out of tolerance; first at "
            f"[l, t, h, d] = {i}: got {got[i].item()!r}, want {ref[i].item()!r} "
            f"(error {err[i].item() / (eps * scale[i].item()):.2f} eps of the pair length {scale[i].item():.4g}, "
            f"allowed {ELEMENT_ULPS[dtype]})"
        )
    rel = float(torch.linalg.vector_norm(got[finite] - ref[finite]) / torch.linalg.vector_norm(ref[finite]))
    assert rel <= NORM_ULPS[dtype] * eps, (
        f"k ({dtype}): relative error {rel:.3g} = {rel / eps:.2f} eps, allowed {NORM_ULPS[dtype]} eps"
    )


def v_normed_ok(v: Tensor, ref: Tensor) -> Tensor:
    """Per element: a normed V (``v``, the storage dtype) is the exact normed V (``ref``, float64,
    `reference64.materialize_kv64`'s with ``v_norm_weight``) rounded once to the storage dtype.

    16-bit storage: rounded to nearest, or, where the exact value lies within ``BOUNDARY`` (relative) of a
    rounding boundary, to the other neighbour (the op's float32 norm may land on either side); float32
    storage: within `ELEMENT_ULPS` of it, the float32 norm being the error (as K's, module docstring).
    """
    dtype = v.dtype
    if dtype == torch.float32:
        info = torch.finfo(dtype)
        slack = ELEMENT_ULPS[dtype] * info.eps * ref.abs() + 2 * info.smallest_normal * info.eps
        return (v.double() - ref).abs() <= slack
    # Values, not bits: a zero's sign may differ (a projection's exact zero, summed from +0.0 or not).
    ok = v == ref.to(dtype)
    for nudge in (1 - BOUNDARY, 1 + BOUNDARY):
        ok |= v == (ref * nudge).to(dtype)
    return ok


def assert_v_normed(v: Tensor, ref: Tensor) -> None:
    """``v`` is `v_normed_ok` everywhere (``[L, T, H, D]``)."""
    assert v.shape == ref.shape, f"v: shape {tuple(v.shape)} != {tuple(ref.shape)}"
    ok = v_normed_ok(v, ref)
    if not bool(ok.all()):
        i = tuple(int(j) for j in (~ok).nonzero()[0])
        raise AssertionError(
            f"v ({v.dtype}): {int((~ok).sum())} of {ok.numel()} normed elements are not the exact norm rounded once; "
            f"first at [l, t, h, d] = {i}: got {v[i].item()!r}, want {ref[i].item()!r}"
        )


def assert_matches_reference(case: Case, k: Tensor, v: Tensor) -> None:
    ref_k, ref_v = case.reference()
    assert k.dtype == case.kv.dtype and v.dtype == case.kv.dtype
    assert tuple(k.shape) == case.out_shape and tuple(v.shape) == case.out_shape
    assert_bitwise_equal(v, ref_v, "v")
    assert_k_close(k, ref_k, case.cos_sin_cache.shape[1], case.rope_style)


def check(case: Case) -> tuple[Tensor, Tensor]:
    """Run the op on ``case``, compare with the reference, and return ``(k, v)``."""
    k, v = case.run()
    assert_matches_reference(case, k, v)
    return k, v


# --------------------------------------------------------------------------- grids


def _dims_and_rotary(head_dims: tuple[int, ...] = HEAD_DIMS) -> list[Any]:
    # R in (D, D/2, 32); for D = 64 the last two coincide and run once.
    pairs = sorted({(d, r) for d in head_dims for r in (d, d // 2, 32)})
    return [pytest.param(d, r, id=f"D{d}-R{r}") for d, r in pairs]


_LAYERS_HEADS = [pytest.param(1, 1, id="L1-H1"), pytest.param(3, 2, id="L3-H2")]
_DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in STORAGE]


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), _dims_and_rotary())
@pytest.mark.parametrize(("num_layers", "num_kv_heads"), _LAYERS_HEADS)
def test_grid(
    num_layers: int, num_kv_heads: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, rope_style: RopeStyle
) -> None:
    """Every head dim x rotary dim x dtype x style, at T = 7."""
    check(make_case(7, num_layers, num_kv_heads, head_dim, rotary_dim, dtype, rope_style))


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"), [pytest.param(80, 32, id="D80-R32"), pytest.param(256, 128, id="D256-R128")]
)
@pytest.mark.parametrize(
    ("num_layers", "num_kv_heads"), [pytest.param(1, 2, id="L1-H2"), pytest.param(3, 1, id="L3-H1")]
)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
def test_num_tokens(
    num_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    rope_style: RopeStyle,
) -> None:
    """T varied on a sub-grid (T = 0 included: empty results of the right shape)."""
    check(make_case(num_tokens, num_layers, num_kv_heads, head_dim, rotary_dim, dtype, rope_style))


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), _dims_and_rotary((64, 80, 128)))
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_rope_only(num_tokens: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """k_norm_weight=None: K is RoPE(k), D read from kv's width (eps unused), V as always."""
    case = make_case(num_tokens, 3, 2, head_dim, rotary_dim, dtype, rope_style, eps=float("nan"), norm=False)
    k, _ = check(case)
    # Past R, K is kv's K block itself, bit for bit: nothing scaled it.
    heads = 2 * head_dim
    k_in = case.kv[..., :heads].unflatten(-1, (2, head_dim)).transpose(0, 1)
    assert_bitwise_equal(k[..., rotary_dim:], k_in[..., rotary_dim:], "k past R")


# (BLOCK_T, SPLIT_KV, LAYER_FAST, FULL_ROW, V_FIRST): configurations the kernel
# supports (the launcher picks among them by size and shape,
# docs/decisions/001-kv-kernel-launch-configuration.md). FULL_ROW only applies to NeoX with R < D, as here; V_FIRST only
# without SPLIT_KV.
_KERNEL_CONFIGS = [
    (1, True, True, True, False),
    (1, False, False, False, False),
    (4, True, False, True, False),
    (8, False, True, False, False),
    (16, True, True, True, False),
    (2, False, True, True, False),
    (1, False, True, False, True),
    (4, False, True, True, True),
]


@pytest.mark.skipif(not launcher.INTERPRETED, reason="launches the kernel itself: TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize(
    ("block_t", "split_kv", "layer_fast", "full_row", "v_first"),
    _KERNEL_CONFIGS,
    ids=[
        f"BT{b}-{'split' if s else 'fused'}-{'layerfast' if f else 'tokenfast'}-{'row' if r else 'pieces'}"
        + ("-vfirst" if v else "")
        for b, s, f, r, v in _KERNEL_CONFIGS
    ],
)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
def test_kernel_configs(
    block_t: int, split_kv: bool, layer_fast: bool, full_row: bool, v_first: bool, rope_style: RopeStyle, norm: bool
) -> None:
    """Every launch configuration computes the same thing, partial token blocks included."""
    config = kv_launch.KVConfig(
        block_t=block_t, split_kv=split_kv, full_row=full_row, layer_fast=layer_fast, v_first=v_first
    )
    # T = 21 leaves a partial last block for every BLOCK_T > 1.
    case = make_case(21, 2, 3, 80, 32, torch.bfloat16, rope_style, norm=norm)
    k_out, v_out = torch.empty(case.out_shape, dtype=case.kv.dtype), torch.empty(case.out_shape, dtype=case.kv.dtype)
    k_strides, v_strides = ((t.stride(0), t.stride(1), 0, t.stride(2)) for t in (k_out, v_out))
    inputs = (case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions)
    values = kv_launch.call_values(case.kv, inputs, None, (k_out, v_out, None))
    geometry = kv_launch.KVGeometry(
        case.num_kv_heads, case.out_shape[3], rope_style == "neox", k_strides, v_strides, 21
    )
    launch = kv_launch.Launch(values, geometry, config=config)
    # The configuration asked for is the one launched: programs per token block and layer, K/V split.
    assert launch.grid == (-(-21 // block_t) * 2, 1, 2 if split_kv else 1)
    launch(values)
    assert_matches_reference(case, k_out, v_out)


@pytest.mark.skipif(not launcher.INTERPRETED, reason="launches the kernel itself: TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_t", [1, 4])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
def test_partner_gathered_or_loaded_gives_the_same_bits(block_t: int, norm: bool, dtype: torch.dtype) -> None:
    """K as one tile: each rotary dim's partner gathered in registers gives the bits of its second load."""
    # T = 21 leaves a partial last block at BLOCK_T = 4; R < D makes K one tile (NeoX).
    case = make_case(21, 2, 3, 80, 32, dtype, "neox", norm=norm)
    inputs = (case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions)
    outs = []
    for gather in (False, True):
        k_out, v_out = torch.empty(case.out_shape, dtype=dtype), torch.empty(case.out_shape, dtype=dtype)
        k_strides, v_strides = ((t.stride(0), t.stride(1), 0, t.stride(2)) for t in (k_out, v_out))
        config = kv_launch.KVConfig(block_t=block_t, full_row=True, partner_gather=gather)
        values = kv_launch.call_values(case.kv, inputs, None, (k_out, v_out, None))
        geometry = kv_launch.KVGeometry(case.num_kv_heads, case.out_shape[3], True, k_strides, v_strides, 21)
        # The switch reaches the kernel: FULL_ROW 2 gathers, 1 loads again.
        assert kv_launch.launch_params(values, geometry, config=config)[1]["FULL_ROW"] == (2 if gather else 1)
        launch = kv_launch.Launch(values, geometry, config=config)
        launch(values)
        assert_matches_reference(case, k_out, v_out)
        outs.append((k_out, v_out))
    assert_bitwise_equal(outs[0][0], outs[1][0], "k")
    assert_bitwise_equal(outs[0][1], outs[1][1], "v")


@pytest.mark.parametrize(
    ("num_tokens", "num_layers", "config", "warps"),
    [
        (16, 5, kv_launch.KVConfig(), 8),  # 160 K/V programs: the fewest take 8 warps
        (64, 5, kv_launch.KVConfig(), 8),
        (256, 1, kv_launch.KVConfig(), 8),
        (256, 5, kv_launch.KVConfig(), 4),  # 2560 programs
        (128, 8, kv_launch.KVConfig(), 4),
        (8192, 5, kv_launch.KVConfig(), 4),  # K and V in one program
        (16, 5, kv_launch.KVConfig(num_warps=2), 2),  # a configuration's own is kept
    ],
)
def test_launch_warps(num_tokens: int, num_layers: int, config: kv_launch.KVConfig, warps: int) -> None:
    """The K/V kernel's warps per program, as measured on the H200 (`typedkv.kv.launch.launch_params`)."""
    H, D = 8, 128
    kv = torch.empty(num_tokens, num_layers, 2 * H * D, dtype=torch.bfloat16)
    out = torch.empty(num_layers, num_tokens, H, D, dtype=torch.bfloat16)
    strides = (out.stride(0), out.stride(1), 0, out.stride(2))
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    values = kv_launch.call_values(kv, (None, 1e-6, torch.empty(8, D), positions), None, (out, out, None))
    geometry = kv_launch.KVGeometry(H, D, True, strides, strides, num_tokens)
    _, _, num_warps = kv_launch.launch_params(values, geometry, config=config)
    assert num_warps == warps


# --------------------------------------------------------------------------- argument kinds


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("rope_style", STYLES)
def test_positions_dtypes(positions_dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """int32 and int64 positions, including the first and the last cache row."""
    case = make_case(9, 2, 2, 64, 64, torch.float16, rope_style, num_positions=5, positions_dtype=positions_dtype)
    positions = case.positions.clone()
    positions[0], positions[-1] = 0, 4
    check(replace(case, positions=positions))


@pytest.mark.parametrize(
    ("weight_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float64, torch.float32),
    ],
    ids=["w-bf16-cs-f64", "w-f16-cs-f16", "w-f32-cs-bf16", "w-f64-cs-f32"],
)
@pytest.mark.parametrize("dtype", _DTYPES)
def test_parameter_dtypes(dtype: torch.dtype, weight_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Norm weights and cos/sin caches of any float dtype (the reference uses their exact values)."""
    check(make_case(5, 2, 2, 96, 48, dtype, weight_dtype=weight_dtype, cache_dtype=cache_dtype))


@pytest.mark.parametrize("eps_kind", ["float", "tensor-f32", "tensor-f64"])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_eps(eps_kind: str, dtype: torch.dtype) -> None:
    """eps as a float and as a per-layer tensor, large enough to change the result."""
    eps: float | Tensor
    if eps_kind == "float":
        eps = 0.75
    else:
        eps = torch.tensor([1e-6, 1.0, 16.0], dtype=torch.float32 if eps_kind == "tensor-f32" else torch.float64)
    case = make_case(6, 3, 2, 64, 32, dtype, eps=eps)
    k, _ = check(case)
    # The test can see eps: the result with eps = 1e-6 everywhere is far outside tolerance.
    other, _ = replace(case, eps=1e-6).reference()
    layers = slice(0, 3) if eps_kind == "float" else slice(1, 3)
    with pytest.raises(AssertionError):
        assert_k_close(k[layers], other[layers], 32, case.rope_style)


@pytest.mark.parametrize("dtype", _DTYPES)
def test_per_layer_eps_is_per_layer(dtype: torch.dtype) -> None:
    """Layer l uses eps[l]: the same as calling layer by layer with a float eps."""
    eps = torch.tensor([2.0, 1e-5, 0.25])
    case = make_case(5, 3, 2, 80, 80, dtype, eps=eps)
    k, v = check(case)
    assert case.k_norm_weight is not None
    for layer in range(3):
        single = replace(case, kv=case.kv[:, layer : layer + 1], k_norm_weight=case.k_norm_weight[layer : layer + 1])
        k1, v1 = replace(single, eps=float(eps[layer])).run()
        assert_bitwise_equal(k1, k[layer : layer + 1], f"k of layer {layer}")
        assert_bitwise_equal(v1, v[layer : layer + 1], f"v of layer {layer}")


# --------------------------------------------------------------------------- layouts


def _strided_kv(case: Case, layout: str) -> tuple[Tensor, Tensor]:
    """``case.kv``'s values in a non-contiguous view; returns ``(view, its base)``."""
    kv = case.kv
    num_tokens, num_layers, width = kv.shape
    if layout == "wide-row":  # kv = big[:, :, :2*H*D] of a wider fused projection (e.g. Q, K, V)
        base = torch.full((num_tokens, num_layers, width + 3 * 16), -5.0, dtype=kv.dtype)
        view = base[:, :, :width]
    elif layout == "offset-row":  # K/V after a Q block: a non-zero storage offset
        base = torch.full((num_tokens, num_layers, width + 40), -5.0, dtype=kv.dtype)
        view = base[:, :, 40:]
    elif layout == "layer-slice":  # every other layer of a larger stack
        base = torch.full((num_tokens, 2 * num_layers, width), -5.0, dtype=kv.dtype)
        view = base[:, ::2]
    elif layout == "token-slice":  # every other token
        base = torch.full((2 * num_tokens, num_layers, width), -5.0, dtype=kv.dtype)
        view = base[::2]
    elif layout == "layer-major":  # stored [L, T, 2*H*D], seen as [T, L, 2*H*D]
        base = torch.full((num_layers, num_tokens, width), -5.0, dtype=kv.dtype)
        view = base.transpose(0, 1)
    else:
        raise AssertionError(layout)
    view.copy_(kv)
    return view, base


@pytest.mark.parametrize("layout", ["wide-row", "offset-row", "layer-slice", "token-slice", "layer-major"])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_strided_kv(layout: str, dtype: torch.dtype) -> None:
    """A strided kv gives the same bits as a contiguous one, and is not written to."""
    case = make_case(7, 3, 2, 80, 32, dtype, "gptj")
    view, base = _strided_kv(case, layout)
    assert not view.is_contiguous()
    before = base.clone()
    strided = replace(case, kv=view)
    k, v = check(strided)
    k_dense, v_dense = case.run()
    assert_bitwise_equal(k, k_dense, "k (strided vs contiguous kv)")
    assert_bitwise_equal(v, v_dense, "v (strided vs contiguous kv)")
    assert_bitwise_equal(base, before, "kv's storage")


@pytest.mark.parametrize("rope_style", STYLES)
def test_strided_parameters(rope_style: RopeStyle) -> None:
    """Non-contiguous weight, cache and positions: every stride is honoured."""
    case = make_case(7, 3, 2, 64, 48, torch.bfloat16, rope_style)
    assert case.k_norm_weight is not None
    weight = torch.empty(case.k_norm_weight.shape[::-1]).t()  # [L, D] with strides (1, L)
    weight.copy_(case.k_norm_weight)
    cache = torch.empty(case.cos_sin_cache.shape[0], 2 * case.cos_sin_cache.shape[1])[:, 1::2]
    cache.copy_(case.cos_sin_cache)
    positions = torch.empty(3 * case.positions.shape[0], dtype=case.positions.dtype)[1::3]
    positions.copy_(case.positions)
    for t in (weight, cache, positions):
        assert not t.is_contiguous()
    k, v = check(replace(case, k_norm_weight=weight, cos_sin_cache=cache, positions=positions))
    k_dense, v_dense = case.run()
    assert_bitwise_equal(k, k_dense, "k (strided vs contiguous parameters)")
    assert_bitwise_equal(v, v_dense, "v (strided vs contiguous parameters)")


def test_strided_eps() -> None:
    """A per-layer eps that is a strided view (a column of a per-layer table) is read by stride."""
    case = make_case(7, 3, 2, 64, 48, torch.bfloat16, eps=torch.tensor([1e-6, 0.5, 2.0]))
    table = torch.full((3, 2), 100.0)  # [L, 2]: eps in column 0, something else in column 1
    eps = table[:, 0]
    eps.copy_(torch.tensor([1e-6, 0.5, 2.0]))
    assert eps.stride() == (2,)
    k, v = check(replace(case, eps=eps))
    k_dense, v_dense = case.run()
    assert_bitwise_equal(k, k_dense, "k (strided vs contiguous eps)")
    assert_bitwise_equal(v, v_dense, "v (strided vs contiguous eps)")


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> Tensor:
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize("passed", ["both", "k_out", "v_out"])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_outputs_into_slab(passed: str, dtype: torch.dtype) -> None:
    """k_out/v_out as ``[:, :T]`` views of larger slabs: written in place, returned as is,
    nothing outside the view touched."""
    case = make_case(7, 3, 2, 96, 96, dtype)
    num_layers, num_tokens, heads, head_dim = case.out_shape
    slab_shape = (num_layers, num_tokens + 5, heads, head_dim)
    # NaN for K (the op never writes NaN for in-range positions); a sentinel for V.
    k_slab = _poisoned(slab_shape, dtype, float("nan"))
    v_slab = _poisoned(slab_shape, dtype, -1234.0)
    k_before, v_before = k_slab.clone(), v_slab.clone()
    k_out = k_slab[:, :num_tokens] if passed in ("both", "k_out") else None
    v_out = v_slab[:, :num_tokens] if passed in ("both", "v_out") else None
    k, v = case.run(k_out, v_out)
    assert_matches_reference(case, k, v)
    if k_out is not None:
        assert k is k_out
        assert_bitwise_equal(k_slab[:, num_tokens:], k_before[:, num_tokens:], "k slab past T")
    else:
        assert_bitwise_equal(k_slab, k_before, "k slab (not passed)")
    if v_out is not None:
        assert v is v_out
        assert_bitwise_equal(v_slab[:, num_tokens:], v_before[:, num_tokens:], "v slab past T")
    else:
        assert_bitwise_equal(v_slab, v_before, "v slab (not passed)")


def test_outputs_with_head_padding() -> None:
    """Outputs viewed out of slabs padded in T, H and D: only the viewed elements are written."""
    case = make_case(5, 2, 3, 80, 32, torch.float16)
    num_layers, num_tokens, heads, head_dim = case.out_shape
    k_slab = _poisoned((num_layers, num_tokens + 2, heads + 1, head_dim + 16), torch.float16, float("nan"))
    v_slab = _poisoned((num_layers, num_tokens + 2, heads + 1, head_dim + 16), torch.float16, -1234.0)
    k_before, v_before = k_slab.clone(), v_slab.clone()
    k_out = k_slab[:, :num_tokens, :heads, :head_dim]
    v_out = v_slab[:, :num_tokens, :heads, :head_dim]
    k, v = case.run(k_out, v_out)
    assert k is k_out and v is v_out
    assert_matches_reference(case, k, v)
    k_slab[:, :num_tokens, :heads, :head_dim] = k_before[:, :num_tokens, :heads, :head_dim]
    v_slab[:, :num_tokens, :heads, :head_dim] = v_before[:, :num_tokens, :heads, :head_dim]
    assert_bitwise_equal(k_slab, k_before, "k slab outside the view")
    assert_bitwise_equal(v_slab, v_before, "v slab outside the view")


@pytest.mark.parametrize("dtype", _DTYPES)
def test_empty_batch(dtype: torch.dtype) -> None:
    """T == 0: empty results of the right shape and dtype, given outputs returned as is."""
    case = make_case(0, 3, 2, 80, 32, dtype)
    k, v = case.run()
    assert k.shape == v.shape == (3, 0, 2, 80)
    assert k.dtype == v.dtype == dtype
    k_out, v_out = torch.empty(3, 0, 2, 80, dtype=dtype), torch.empty(3, 0, 2, 80, dtype=dtype)
    k, v = case.run(k_out, v_out)
    assert k is k_out and v is v_out


# --------------------------------------------------------------------------- values


# (quiet NaN with payload 1, negative quiet NaN with payload 3, signalling NaN) as unsigned bits.
_ODD_NANS = {
    torch.bfloat16: (0x7FC1, 0xFFC3, 0x7F81),
    torch.float16: (0x7E01, 0xFE03, 0x7C01),
    torch.float32: (0x7FC00001, 0xFFC00003, 0x7F800001),
}


@pytest.mark.parametrize("dtype", _DTYPES)
def test_v_bits_survive(dtype: torch.dtype) -> None:
    """V is a bit copy: -0.0, infinities, NaN payloads and subnormals come out unchanged."""
    case = make_case(4, 2, 2, 64, 64, dtype)
    kv = case.kv.clone()
    row = kv[1, 1, 2 * 64 :]  # V of token 1, layer 1: heads 0 and 1
    info = torch.finfo(dtype)
    specials = [-0.0, math.inf, -math.inf, info.smallest_normal / 4, -info.smallest_normal / 8, info.max]
    row[: len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
    # NaNs with payloads, a negative one and a signalling one: a float round trip
    # may canonicalise or quieten them.
    width = 8 * row.element_size()
    for i, raw in enumerate(_ODD_NANS[dtype]):
        bits(row)[70 + i] = raw - (1 << width) if raw >> (width - 1) else raw
    assert int(row.isnan().sum()) == 3 and int((row == 0).sum()) == 1
    check(replace(case, kv=kv))


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rounds_between_norm_and_rope(dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """K matches the unfused path (norm, *round*, RoPE), not a fused single rounding.

    The two differ by half an ulp of the normed value, inside the per-element
    tolerance, so this compares bits: rounding the exact unfused result once more
    must reproduce the op's K almost everywhere (float32 vs float64 math may put a
    value on the other side of a rounding boundary, ~1e-4 of the time), while the
    single-rounding variant must not (it differs in a large fraction of elements;
    that second assertion shows the test can tell the two apart).
    """
    case = make_case(33, 1, 2, 128, 128, dtype, rope_style)
    k, _ = case.run()
    unfused, _ = case.reference()
    fused, _ = case.reference(round_after_norm=False)
    same_unfused = float((bits(k) == bits(unfused.to(dtype))).double().mean())
    same_fused = float((bits(k) == bits(fused.to(dtype))).double().mean())
    assert same_unfused >= 0.99, f"only {same_unfused:.2%} of K equal the unfused path rounded"
    assert same_fused < 0.95, f"{same_fused:.2%} of K equal the single-rounding path: the data cannot tell"


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
def test_zero_heads(dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """An all-zero K head (a padding token) normalises to zeros, not NaN: eps keeps rsqrt finite."""
    case = make_case(3, 2, 2, 64, 32, dtype, rope_style)
    kv = case.kv.clone()
    kv[0, :, :64] = 0.0  # token 0, every layer: head 0's K
    kv[2, 1, 64:128] = -0.0  # token 2, layer 1: head 1's K
    k, _ = check(replace(case, kv=kv))
    assert bool((k[:, 0, 0] == 0).all()) and bool((k[1, 2, 1] == 0).all())


@pytest.mark.parametrize("dtype", _DTYPES)
def test_signed_zero_kept(dtype: torch.dtype) -> None:
    """K zeros carry the sign the unfused path gives them (``-0.0 * w`` is ``-0.0``)."""
    case = make_case(2, 1, 1, 64, 32, dtype, "neox")
    kv = case.kv.clone()
    kv[0, 0, 40] = -0.0  # a pass-through dim: the unfused path keeps -0.0
    kv[1, 0, :64] = -0.0  # a whole head: rotated zeros get the signs IEEE arithmetic gives them
    case = replace(case, kv=kv)
    k, _ = check(case)
    ref, _ = case.reference()
    zero = ref == 0
    assert int(zero.sum()) == 65
    assert_bitwise_equal(k[zero], ref.to(dtype)[zero], "K zeros (sign bits)")


@pytest.mark.production
@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_out_of_range_positions_production(positions_dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """Production mode: a position outside ``[0, P)`` gives that token an all-NaN K, never an
    IndexError or a stray read; its V is still copied and every other token is right."""
    assert not typedkv.debug_enabled()
    num_positions = 17
    case = make_case(12, 3, 2, 64, 32, torch.bfloat16, rope_style, num_positions=num_positions)
    info = torch.iinfo(positions_dtype)
    bad = {1: -1, 3: num_positions, 4: num_positions + 1000, 6: info.max, 7: info.min, 9: -num_positions}
    positions = case.positions.to(positions_dtype).clone()
    for t, p in bad.items():
        positions[t] = p
    case = replace(case, positions=positions)
    k, _ = check(case)  # the reference NaNs exactly the bad tokens and checks the rest
    bad_tokens = torch.zeros(12, dtype=torch.bool)
    bad_tokens[list(bad)] = True
    assert bool(k[:, bad_tokens].isnan().all())
    assert not bool(k[:, ~bad_tokens].isnan().any())


@pytest.mark.production
def test_empty_cache_production() -> None:
    """Production mode, P == 0: every position is out of range, so every K is NaN; V is copied."""
    case = make_case(3, 2, 1, 64, 32, torch.float16)
    case = replace(case, cos_sin_cache=case.cos_sin_cache[:0])
    k, _ = check(case)
    assert bool(k.isnan().all())


def test_out_of_range_positions_debug_raises() -> None:
    """Debug mode (the test default) raises for a position outside ``[0, P)``, writing nothing."""
    assert typedkv.debug_enabled()
    case = make_case(4, 2, 1, 64, 64, torch.float32, num_positions=8)
    positions = case.positions.clone()
    positions[2] = 8
    k_out = _poisoned(case.out_shape, torch.float32, -3.0)
    v_out = _poisoned(case.out_shape, torch.float32, -3.0)
    with pytest.raises(typedkv.InputError, match="positions"):
        replace(case, positions=positions).run(k_out, v_out)
    assert bool((k_out == -3.0).all()) and bool((v_out == -3.0).all())


# --------------------------------------------------------------------------- determinism, modes


@pytest.mark.parametrize("dtype", _DTYPES)
def test_deterministic(dtype: torch.dtype) -> None:
    """Two calls on the same inputs give the same bits (into fresh and into given outputs)."""
    case = make_case(9, 3, 2, 128, 64, dtype, "gptj")
    k1, v1 = case.run()
    k2, v2 = case.run(torch.full_like(k1, 7.0), torch.full_like(v1, 7.0))
    assert_bitwise_equal(k1, k2, "k of two calls")
    assert_bitwise_equal(v1, v2, "v of two calls")


@pytest.mark.parametrize("dtype", _DTYPES)
def test_same_layout_new_values(dtype: torch.dtype) -> None:
    """Calls that share a layout (shapes, strides, dtypes) but not values each get their own result.

    The op caches its checks and launch configuration per layout; every call must
    still read its own tensors, eps and positions.
    """
    cases = [
        make_case(5, 2, 2, 80, 32, dtype, "gptj", eps=eps, seed=seed)
        for seed, eps in ((1, 1e-6), (2, 0.5), (3, 4.0), (1, 4.0))
    ]
    slab_k = torch.full((2, 9, 2, 80), float("nan"), dtype=dtype)
    slab_v = torch.full((2, 9, 2, 80), float("nan"), dtype=dtype)
    results = [case.run() for case in cases]
    into_slab = [case.run(slab_k[:, :5], slab_v[:, :5]) for case in cases[:2]]
    for case, (k, v) in zip(cases, results, strict=True):
        assert_matches_reference(case, k, v)
    assert_matches_reference(cases[1], *into_slab[1])


@pytest.mark.parametrize("dtype", _DTYPES)
def test_production_matches_debug(dtype: torch.dtype) -> None:
    """Debug checking changes what is checked, never what is computed."""
    case = make_case(7, 2, 2, 80, 80, dtype)
    typedkv.set_debug(True)
    k_debug, v_debug = case.run()
    typedkv.set_debug(False)
    k_prod, v_prod = case.run()
    assert_bitwise_equal(k_prod, k_debug, "k production vs debug")
    assert_bitwise_equal(v_prod, v_debug, "v production vs debug")


# --------------------------------------------------------------------------- properties


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Small random shapes: any D (odd too), any even R <= D, 1 <= P, every dtype and kind."""
    num_tokens = draw(st.integers(0, 6))
    num_layers = draw(st.integers(1, 3))
    num_kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(2, 40))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    eps = draw(
        st.one_of(
            st.floats(1e-8, 4.0),
            st.lists(st.floats(1e-8, 4.0), min_size=num_layers, max_size=num_layers).map(torch.tensor),
        )
    )
    case = make_case(
        num_tokens,
        num_layers,
        num_kv_heads,
        head_dim,
        rotary_dim,
        draw(st.sampled_from(STORAGE)),
        draw(st.sampled_from(STYLES)),
        num_positions=draw(st.integers(1, 40)),
        positions_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        weight_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        eps=eps,
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    if draw(st.booleans()):  # a wider row, as a view of a fused projection
        base = torch.zeros(*case.kv.shape[:2], case.kv.shape[2] + 8, dtype=case.kv.dtype)
        base[..., 8:] = case.kv
        case = replace(case, kv=base[..., 8:])
    return case


_PROPERTY = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same examples every run: CI stays reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_PROPERTY
@given(case=cases())
def test_property_matches_reference(case: Case) -> None:
    """Any small shape matches the float64 reference."""
    check(case)


@_PROPERTY
@given(case=cases(), data=st.data())
def test_property_tokens_independent(case: Case, data: st.DataObject) -> None:
    """A token's K and V depend on its own row and position only: permuting the tokens
    (with their positions) permutes the results, bit for bit."""
    num_tokens = case.kv.shape[0]
    order = torch.tensor(data.draw(st.permutations(range(num_tokens))), dtype=torch.int64)
    k, v = case.run()
    k_perm, v_perm = replace(case, kv=case.kv[order], positions=case.positions[order]).run()
    assert_bitwise_equal(k_perm, k[:, order], "k of permuted tokens")
    assert_bitwise_equal(v_perm, v[:, order], "v of permuted tokens")


# --------------------------------------------------------------------------- the kernel itself


def test_interpreter_detected() -> None:
    """The suite knows which path it tests: the kernel under TRITON_INTERPRET=1, else the reference."""
    assert launcher.INTERPRETED == (os.environ.get("TRITON_INTERPRET", "0") == "1")
    assert launcher.use_kernel(torch.device("cpu")) == launcher.INTERPRETED


class _CountingKernel:
    """Wraps a Triton kernel, recording the grid of every ``kernel[grid](...)`` launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[Any] = []

    def __getitem__(self, grid: Any) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


@pytest.fixture
def counting_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[_CountingKernel]:
    counter = _CountingKernel(kv_kernel.materialize_kv_kernel)
    monkeypatch.setattr(kv_launch, "materialize_kv_kernel", counter)
    yield counter


@pytest.mark.skipif(not launcher.INTERPRETED, reason="the kernel runs on CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("num_tokens", [0, 1, 33])
def test_one_launch_per_call(counting_kernel: _CountingKernel, num_tokens: int) -> None:
    """One launch covers every layer (none for T == 0), and it computes the right thing."""
    case = make_case(num_tokens, 3, 2, 64, 32, torch.bfloat16)
    check(case)
    assert len(counting_kernel.grids) == (1 if num_tokens else 0)
