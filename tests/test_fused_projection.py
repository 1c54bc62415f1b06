"""`KVMaterializer`'s fused projection path (``projection_path = "fused"``): one kernel, GEMM and K/V epilogue.

The file runs on the reference (plain CPU: the fused setting falls back to GEMM
+ op there, so these tests hold the reference to the same oracle) and under
``TRITON_INTERPRET=1``, where the fused Triton kernel itself runs. The
interpreter computes ``tl.dot`` on bfloat16 inputs wrongly, so it runs float16
and float32 only; bfloat16 is the GPU suite's (tests/test_gpu_fused.py).

Oracle: the float64 GEMM, then ``tests/reference64.py``'s steps. Inputs are
drawn on a grid (hidden: multiples of 1/64 up to 1, weights: of 1/256 up to
1/2, each exact in every storage dtype) so that every product and partial sum
of the GEMM is exact in float32 (at most ~21 significant bits): the accumulation order then cannot
change the float32 accumulator, and the projection rounded to the storage dtype
(what a stored ``kv`` holds) is known exactly. From there:

- V equals that rounded projection bit for bit (a normed V, ``v_norm_weight``: the
  exact norm of it rounded once, `test_numerics.v_normed_ok`);
- K is within one storage-dtype ulp at the scale of the row's largest value,
  ``eps * max |k|`` over the head row (``eps`` = ``torch.finfo(dtype).eps``; an
  element where RoPE cancels can be far smaller than its error), of the float64
  unfused path applied to the rounded projection. That is up to twice the
  spacing of the largest value's own binade, and needed: K is rounded twice
  (after the norm, at the store), and the float64 oracle rounds the first time
  from the exact norm -- the GEMM + kernel path measures 0.93 of this bound
  (and 1.33 of the binade's spacing) at T=70, hidden=16 of `test_token_and_hidden_edges`.
  Where the exact normed value lies within 2**-20 (relative) of a rounding
  boundary, a float32 norm may round it either way, one ulp of the normed
  value apart; times a cos of this file's table (random, up to about 3) that
  can exceed the bound (float16, T = 300, hidden 80, seed 75 of `Draft`: 1.04
  on CPU, the reference and the interpreted kernel alike). There the oracle's
  K from the other rounding is accepted too (`Draft.oracle`, `Oracle`).
  For float32 storage the kernel's float32 norm and rotation are themselves the
  error: 32 times that (as tests/test_numerics.py).

Pools: the fused path's whole pool allocations (sentinel-filled first) must equal
the GEMM + kernel path's bit for bit: the same kv (an exact GEMM), the same
float32 epilogue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from reference64 import materialize_kv64
from test_numerics import assert_v_normed
from torch import Tensor

import typedkv
from typedkv.core import launcher
from typedkv.kv.launch import KVGeometry
from typedkv.projection import fused as fused_impl
from typedkv.projection import launch as fused_launch
from typedkv.projection import tuning

INTERPRETED = launcher.INTERPRETED
# The interpreter's tl.dot is wrong on bfloat16 inputs; the reference takes all three.
DTYPES = (torch.float16, torch.float32) if INTERPRETED else (torch.float16, torch.float32, torch.bfloat16)
ULPS = {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 32.0}
L, H, P = 3, 2, 64


def _grid(shape: tuple[int, ...], top: int, denominator: int, g: torch.Generator) -> Tensor:
    """Integers in ``[-top, top]`` over ``denominator``: exact in every storage dtype, products exact in float32."""
    return torch.randint(-top, top + 1, shape, generator=g).double() / denominator


class Draft:
    """A draft's weights on the grid, its materializer, and the float64 oracle of a call."""

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        head_dim: int = 16,
        rotary_dim: int = 16,
        hidden: int = 80,
        rope_style: typedkv.RopeStyle = "neox",
        norm: bool = True,
        bias: bool = False,
        eps: float | Tensor = 1e-6,
        seed: int = 0,
        v_norm: bool = False,
        layer_tables: bool = False,
        layers: int = L,
        heads: int = H,
    ) -> None:
        """``v_norm``: V normed too (``v_norm_weight``); ``layer_tables``: a cos/sin table per layer; ``layers``
        and ``heads``: the draft's size (the fused kernel's programs, ``layers * 2 * heads``)."""
        g = torch.Generator().manual_seed(seed)
        L, H = self.layers, self.heads = layers, heads
        rows = 2 * H * head_dim
        self.dtype, self.head_dim, self.hidden, self.rope_style, self.eps = dtype, head_dim, hidden, rope_style, eps
        self.weight = _grid((L, rows, hidden), 128, 256, g)
        self.bias = _grid((L, rows), 8, 16, g) if bias else None
        self.norm = (torch.rand(L, head_dim, generator=g) + 0.5).to(dtype) if norm else None
        self.cos_sin_cache = torch.randn(P, rotary_dim, generator=g)
        self.v_norm = (torch.rand(L, head_dim, generator=g) + 0.5).to(dtype) if v_norm else None
        if layer_tables:
            self.cos_sin_cache = torch.randn(L, P, rotary_dim, generator=g)
        self.m = typedkv.KVMaterializer(
            self.weight.to(dtype), self.norm, eps, self.cos_sin_cache, num_kv_heads=H, rope_style=rope_style,
            kv_bias=None if self.bias is None else self.bias.to(dtype), v_norm_weight=self.v_norm,
        )  # fmt: skip

    def call(self, num_tokens: int, seed: int = 1) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        return _grid((num_tokens, self.hidden), 64, 64, g).to(self.dtype), torch.randint(
            0, P, (num_tokens,), generator=g
        )

    def oracle(self, hidden: Tensor, positions: Tensor) -> Oracle:
        """K in float64 (not rounded at the end) and V, from the exact projection rounded to the storage dtype;
        beside them, K with the normed values next to a rounding boundary rounded the other way."""
        kv = torch.einsum("th,lnh->tln", hidden.double(), self.weight)
        if self.bias is not None:
            kv = kv + self.bias
        args = (kv.to(self.dtype), self.norm, self.eps, self.cos_sin_cache, positions, self.heads, self.rope_style)
        k64, v = materialize_kv64(*args, v_norm_weight=self.v_norm)
        other_k64, _ = materialize_kv64(*args, other_rounding=True, v_norm_weight=self.v_norm)
        return Oracle(k64, v, other_k64)


class Oracle(tuple[Tensor, Tensor]):
    """``(k64, v)`` of `Draft.oracle`, with ``other_k64``: K where the exact normed value lies next to a rounding
    boundary of the storage dtype and rounds the other way (`reference64.materialize_kv64`'s ``other_rounding``)."""

    other_k64: Tensor

    def __new__(cls, k64: Tensor, v: Tensor, other_k64: Tensor) -> Oracle:
        oracle = super().__new__(cls, (k64, v))
        oracle.other_k64 = other_k64
        return oracle


def assert_matches_oracle(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor], dtype: torch.dtype) -> None:
    k, v = got
    k64, v_want = want
    assert k.dtype == v.dtype == dtype and k.shape == k64.shape
    if v_want.dtype == torch.float64 and dtype != torch.float64:  # a normed V: the exact norm, rounded once
        assert_v_normed(v, v_want)
    else:
        assert torch.equal(v, v_want), "V is the projection rounded to the storage dtype, bit for bit"
    bad = k64.isnan()
    assert torch.equal(k.isnan(), bad)
    if not k64.numel():
        return  # no tokens (or no rows named): nothing more to compare
    row_max = k64.nan_to_num().abs().amax(-1, keepdim=True)
    tolerance = ULPS[dtype] * torch.finfo(dtype).eps * row_max.clamp(min=torch.finfo(dtype).tiny)
    error = (k.double() - k64).abs().nan_to_num()
    if isinstance(want, Oracle):  # a normed value next to a rounding boundary may round either way
        error = torch.minimum(error, (k.double() - want.other_k64).abs().nan_to_num())
    worst = (error / tolerance).max().item()
    assert worst <= 1.0, f"K off by {worst:.2f} x the tolerance"


def fused(draft: Draft) -> typedkv.KVMaterializer:
    draft.m.projection_path = "fused"
    return draft.m


# ------------------------------------------------------------------ results


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (16, 8), (24, 8), (32, 2)])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grid(
    dtype: torch.dtype, rope_style: typedkv.RopeStyle, head_dim: int, rotary_dim: int, norm: bool, bias: bool
) -> None:
    """Both rope styles, full and partial rotary (a pass-through third accumulator), norm or RoPE only, bias."""
    draft = Draft(dtype, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style, norm=norm, bias=bias)
    hidden, positions = draft.call(5)
    assert_matches_oracle(fused(draft)(hidden, positions), draft.oracle(hidden, positions), dtype)


@pytest.mark.parametrize("hidden", [16, 64, 80, 200])
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 70])
def test_token_and_hidden_edges(num_tokens: int, hidden: int) -> None:
    """T not a multiple of the token block, hidden not a multiple of the K step (or one step, or several)."""
    draft = Draft(torch.float16, hidden=hidden, rope_style="gptj", rotary_dim=8, bias=True)
    x, positions = draft.call(num_tokens)
    assert_matches_oracle(fused(draft)(x, positions), draft.oracle(x, positions), torch.float16)


def test_a_normed_value_next_to_a_boundary_may_round_either_way() -> None:
    """At this draft (float16, D = 128, hidden 80, seed 75, T = 300) one normed K value lies next to a
    float16 rounding boundary, and a float32 norm rounds it the other way than the float64 oracle: K
    then reads 1.04 ulps from the oracle's (at the row's scale), and within 0.5 of the oracle that
    rounds that value the other way (`Draft.oracle`). The fused path, and GEMM + kernel, on CPU."""
    draft = Draft(torch.float16, head_dim=128, rotary_dim=128, hidden=80, seed=75)
    x, positions = draft.call(300, 76)
    want = draft.oracle(x, positions)
    k, v = fused(draft)(x, positions)
    row_max = want[0].abs().amax(-1, keepdim=True)
    plain = ((k.double() - want[0]).abs() / (torch.finfo(torch.float16).eps * row_max)).max().item()
    assert plain > 1.0, "the case no longer shows the other rounding: pick another draft"
    assert_matches_oracle((k, v), want, torch.float16)
    draft.m.projection_path = "gemm"
    assert_matches_oracle(draft.m(x, positions), want, torch.float16)


@pytest.mark.parametrize("form", ["float", "tensor", "floats"])
def test_eps_per_layer(form: str) -> None:
    """eps as one float or per layer (an [L] tensor, a sequence): each layer's own eps, large enough to matter."""
    per_layer = [1e-6, 0.5, 4.0]
    eps: Any = {"float": 0.5, "tensor": torch.tensor(per_layer), "floats": per_layer}[form]
    draft = Draft(torch.float32, eps=eps)
    draft.eps = 0.5 if form == "float" else torch.tensor(per_layer, dtype=torch.float64)
    x, positions = draft.call(6)
    assert_matches_oracle(fused(draft)(x, positions), draft.oracle(x, positions), torch.float32)


def test_rounds_projection_before_the_norm() -> None:
    """The projection is rounded to the storage dtype before K's norm, as a stored kv would be.

    On the grid the exact projection needs more bits than float16 holds: K
    normed from it unrounded (the float64 oracle given the exact projection)
    lies further from the result than the oracle given the rounded one.
    """
    draft = Draft(torch.float16, hidden=80)
    x, positions = draft.call(16)
    k, _ = fused(draft)(x, positions)
    kv = torch.einsum("th,lnh->tln", x.double(), draft.weight)
    assert not torch.equal(kv, kv.to(torch.float16).double()), "the exact projection must need rounding"
    unrounded, _ = materialize_kv64(kv, draft.norm, draft.eps, draft.cos_sin_cache, positions, H, "neox")
    rounded, _ = draft.oracle(x, positions)
    assert (k.double() - rounded).abs().max() < (k.double() - unrounded).abs().max()


@pytest.mark.production  # debug mode rejects such positions
def test_out_of_range_positions_give_nan_k() -> None:
    """A position outside [0, P) gives NaN in that token's K (every layer and head); V is still written."""
    draft = Draft(torch.float16, rotary_dim=8)
    x, positions = draft.call(4)
    positions[1], positions[3] = -1, P
    k, v = fused(draft)(x, positions)
    assert k[:, [1, 3]].isnan().all() and not k[:, [0, 2]].isnan().any()
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.float16)


def test_outputs_given() -> None:
    """k_out/v_out are written and returned themselves, views into a larger slab included."""
    draft = Draft(torch.float32)
    x, positions = draft.call(5)
    slab = torch.zeros(2, L, 5, H, 2 * draft.head_dim)
    k_out, v_out = slab[0, ..., : draft.head_dim], slab[1, ..., draft.head_dim :]
    k, v = fused(draft)(x, positions, k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.float32)
    assert not slab[0, ..., draft.head_dim :].any() and not slab[1, ..., : draft.head_dim].any()


def test_no_tokens() -> None:
    draft = Draft(torch.float16)
    k, v = fused(draft)(*draft.call(0))
    assert k.shape == v.shape == (L, 0, H, draft.head_dim)


# ------------------------------------------------- V written by the GEMM


def ways(m: typedkv.KVMaterializer) -> set[str]:
    """How the layouts a materializer has checked compute (`typedkv.projection.dispatch.Way`)."""
    return {kept.way for kept in m._plans.values()}


@pytest.fixture
def split_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM path writes V straight into dense outputs at every T >= 1 on CPU tensors (where there is a kernel)."""
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", split_gemm_faster=((1, float("inf")),)))


SPLIT = "split" if INTERPRETED else "gemm"  # plain CPU has no kernel: GEMM + reference


@pytest.mark.usefixtures("split_on_cpu")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (24, 8), (32, 2)])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_grid(
    dtype: torch.dtype, rope_style: typedkv.RopeStyle, head_dim: int, rotary_dim: int, norm: bool, bias: bool
) -> None:
    """V by two batched GEMMs (V's straight into v_out), then the kernel on K alone: the oracle's K and V.

    With a bias, GEMM + kernel (`typedkv.projection.layers.split_gemm` takes none).
    """
    draft = Draft(dtype, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style, norm=norm, bias=bias)
    draft.m.projection_path = "gemm"
    x, positions = draft.call(21)
    assert_matches_oracle(draft.m(x, positions), draft.oracle(x, positions), dtype)
    assert ways(draft.m) == {"gemm" if bias else SPLIT}


@pytest.mark.usefixtures("split_on_cpu")
def test_split_eps_per_layer_and_grad() -> None:
    """Per-layer eps; hidden that requires grad (the GEMMs record no history, as GEMM + kernel)."""
    draft = Draft(torch.float32, eps=torch.tensor([1e-6, 0.5, 4.0]))
    draft.eps = torch.tensor([1e-6, 0.5, 4.0], dtype=torch.float64)
    x, positions = draft.call(9)
    k, v = draft.m(x.requires_grad_(), positions)
    assert not k.requires_grad and not v.requires_grad
    assert_matches_oracle((k, v), draft.oracle(x.detach(), positions), torch.float32)
    assert ways(draft.m) == {SPLIT}


@pytest.mark.usefixtures("split_on_cpu")
def test_split_outputs_given() -> None:
    """A contiguous v_out is the GEMM's; one that is not (a view into a slab) takes GEMM + kernel. Both exact."""
    draft = Draft(torch.float16)
    x, positions = draft.call(5)
    k_slab = torch.zeros(L, 5, H, 2 * draft.head_dim, dtype=torch.float16)
    k_out, v_out = k_slab[..., : draft.head_dim], torch.zeros(L, 5, H, draft.head_dim, dtype=torch.float16)
    k, v = draft.m(x, positions, k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out and ways(draft.m) == {SPLIT}
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.float16)
    assert not k_slab[..., draft.head_dim :].any()
    slab = torch.zeros(L, 5, H, 2 * draft.head_dim, dtype=torch.float16)
    k, v = draft.m(x, positions, v_out=slab[..., draft.head_dim :])
    assert ways(draft.m) == {SPLIT, "gemm"}
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.float16)
    assert not slab[..., : draft.head_dim].any()


@pytest.mark.usefixtures("split_on_cpu")
def test_split_follows_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only T in the table's range, dense outputs only, and never where the fused path is taken."""
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", split_gemm_faster=((8, 16),)))
    draft = Draft(torch.float16)
    x, positions = draft.call(12)
    draft.m(x[:7], positions[:7])
    assert ways(draft.m) == {"gemm"}
    draft.m(x, positions)
    assert ways(draft.m) == {"gemm", SPLIT}
    k_pool, v_pool = torch.zeros(L, 16, H, 16, dtype=torch.float16), torch.zeros(L, 16, H, 16, dtype=torch.float16)
    draft.m.into_pool(x, positions, torch.arange(12), k_pool, v_pool)
    assert ways(draft.m) == {"gemm", SPLIT}  # into_pool: GEMM + kernel (the new layout's way is "gemm")
    draft.m.projection_path = "fused"
    draft.m(x, positions)
    assert ways(draft.m) == {"gemm", SPLIT, "fused" if INTERPRETED else "gemm"}
    assert not tuning.split_gemm_faster(torch.device("cpu"), 16)
    assert tuning.split_gemm_faster(torch.device("cpu"), 8)


@pytest.mark.usefixtures("split_on_cpu")
def test_split_no_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 0 in the table's range: empty outputs, no GEMM."""
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", split_gemm_faster=((0, float("inf")),)))
    draft = Draft(torch.float16)
    k, v = draft.m(*draft.call(0))
    assert k.shape == v.shape == (L, 0, H, draft.head_dim)
    assert ways(draft.m) == {SPLIT}


# ------------------------------------------------------------------- pools


def _paged(layers: int, slots: int, page: int, hnd: bool, dtype: torch.dtype) -> Tensor:
    pages = -(-slots // page)
    shape = (layers, pages, H, page, 16) if hnd else (layers, pages, page, H, 16)
    return torch.empty(shape, dtype=dtype)


Pools = Callable[[torch.dtype], tuple[Any, Any, typedkv.KVLayout | None]]
S = 24  # slots: 3 pages of 8
_POOLS: dict[str, Pools] = {
    "flat": lambda d: (torch.empty(L, S, H, 16, dtype=d), torch.empty(L, S, H, 16, dtype=d), None),
    "NHD": lambda d: (_paged(L, S, 8, False, d), _paged(L, S, 8, False, d), "NHD"),
    "HND": lambda d: (_paged(L, S, 8, True, d), _paged(L, S, 8, True, d), "HND"),
    "list": lambda d: (list(torch.empty(L, S, H, 16, dtype=d)), list(torch.empty(L, S, H, 16, dtype=d)), None),
    "list_HND": lambda d: (list(_paged(L, S, 8, True, d)), list(_paged(L, S, 8, True, d)), "HND"),
    # K and V the two halves of one allocation, as engines keep them.
    "combined": lambda d: _halves(torch.empty(2, L, S, H, 16, dtype=d)),
}


def _halves(memory: Tensor) -> tuple[Tensor, Tensor, None]:
    return memory[0], memory[1], None


def _layers(pool: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [pool] if isinstance(pool, Tensor) else list(pool)


def _fill(pool: Tensor | Sequence[Tensor]) -> None:
    for t in _layers(pool):
        t.view(torch.uint8).fill_(0x35)  # finite in every pool dtype


def _bits(pool: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [t.view(torch.uint8).clone() for t in _layers(pool)]


def _into_pool(
    draft: Draft, path: str, layout: str, pool_dtype: torch.dtype, scales: dict[str, Any], x: Tensor, positions: Tensor
) -> list[Tensor]:
    k_pool, v_pool, kv_layout = _POOLS[layout](pool_dtype)
    _fill(k_pool)
    _fill(v_pool)
    # Slots: some negative, one >= S (skipped), the rest distinct.
    cache_loc = torch.tensor([3, -1, 17, 23, S, 0, 9, -5, 12, 8])[: x.shape[0]]
    draft.m.projection_path = path  # type: ignore[assignment]
    draft.m.into_pool(x, positions, cache_loc, k_pool, v_pool, kv_layout=kv_layout, **scales)
    return _bits(k_pool) + _bits(v_pool)


_SCALES: dict[str, dict[str, Any]] = {
    "none": {},
    "float": {"k_scale": 0.25, "v_scale": 2.0},
    "tensor": {"k_scale": torch.tensor([0.5, 0.125, 1.0]), "v_scale": torch.tensor([2.0, 1.0, 0.25])},
}


@pytest.mark.production  # a slot >= S is skipped (debug mode rejects it)
@pytest.mark.parametrize("layout", list(_POOLS))
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_pool_layouts_match_gemm_path(layout: str, rope_style: typedkv.RopeStyle) -> None:
    """Every pool layout: the fused path writes exactly what GEMM + kernel writes, nothing else."""
    draft = Draft(torch.float16, rope_style=rope_style, rotary_dim=8, bias=True)
    x, positions = draft.call(10)
    fused_bits = _into_pool(draft, "fused", layout, torch.float16, {}, x, positions)
    gemm_bits = _into_pool(draft, "gemm", layout, torch.float16, {}, x, positions)
    assert all(torch.equal(a, b) for a, b in zip(fused_bits, gemm_bits, strict=True))


@pytest.mark.production  # a slot >= S is skipped (debug mode rejects it)
@pytest.mark.parametrize("scale", list(_SCALES))
@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", ["flat", "NHD", "list"])
def test_fp8_pools_match_gemm_path(layout: str, pool_dtype: torch.dtype, scale: str) -> None:
    """FP8 pools, a float or an [L] tensor scale (or none): saturating, the GEMM path's bits."""
    draft = Draft(torch.float32, rotary_dim=8, norm=False)
    x, positions = draft.call(10)
    x[0] *= 64  # beyond FP8's range after the scale: saturates
    fused_bits = _into_pool(draft, "fused", layout, pool_dtype, _SCALES[scale], x, positions)
    gemm_bits = _into_pool(draft, "gemm", layout, pool_dtype, _SCALES[scale], x, positions)
    assert all(torch.equal(a, b) for a, b in zip(fused_bits, gemm_bits, strict=True))


@pytest.mark.production  # a slot >= S is skipped (debug mode rejects it)
@pytest.mark.skipif(not INTERPRETED, reason="the fused kernel runs on CPU tensors under the interpreter only")
@pytest.mark.parametrize("early_loads", [False, True])
@pytest.mark.parametrize("layout", ["list", "list_HND", "NHD"])
def test_early_loads_match_gemm_path(layout: str, early_loads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ProjectionConfig.early_loads` (the epilogue's table entry, scales, eps, norm weights before the loop), each way.

    Per-layer eps, pass-through dims, per-layer pools (a layer table) and FP8 with
    ``[L]`` scales: every load it moves, and the same bits as GEMM + kernel.
    """
    defaults = fused_launch.projection_launch.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "config", tuning.ProjectionConfig(early_loads=early_loads))
    monkeypatch.setattr(fused_impl, "_LAUNCHES", {})  # no launch built with the default kept
    draft = Draft(torch.float16, rotary_dim=8, eps=torch.tensor([1e-6, 0.5, 4.0]))
    x, positions = draft.call(10)
    for pool_dtype, scales in ((torch.float16, _SCALES["none"]), (torch.float8_e4m3fn, _SCALES["tensor"])):
        fused_bits = _into_pool(draft, "fused", layout, pool_dtype, scales, x, positions)
        gemm_bits = _into_pool(draft, "gemm", layout, pool_dtype, scales, x, positions)
        assert all(torch.equal(a, b) for a, b in zip(fused_bits, gemm_bits, strict=True))


@pytest.mark.production  # a slot >= S is skipped (debug mode rejects it)
def test_pool_rows_hold_the_oracle() -> None:
    """A stacked pool's named rows hold the oracle's K/V (the comparisons above cannot catch a shared mistake)."""
    draft = Draft(torch.float16, rotary_dim=8, bias=True)
    x, positions = draft.call(6)
    cache_loc = torch.tensor([5, -1, 0, 30, 7, 2])
    k_pool, v_pool = torch.full((L, S, H, 16), 7.0, dtype=torch.float16), torch.full((L, S, H, 16), 7.0).half()
    fused(draft).into_pool(x, positions, cache_loc, k_pool, v_pool)
    kept = (cache_loc >= 0) & (cache_loc < S)
    k64, v = draft.oracle(x, positions)
    assert_matches_oracle(
        (k_pool[:, cache_loc[kept]], v_pool[:, cache_loc[kept]]), (k64[:, kept], v[:, kept]), torch.float16
    )
    others = torch.ones(S, dtype=torch.bool)
    others[cache_loc[kept]] = False
    assert (k_pool[:, others] == 7).all() and (v_pool[:, others] == 7).all()


# ---------------------------------------------------------------- the switch


def test_projection_path_validated() -> None:
    """projection_path takes 'auto', 'fused' or 'gemm'; anything else is an InputError naming it."""
    draft = Draft(torch.float16)
    assert draft.m.projection_path == "auto"
    for bad, shown in (("fast", "'fast'"), (None, "None"), (1, "1")):
        with pytest.raises(typedkv.InputError) as info:
            draft.m.projection_path = bad  # type: ignore[assignment]
        assert str(info.value) == f"projection_path: expected 'auto', 'fused' or 'gemm', got {shown}"
    assert draft.m.projection_path == "auto"


def test_paths_and_workspace() -> None:
    """'auto' (no measurement recorded) and 'gemm' use the GEMM's workspace; 'fused' runs the kernel without one.

    On plain CPU there is no kernel to fuse into: every setting takes GEMM + reference.
    """
    x_draft = Draft(torch.float16)
    x, positions = x_draft.call(3)
    for path, uses_workspace in (("fused", not INTERPRETED), ("auto", True), ("gemm", True)):
        draft = Draft(torch.float16)
        draft.m.projection_path = path  # type: ignore[assignment]
        draft.m(x, positions)
        assert (draft.m._workspace is not None) == uses_workspace, path


def test_path_set_again_applies_to_a_layout_seen_before() -> None:
    """A layout's plan is kept with the path it took: setting ``projection_path`` again takes effect."""
    draft = Draft(torch.float16)
    x, positions = draft.call(3)
    draft.m.projection_path = "fused"
    fused_kv = draft.m(x, positions)
    assert (draft.m._workspace is None) == INTERPRETED  # fused, where there is a kernel
    draft.m.projection_path = "gemm"
    gemm_kv = draft.m(x, positions)
    assert draft.m._workspace is not None
    for got in (fused_kv, gemm_kv):
        assert_matches_oracle(got, draft.oracle(x, positions), torch.float16)


def test_auto_follows_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' takes the fused path where the table (per device name, [low, high) token counts) says so."""
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", fused_faster=((1, 8),)))
    draft = Draft(torch.float16)
    draft.m(*draft.call(4))
    assert (draft.m._workspace is None) == INTERPRETED  # fused, where there is a kernel
    draft.m(*draft.call(8))
    assert draft.m._workspace is not None  # 8 is past the range: GEMM + kernel
    assert not tuning.projection_fused_faster(torch.device("cpu"), 8)
    assert tuning.projection_fused_faster(torch.device("cpu"), 7)


def test_auto_takes_gemm_for_a_draft_of_too_few_programs_or_too_wide_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' leaves the fused kernel for GEMM + kernel where the draft has fewer programs (layers x 2 x KV
    heads) than `Tuning.fused_min_programs` or heads wider than `Tuning.fused_max_head_dim`, inside the
    table's token range too; "fused" still takes it."""
    programs = L * 2 * H
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", fused_faster=((1, 8),), fused_min_programs=programs + 1))
    draft = Draft(torch.float16)
    x, positions = draft.call(4)
    assert_matches_oracle(draft.m(x, positions), draft.oracle(x, positions), torch.float16)
    assert draft.m._workspace is not None  # GEMM + kernel
    assert not tuning.projection_fused_faster(torch.device("cpu"), 4, programs=programs)
    assert tuning.projection_fused_faster(torch.device("cpu"), 4, programs=programs + 1)
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", fused_min_programs=0, fused_max_head_dim=8))
    assert not tuning.projection_fused_faster(torch.device("cpu"), 4, programs=programs, head_dim=16)
    assert tuning.projection_fused_faster(torch.device("cpu"), 4, programs=programs, head_dim=8)
    wide_heads = Draft(torch.float16)  # heads of 16 > 8
    wide_heads.m(*wide_heads.call(4))
    assert wide_heads.m._workspace is not None
    monkeypatch.setitem(
        tuning.TUNING, *tuning.measured("cpu", fused_min_programs=programs + 1, fused_max_head_dim=float("inf"))
    )
    wider = Draft(torch.float16, heads=H + 1)  # (H + 1) * 2 * L programs: enough
    wider.m(*wider.call(4))
    assert (wider.m._workspace is None) == INTERPRETED  # fused, where there is a kernel
    fused_m = Draft(torch.float16)
    fused_m.m.projection_path = "fused"
    x, positions = fused_m.call(4)
    assert_matches_oracle(fused_m.m(x, positions), fused_m.oracle(x, positions), torch.float16)
    assert (fused_m.m._workspace is None) == INTERPRETED


@pytest.mark.parametrize(
    ("rope_style", "offset", "tma"),
    [("neox", 0, True), ("gptj", 0, False), ("neox", 1, False)],
    ids=["tma", "gptj", "weight-off-16-bytes"],
)
def test_auto_reads_the_tma_table_where_the_weight_loads_by_tma(
    monkeypatch: pytest.MonkeyPatch, rope_style: typedkv.RopeStyle, offset: int, tma: bool
) -> None:
    """'auto' reads `Tuning.fused_faster_tma` where the fused kernel's weight tiles would load by TMA
    (NeoX, pieces of powers of two >= 16 rows, the weight on 16 bytes), `Tuning.fused_faster` elsewhere."""
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", fused_faster=((1, 4),)))
    monkeypatch.setitem(tuning.TUNING, *tuning.measured("cpu", fused_faster_tma=((1, 12),)))
    draft = Draft(torch.float16, head_dim=32, rotary_dim=32, rope_style=rope_style)
    if offset:
        weight = draft.m.kv_weight
        shifted = torch.empty(weight.numel() + offset, dtype=weight.dtype)[offset:].view(weight.shape)
        draft.m.kv_weight = shifted.copy_(weight)
    x, positions = draft.call(8)  # in the TMA table's range, past the other's
    assert_matches_oracle(draft.m(x, positions), draft.oracle(x, positions), torch.float16)
    assert (draft.m._workspace is None) == (INTERPRETED and tma)  # fused, where there is a kernel
    assert tuning.projection_fused_faster(torch.device("cpu"), 8, tma=True)
    assert not tuning.projection_fused_faster(torch.device("cpu"), 8, tma=False)


@pytest.mark.production
def test_production_mode() -> None:
    """Debug checks off (the default outside tests): the same results."""
    draft = Draft(torch.float32, rope_style="gptj", bias=True)
    x, positions = draft.call(9)
    assert_matches_oracle(fused(draft)(x, positions), draft.oracle(x, positions), torch.float32)


# -------------------------------------------------------------------- errors


def _misuses(draft: Draft) -> dict[str, Callable[[typedkv.KVMaterializer], object]]:
    x, positions = draft.call(5)
    slots = torch.tensor([0, 1, 2, 3, 4])

    def pools(**kw: Any) -> tuple[Tensor, Tensor]:
        shape = kw.pop("shape", (L, 8, H, 16))
        return torch.zeros(shape, **kw), torch.zeros(shape, **kw)

    k_pool, v_pool = pools(dtype=torch.float16)
    paged = pools(shape=(L, 2, H, H, 16), dtype=torch.float16)  # B == H: ambiguous without kv_layout
    return {
        "k_out_swapped": lambda m: m(x, positions, k_out=torch.empty(5, L, H, 16, dtype=torch.float16)),
        "k_out_dtype": lambda m: m(x, positions, k_out=torch.empty(L, 5, H, 16)),
        "v_out_is_k_out": lambda m: m(x, positions, *(2 * [torch.empty(L, 5, H, 16, dtype=torch.float16)])),
        "hidden_width": lambda m: m(x[:, :20], positions),
        "hidden_1d": lambda m: m(x[0], positions),
        "hidden_0d": lambda m: m(x[0, 0], positions),
        "hidden_0d_into_pool": lambda m: m.into_pool(x[0, 0], positions, slots, k_pool, v_pool),
        "positions_len": lambda m: m(x, positions[:3]),
        "positions_dtype": lambda m: m(x, positions.float()),
        "cache_loc_len": lambda m: m.into_pool(x, positions, slots[:4], k_pool, v_pool),
        "pool_heads": lambda m: m.into_pool(x, positions, slots, *pools(shape=(L, 8, 4, 16), dtype=torch.float16)),
        "pool_dtype": lambda m: m.into_pool(x, positions, slots, *pools(dtype=torch.float64)),
        "same_pool": lambda m: m.into_pool(x, positions, slots, k_pool, k_pool),
        "mixed_kinds": lambda m: m.into_pool(x, positions, slots, k_pool, list(v_pool)),
        "scale_on_fp16": lambda m: m.into_pool(x, positions, slots, k_pool, v_pool, k_scale=0.5),
        "ambiguous_page": lambda m: m.into_pool(x, positions, slots, *paged),
        "v_pool_layout": lambda m: m.into_pool(
            x, positions, slots, k_pool, torch.zeros(L, 1, 8, H, 16, dtype=torch.float16), kv_layout="NHD"
        ),
        "pool_layers": lambda m: m.into_pool(x, positions, slots, list(k_pool)[:2], list(v_pool)[:2]),
        "kv_layout": lambda m: m.into_pool(x, positions, slots, k_pool, v_pool, kv_layout="NDH"),
    }


@pytest.mark.parametrize("case", list(_misuses(Draft(torch.float16))))
def test_misuse_same_error_on_both_paths(case: str) -> None:
    """A misuse raises the GEMM path's InputError on the fused path too, before anything is written."""
    messages = {}
    for path in ("gemm", "fused"):
        draft = Draft(torch.float16)
        draft.m.projection_path = path
        with pytest.raises(typedkv.InputError) as info:
            _misuses(draft)[case](draft.m)
        messages[path] = str(info.value)
    assert messages["fused"] == messages["gemm"]


@pytest.mark.usefixtures("split_on_cpu")
@pytest.mark.parametrize("case", list(_misuses(Draft(torch.float16))))
def test_misuse_same_error_split(case: str) -> None:
    """With V written by the GEMM, a misuse raises GEMM + kernel's InputError, before anything is written."""
    draft = Draft(torch.float16)
    draft.m.projection_path = "gemm"
    with pytest.raises(typedkv.InputError) as info:
        _misuses(draft)[case](draft.m)
    reference = Draft(torch.float16)
    reference.m.projection_path = "gemm"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tuning.TUNING, *tuning.measured("cpu", split_gemm_faster=()))
        with pytest.raises(typedkv.InputError) as want:
            _misuses(reference)[case](reference.m)
    assert str(info.value) == str(want.value)


@pytest.mark.parametrize("case", ["hidden_1d", "hidden_0d", "hidden_0d_into_pool"])
def test_misshapen_hidden_on_auto(case: str) -> None:
    """The "auto" path reads hidden's T only once hidden is known to be [T, hidden]: an InputError, never an IndexError."""
    draft = Draft(torch.float16)
    draft.m.projection_path = "auto"
    with pytest.raises(typedkv.InputError, match="hidden"):
        _misuses(draft)[case](draft.m)


def test_misuse_writes_nothing() -> None:
    """A rejected pool call on the fused path leaves the pools as they were."""
    draft = Draft(torch.float16)
    x, positions = draft.call(5)
    k_pool, v_pool = torch.full((L, 8, H, 16), 3.0).half(), torch.full((L, 8, H, 16), 3.0).half()
    with pytest.raises(typedkv.InputError):
        fused(draft).into_pool(x, positions, torch.arange(5), k_pool, v_pool, v_scale=2.0)
    assert (k_pool == 3).all() and (v_pool == 3).all()


@pytest.mark.skipif(not INTERPRETED, reason="builds the kernel's launch directly: runs under the interpreter")
@pytest.mark.parametrize(
    "config",
    [
        tuning.ProjectionConfig(block_m=16, block_k=16, num_stages=1),
        tuning.ProjectionConfig(block_m=32, block_k=32, num_warps=2),
        tuning.ProjectionConfig(block_m=64, block_k=128, num_stages=4),
        tuning.ProjectionConfig(block_m=16, block_k=32, early_rope=True),
        tuning.ProjectionConfig(block_m=32, block_k=32, early_rope=False, early_loads=True),
        tuning.ProjectionConfig(block_m=16, block_k=32, group_m=2),
        tuning.ProjectionConfig(block_m=32, block_k=32, num_stages=3, v_stages=2),
    ],
    ids=["m16-k16", "m32-k32", "m64-k128", "m16-early-rope", "m32-early-loads", "m16-bands-of-2", "m32-v-shallower"],
)
def test_launch_configurations_agree(config: tuning.ProjectionConfig) -> None:
    """Every launch configuration computes the same K and V (sweeps pick among them by speed alone)."""
    draft = Draft(torch.float16, rotary_dim=8, rope_style="gptj", bias=True, hidden=80)
    x, positions = draft.call(37)
    weight = draft.m.kv_weight
    bias = draft.m.kv_bias
    norm = draft.m.k_norm_weight
    results = []
    for cfg in (tuning.ProjectionConfig(), config):
        k_out, v_out = torch.empty(2, L, 37, H, 16, dtype=torch.float16)
        inputs = (norm, 1e-6, draft.cos_sin_cache, positions)
        values = fused_launch.call_values(x, weight, bias, inputs, None, (k_out, v_out, None))
        k_strides, v_strides = ((out.stride(0), out.stride(1), 0, out.stride(2)) for out in (k_out, v_out))
        geometry = KVGeometry(H, 16, False, k_strides, v_strides, 37)
        launch = fused_launch.projection_launch(values, geometry, num_layers=L, config=cfg)
        launch(values)
        results.append((k_out, v_out))
    assert_matches_oracle(results[0], draft.oracle(x, positions), torch.float16)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.skipif(not INTERPRETED, reason="builds the kernel's launch directly: runs under the interpreter")
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "dtype", "bias", "pools"),
    [
        (32, 32, torch.float16, False, False),
        (64, 32, torch.float16, True, False),  # a pass-through piece of its own
        (32, 32, torch.float32, True, True),
        (64, 32, torch.float16, False, True),
    ],
    ids=["full-rotary", "partial-bias", "fp32-bias-pools", "partial-pools"],
)
@pytest.mark.parametrize("early", [False, True], ids=["loads-after", "loads-early"])
def test_weight_tiles_by_tma_equal_by_pointer(
    head_dim: int, rotary_dim: int, dtype: torch.dtype, bias: bool, pools: bool, early: bool
) -> None:
    """Weight tiles loaded through TMA descriptors give the bits the pointer loads give, against the oracle
    (hidden 80: a last K step past the weight's columns, which TMA reads as 0)."""
    draft = Draft(dtype, head_dim=head_dim, rotary_dim=rotary_dim, bias=bias, hidden=80)
    x, positions = draft.call(37)
    results = []
    for tma in (False, True):
        # Bands of two of the three token blocks (the last band short) with TMA: the same programs' work.
        # With TMA also the RoPE rows and the epilogue's other loads before the loop, or not.
        config = tuning.ProjectionConfig(
            block_m=16,
            block_k=32,
            early_rope=early and tma,
            early_loads=early and tma,
            tma=tma,
            group_m=2 if tma else 1,
        )
        launch, values, k_dst, v_dst, slots = _launch_for(draft, x, positions, config, pools)
        assert (launch.weight_blocks is not None) == tma
        launch(values)
        if pools:
            k_dst, v_dst = k_dst[:, slots], v_dst[:, slots]
        results.append((k_dst, v_dst))
    assert_matches_oracle(results[0], draft.oracle(x, positions), dtype)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _launch_for(
    draft: Draft, x: Tensor, positions: Tensor, config: tuning.ProjectionConfig, pools: bool
) -> tuple[fused_launch.ProjectionLaunch, tuple[Any, ...], Tensor, Tensor, Tensor | None]:
    """The fused launch of ``draft`` into dense outputs, or into stacked pools at reversed slots, and its first
    call's values (`typedkv.projection.launch.call_values`)."""
    T, D, dtype = x.shape[0], draft.head_dim, draft.dtype
    if pools:
        k_dst, v_dst = torch.full((2, L, 2 * T, H, D), 7.0, dtype=dtype)
        slots = torch.arange(2 * T - 1, T - 1, -1)
    else:
        k_dst, v_dst = torch.empty(2, L, T, H, D, dtype=dtype)
        slots = None
    inputs = (draft.m.k_norm_weight, 1e-6, draft.cos_sin_cache, positions)
    values = fused_launch.call_values(x, draft.m.kv_weight, draft.m.kv_bias, inputs, slots, (k_dst, v_dst, None))
    k_strides, v_strides = ((dst.stride(0), dst.stride(1), 0, dst.stride(2)) for dst in (k_dst, v_dst))
    geometry = KVGeometry(H, D, True, k_strides, v_strides, k_dst.shape[1])
    launch = fused_launch.projection_launch(values, geometry, num_layers=L, config=config)
    return launch, values, k_dst, v_dst, slots


@pytest.mark.skipif(not INTERPRETED, reason="the fused kernel runs on CPU tensors under the interpreter only")
def test_weight_off_16_bytes_then_on_then_off() -> None:
    """A materializer's weight buffer one element off 16 bytes, replaced by one on them, then off again (one
    layout): the oracle's K and V each time, by pointer off 16 bytes and by TMA on them (a TMA descriptor of an
    address off 16 bytes is refused: the launches are kept apart by alignment)."""
    draft = Draft(torch.float16, head_dim=32, rotary_dim=32, hidden=80)
    m = fused(draft)
    aligned = m.kv_weight.clone()
    misaligned = torch.empty(aligned.numel() + 1, dtype=aligned.dtype)[1:].view(aligned.shape)
    misaligned.copy_(aligned)
    x, positions = draft.call(70)  # above T = 64: the defaults load by TMA where they can
    want = draft.oracle(x, positions)
    for weight in (misaligned, aligned, misaligned):
        m.kv_weight = weight
        assert_matches_oracle(m(x, positions), want, torch.float16)
    launches = [launch for kept in m._plans.values() for launch in kept.launches.values()]
    blocks = [launch.weight_blocks for launch in launches if isinstance(launch, fused_launch.ProjectionLaunch)]
    assert len(blocks) == len(launches)
    assert sorted(b is not None for b in blocks) == [False, True]


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "rope_style", "offset"),
    [(16, 16, "neox", 0), (32, 32, "gptj", 0), (48, 32, "neox", 0), (32, 32, "neox", 1)],
    ids=["rotary-half-8", "gptj", "pass-16-not-power", "weight-off-16-bytes"],
)
def test_weight_tiles_by_pointer_where_tma_cannot(head_dim: int, rotary_dim: int, rope_style: str, offset: int) -> None:
    """TMA only where every tile is whole rows of a power of two >= 16 and the weight starts on 16 bytes."""
    rows = L * 2 * H * head_dim
    weight = torch.zeros(rows * 80 + offset, dtype=torch.float16)[offset:].view(rows, 80)
    blocks = fused_launch.weight_blocks(weight, head_dim, rotary_dim, rope_style == "neox")
    aligned = fused_launch.weight_aligned(weight)
    possible = (head_dim, rotary_dim, rope_style, offset) == (32, 32, "neox", 0)
    assert (blocks is not None and aligned) == (possible and fused_launch._tma_device(weight.device))


def test_default_blocks_fit_shared_memory() -> None:
    """Defaults come from the measured table by T (RoPE rows loaded early up to T = 16, the other loads up to 32);
    the pipeline, then block_k, shrink to fit shared memory."""
    h200 = 227 * 1024
    default = tuning.ProjectionConfig()
    assert default.blocks(1, 128, 2, h200) == (16, 128, 5, True, True, False, 1, 4, 5, 0, False)
    assert default.blocks(16, 128, 2, h200) == (16, 128, 5, True, True, False, 1, 4, 5, 0, False)
    assert default.blocks(17, 128, 2, h200) == (32, 128, 5, False, True, False, 1, 4, 5, 0, False)
    assert default.blocks(33, 128, 2, h200) == (64, 64, 6, False, False, False, 1, 4, 6, 0, False)
    assert default.blocks(64, 128, 2, h200) == (64, 64, 6, False, False, False, 1, 4, 6, 0, False)
    assert default.blocks(65, 128, 2, h200) == (128, 64, 3, False, False, False, 1, 4, 3, 0, False)
    # Where the weight can load by TMA: TMA; up to 128 tokens V's pipeline shallower than K's but from 17 to 32;
    # above 128 in bands of 8 token blocks, of 64 tokens and 4 warps up to 256, of 128 tokens and 8 warps above.
    assert default.blocks(1, 128, 2, h200, tma_possible=True) == (16, 128, 6, True, True, True, 1, 4, 5, 0, True)
    assert default.blocks(16, 128, 2, h200, tma_possible=True) == (16, 128, 6, True, True, True, 1, 4, 5, 0, True)
    assert default.blocks(17, 128, 2, h200, tma_possible=True) == (32, 128, 5, False, True, True, 1, 4, 5, 128, True)
    assert default.blocks(32, 128, 2, h200, tma_possible=True) == (32, 128, 5, False, True, True, 1, 4, 5, 128, True)
    assert default.blocks(33, 128, 2, h200, tma_possible=True) == (64, 64, 8, False, False, True, 1, 4, 7, 128, True)
    assert default.blocks(64, 128, 2, h200, tma_possible=True) == (64, 64, 8, False, False, True, 1, 4, 7, 128, True)
    assert default.blocks(65, 128, 2, h200, tma_possible=True) == (128, 64, 7, False, False, True, 1, 8, 6, 128, True)
    assert default.blocks(128, 128, 2, h200, tma_possible=True) == (128, 64, 7, False, False, True, 1, 8, 6, 128, True)
    assert default.blocks(129, 128, 2, h200, tma_possible=True) == (64, 64, 3, False, False, True, 8, 4, 3, 0, True)
    assert default.blocks(256, 128, 2, h200, tma_possible=True) == (64, 64, 3, False, False, True, 8, 4, 3, 0, True)
    assert default.blocks(257, 128, 2, h200, tma_possible=True) == (128, 64, 4, False, False, True, 8, 8, 4, 0, False)
    no_tma = tuning.ProjectionConfig(tma=False)
    assert no_tma.blocks(65, 128, 2, h200, tma_possible=True) == (128, 64, 3, False, False, False, 1, 4, 3, 0, False)
    # Head dim 256 in bf16, or float32 inputs: fewer stages.
    assert default.blocks(16, 256, 2, h200) == (16, 128, 3, True, True, False, 1, 4, 3, 0, False)
    assert default.blocks(16, 128, 4, h200) == (16, 128, 3, True, True, False, 1, 4, 3, 0, False)
    # A small shared memory: two stages at least, then narrower K steps.
    assert default.blocks(16, 128, 2, 48 * 1024) == (16, 64, 2, True, True, False, 1, 4, 2, 0, False)
    # Where shared memory makes K's pipeline shallower, V's follows in proportion (at least 2 stages).
    assert default.blocks(64, 256, 2, h200, tma_possible=True) == (64, 64, 5, False, False, True, 1, 4, 5, 128, True)
    small = default.blocks(48, 128, 2, 48 * 1024, tma_possible=True)
    assert small == (64, 64, 2, False, False, True, 1, 4, 2, 128, True)
    # Fields given are kept as given; V's depth is K's unless given, where K's is.
    pinned = tuning.ProjectionConfig(block_m=64, block_k=256, num_stages=6, early_rope=False, early_loads=False)
    assert pinned.blocks(16, 256, 4, 48 * 1024) == (64, 256, 6, False, False, False, 1, 4, 6, 0, False)
    pinned_tma = pinned.blocks(48, 256, 4, 48 * 1024, tma_possible=True)
    assert pinned_tma == (64, 256, 6, False, False, True, 1, 4, 6, 128, True)
    shallow_v = tuning.ProjectionConfig(v_stages=3)
    assert shallow_v.blocks(64, 128, 2, h200, tma_possible=True) == (64, 64, 8, False, False, True, 1, 4, 3, 128, True)
    # Up to T = 256 by TMA the next kernel is let launch after the weight loop, and from 17 to 128 a program
    # asks L2 for its first 128 weight columns before it waits for the prior kernel; either may be pinned.
    quiet = tuning.ProjectionConfig(l2_before_wait=0, signal_next=False)
    assert quiet.blocks(64, 128, 2, h200, tma_possible=True) == (64, 64, 8, False, False, True, 1, 4, 7, 0, False)


def test_tma_blocks_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device measured apart (the H100) takes its own TMA rows up to T = 64, the shared ones above; its table
    cuts T where the shared one does (a new T compiles nothing there either); weights by pointer ignore it."""
    h100, h200_shared = "NVIDIA H100 80GB HBM3", 227 * 1024
    default = tuning.ProjectionConfig()
    monkeypatch.setattr(tuning, "TRITON_RELEASE", (3, 6))  # the release the tables were measured under

    def tma(num_tokens: int, name: str) -> tuple[int | bool | None, ...]:
        return default.blocks(num_tokens, 128, 2, h200_shared, tma_possible=True, device_name=name)

    assert tma(1, h100) == tma(16, h100) == (16, 128, 6, True, True, True, 1, 4, 4, 0, True)
    assert tma(17, h100) == tma(32, h100) == (32, 128, 5, False, True, True, 1, 4, 4, 128, True)
    assert tma(33, h100) == tma(64, h100) == (64, 64, 8, False, False, True, 1, 4, 6, 128, True)
    for num_tokens in (1, 16, 17, 32, 33, 64):
        assert tma(num_tokens, h100) != tma(num_tokens, "NVIDIA H200") == tma(num_tokens, "")
    for num_tokens in (65, 128, 129, 256, 257, 65536):
        assert tma(num_tokens, h100) == tma(num_tokens, "NVIDIA H200")
    assert [most for most, _ in tuning.tuning_of(h100).blocks_tma] == [most for most, _ in tuning.PROJECTION_BLOCKS_TMA]
    assert default.blocks(16, 128, 2, h200_shared, device_name=h100) == default.blocks(16, 128, 2, h200_shared)


@pytest.mark.production  # slots past the pool are skipped (debug mode rejects them)
@pytest.mark.skipif(not INTERPRETED, reason="the fused kernel runs on CPU tensors under the interpreter only")
def test_fused_sample_cpu() -> None:
    """tests/fused_sample.py (the GPU suite runs it under memcheck): guard bytes intact, results as expected."""
    import fused_sample

    assert fused_sample.main(["--device", "cpu"]) == 0


@pytest.mark.skipif(not INTERPRETED, reason="the fused path runs on CPU tensors under the interpreter only")
def test_kept_layouts_hold_no_replaced_weights() -> None:
    """What a materializer keeps per fused layout (plan, kv's stand-in) holds no weight memory: a
    replaced weight buffer is freed, and the layouts kept still serve the new one."""
    draft = Draft(torch.float16)
    m = fused(draft)
    x, positions = draft.call(5)
    m(x, positions)
    m.into_pool(x, positions, torch.arange(5), torch.empty(L, 8, H, 16).half(), torch.empty(L, 8, H, 16).half())
    old = m.kv_weight.untyped_storage().data_ptr()
    m.kv_weight = m.kv_weight.clone()  # the same layout: the kept layouts still match
    got = m(x, positions)
    stand_ins = [kept.stand_in for kept in m._plans.values() if kept.stand_in is not None]
    assert len(stand_ins) == 2
    assert all(t.untyped_storage().data_ptr() != old for t in stand_ins)
    assert_matches_oracle(got, draft.oracle(x, positions), torch.float16)


@pytest.mark.parametrize("release", [(3, 5), (3, 9), (4, 0)])
def test_an_unmeasured_device_or_triton_release_gets_the_safe_default(
    monkeypatch: pytest.MonkeyPatch, release: tuple[int, int]
) -> None:
    """Where nothing was measured -- a GPU no table names, or a measured GPU under another Triton release --
    "auto" takes GEMM + kernel at every T and the fused kernel launches with the shared rows."""
    monkeypatch.setattr(tuning, "TRITON_RELEASE", release)
    measured_gpus = {name for name, _ in tuning.TUNING}
    assert measured_gpus and all(found == (3, 6) for _, found in tuning.TUNING)
    for name in (*sorted(measured_gpus), "NVIDIA B200", "cpu"):
        entry = tuning.tuning_of(name)
        assert entry is tuning.DEFAULT, name
        assert not any(entry.fused_faster + entry.fused_faster_tma + entry.split_gemm_faster)
        assert not entry.warp_specialized_faster
        assert entry.blocks == tuning.PROJECTION_BLOCKS and entry.blocks_tma == tuning.PROJECTION_BLOCKS_TMA
    cpu = torch.device("cpu")
    for num_tokens in (1, 16, 64, 128, 2048, 65536):
        assert not tuning.projection_fused_faster(cpu, num_tokens, tma=True)
        assert not tuning.split_gemm_faster(cpu, num_tokens)
        assert not tuning.warp_specialized_faster(cpu, num_tokens)
    # Under the release they were measured with, the same GPUs read their own entries.
    monkeypatch.setattr(tuning, "TRITON_RELEASE", (3, 6))
    assert all(tuning.tuning_of(name) is tuning.TUNING[name, (3, 6)] for name in measured_gpus)


@pytest.mark.parametrize(
    ("version", "release"),
    [("3.6.0", (3, 6)), ("3.9.0", (3, 9)), ("3.10.1", (3, 10)), ("3.7.0+git1a2b", (3, 7)), ("main", (0, 0))],
)
def test_triton_release_keys_the_tables_by_major_and_minor(version: str, release: tuple[int, int]) -> None:
    """What `TUNING` and the warp-specialised kernel's `GLUON_RELEASES` are keyed by; an unreadable version
    string matches no measured entry (the safe default) rather than failing at import."""
    assert tuning.triton_release(version) == release
