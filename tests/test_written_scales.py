"""Scales written per row: ``k_scale_out`` / ``v_scale_out`` of ``typedkv.materialize_kv_into_pool`` and
``KVMaterializer.into_pool``, into FP8 and int8 pools.

The rule, written out here on its own (`quantized_rows`): for each (token, layer, head) row -- K after norm and
RoPE as ``materialize_kv`` returns it (kv's dtype), or V -- ``scale = max(amax(|row|) / qmax, 1e-6)`` in float32
(qmax 448 for float8_e4m3fn, 57344 for float8_e5m2, 127 for int8) and the pool stores ``row * (1 / scale)``
saturated (int8: rounded to the nearest integer, ties to even); the scale goes to the token's slot of the scale
tensor. The oracle is the dense op's K and V put through that rule, written with torch indexing into copies of
the allocations; the op's allocations (pools and scales poisoned with a sentinel first) must equal them bit for
bit, so a value or a scale written anywhere else, or for a negative slot, fails. With a V norm
(``v_norm_weight``) or a RoPE table per layer (``cos_sin_cache`` ``[L, P, R]``) the rows are the reference path's
own (`_reference_rows`): V normed and rounded to kv's dtype, then quantized per row.

The file runs on the reference (plain CPU) and under ``TRITON_INTERPRET=1`` (the kernels), so kernel and
reference are held to the same bits. The ``gpu`` tests run the kernels on CUDA against the same oracle
(`quantized_rows` of the GPU's own dense K, on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from test_pool import SENTINEL, Inputs, _seed, assert_same_bits, make_inputs, slots_for
from torch import Tensor

import typedkv
from typedkv.core import launcher
from typedkv.kv import reference as kv_reference
from typedkv.kv.impl import DenseCall, PoolCall
from typedkv.projection import dispatch, tuning

INTERPRETED = launcher.INTERPRETED
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLOOR = 1e-6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PAGE = 4
Pool = Tensor | Sequence[Tensor]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantized_rows(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(stored, scales)`` of rows ``x`` ``[..., D]`` by the documented rule, in float32, on the CPU."""
    xf = x.detach().cpu().float()
    qmax = QMAX[dtype]
    scale = torch.maximum(xf.abs().amax(-1) / qmax, torch.tensor(FLOOR))  # NaN stays NaN
    scaled = xf * (1.0 / scale).unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(scaled.clamp(-128.0, 127.0)).nan_to_num(0.0).to(dtype), scale
    return scaled.clamp(-qmax, qmax).to(dtype), scale


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """An engine's K/V pool with its scales: ``alloc(L, S, H, D, dtype)`` makes the raw allocations (poisoned and
    compared whole), ``view`` carves ``(k_pool, v_pool, k_scale_out, v_scale_out)`` out of them (the same views
    of copies give the oracle's)."""

    name: str
    alloc: Callable[[int, int, int, int, torch.dtype], list[Tensor]]
    view: Callable[[list[Tensor], int, torch.dtype], tuple[Pool, Pool, Pool, Pool]]
    kv_layout: typedkv.KVLayout = "NHD"
    page_size: int = 1


def _pages(num_slots: int) -> int:
    return -(-num_slots // PAGE)


def _f32(base: Tensor) -> Tensor:
    """A raw byte allocation whose last dim is a multiple of 4 bytes, as float32."""
    return base.view(torch.uint8).view(torch.float32)


def _separate(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    """Pools ``bases[0]`` (``[2, ...]``, K then V) and scales ``bases[1]`` (``[2, ...]``)."""
    return bases[0][0], bases[0][1], bases[1][0], bases[1][1]


def _separate_lists(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    return list(bases[0][0]), list(bases[0][1]), list(bases[1][0]), list(bases[1][1])


def _transposed_scales(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    # Scales kept head-major, [2, L, H, S], passed as [L, S, H] views (strides (H*S, 1, S)).
    return bases[0][0], bases[0][1], bases[1][0].transpose(1, 2), bases[1][1].transpose(1, 2)


def _vllm_packed(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    """vLLM's per-token-head cache, per layer: one byte row of ``2 * (D + 4)`` per (page, slot, head), holding
    ``[K (D) | K's float32 scale | V (D) | V's float32 scale]`` (`test_vllm_per_token_head`)."""
    return _inline(bases, head_dim, dtype, pad=4, packed=True)


def _vllm_halves(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    """vLLM's earlier per-token-head cache, per layer ``[N, 2, B, H, D + 4]``: K and V halves, each row its values
    then the float32 scale."""
    k, v, k_s, v_s = [], [], [], []
    for base in bases:
        flat = _f32(base)
        k.append(base[:, 0, ..., :head_dim].view(dtype))
        v.append(base[:, 1, ..., :head_dim].view(dtype))
        k_s.append(flat[:, 0, ..., head_dim // 4])
        v_s.append(flat[:, 1, ..., head_dim // 4])
    return k, v, k_s, v_s


def _inline16(bases: list[Tensor], head_dim: int, dtype: torch.dtype) -> tuple[Pool, Pool, Pool, Pool]:
    """Rows of ``D + 16`` bytes, the scale in the first 4 after the values (FlashInfer's proposal), stacked."""
    k, v = bases
    return (
        k[..., :head_dim].view(dtype),
        v[..., :head_dim].view(dtype),
        _f32(k)[..., head_dim // 4],
        _f32(v)[..., head_dim // 4],
    )


def _inline(
    bases: list[Tensor], head_dim: int, dtype: torch.dtype, *, pad: int, packed: bool
) -> tuple[Pool, Pool, Pool, Pool]:
    k, v, k_s, v_s = [], [], [], []
    for base in bases:
        flat = _f32(base)
        row = head_dim + pad
        k.append(base[..., :head_dim].view(dtype))
        v.append(base[..., row : row + head_dim].view(dtype))
        k_s.append(flat[..., head_dim // 4])
        v_s.append(flat[..., (row + head_dim) // 4])
    return k, v, k_s, v_s


# K's and V's values and scales as two allocations, [2, L, ...] (read stacked or layer by layer).
def _flat(L: int, S: int, H: int, D: int, dtype: torch.dtype) -> list[Tensor]:
    return [torch.empty(2, L, S, H, D, dtype=dtype), torch.empty(2, L, S, H)]


def _paged_nhd(L: int, S: int, H: int, D: int, dtype: torch.dtype) -> list[Tensor]:
    return [torch.empty(2, L, _pages(S), PAGE, H, D, dtype=dtype), torch.empty(2, L, _pages(S), PAGE, H)]


def _paged_hnd(L: int, S: int, H: int, D: int, dtype: torch.dtype) -> list[Tensor]:
    return [torch.empty(2, L, _pages(S), H, PAGE, D, dtype=dtype), torch.empty(2, L, _pages(S), H, PAGE)]


def _raw(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Raw bytes as an engine keeps them: int8 caches as int8, FP8 ones as uint8."""
    return torch.empty(shape, dtype=torch.int8 if dtype == torch.int8 else torch.uint8)


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("stacked", _flat, _separate),
        Layout(
            "stacked_transposed_scales",
            lambda L, S, H, D, dt: [torch.empty(2, L, S, H, D, dtype=dt), torch.empty(2, L, H, S)],
            _transposed_scales,
        ),
        Layout("list_flat", _flat, _separate_lists),
        Layout("paged_nhd", _paged_nhd, _separate, page_size=PAGE),
        Layout("paged_hnd", _paged_hnd, _separate, "HND", PAGE),
        Layout("list_paged_nhd", _paged_nhd, _separate_lists, page_size=PAGE),
        Layout("list_paged_hnd", _paged_hnd, _separate_lists, "HND", PAGE),
        Layout(
            "vllm_packed_nhd",
            lambda L, S, H, D, dt: [_raw((_pages(S), PAGE, H, 2 * (D + 4)), dt) for _ in range(L)],
            _vllm_packed,
            page_size=PAGE,
        ),
        Layout(
            "vllm_packed_hnd",
            lambda L, S, H, D, dt: [_raw((_pages(S), H, PAGE, 2 * (D + 4)), dt) for _ in range(L)],
            _vllm_packed,
            "HND",
            PAGE,
        ),
        Layout(
            "vllm_halves",
            lambda L, S, H, D, dt: [_raw((_pages(S), 2, PAGE, H, D + 4), dt) for _ in range(L)],
            _vllm_halves,
            page_size=PAGE,
        ),
        Layout(
            "inline16_stacked",
            lambda L, S, H, D, dt: [_raw((L, _pages(S), PAGE, H, D + 16), dt) for _ in range(2)],
            _inline16,
            page_size=PAGE,
        ),
    )
}


# --------------------------------------------------------------------------- one call


def _layers(pool: Pool) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def write_rows(dst: Pool, rows: Tensor, tokens: list[int], slots: list[int], layout: Layout) -> None:
    """The oracle's write, token by token: ``rows[l, t]`` (``[H, D]``, or ``[H]`` scales) to slot ``s`` of layer ``l``."""
    page = layout.page_size
    for layer, t in enumerate(_layers(dst)):
        for token, slot in zip(tokens, slots, strict=True):
            if page == 1:
                t[slot] = rows[layer][token]
            elif layout.kv_layout == "HND":
                t[slot // page, :, slot % page] = rows[layer][token]
            else:
                t[slot // page, slot % page] = rows[layer][token]


def _to(pool: Pool, device: str) -> Pool:
    return pool.to(device) if isinstance(pool, Tensor) else [t.to(device) for t in pool]


@dataclass
class Run:
    bases: list[Tensor]
    expected: list[Tensor]

    def check(self) -> None:
        for base, want in zip(self.bases, self.expected, strict=True):
            assert_same_bits(base.cpu(), want)

    def check_within_a_step(self) -> None:
        """As `check`, but a scale may be a few float32 ulps off and a value one step of its format off.

        For float32 kv on CUDA: the pool kernel's normed K may differ from the dense op's, which the oracle
        quantizes, in its last float32 bits (docs/concepts.md, Numerics), and no rounding to kv's dtype hides
        that. A row's amax, its scale and a value's rounding follow it, by one ulp or one step at most.
        """
        values, scales = (base.cpu() for base in self.bases)
        assert_within_a_step(values, scales, *self.expected)


def assert_within_a_step(values: Tensor, scales: Tensor, want_values: Tensor, want_scales: Tensor) -> None:
    """Quantized values one step of their format apart at most, and scales a few float32 ulps (`Run.check_within_a_step`)."""
    torch.testing.assert_close(scales, want_scales, rtol=2**-20, atol=0.0, equal_nan=True)
    # Codes one apart, in the same sign: int8 as numbers, FP8 as their sign-magnitude bits.
    got, want = values.view(torch.int8).int(), want_values.view(torch.int8).int()
    if values.dtype != torch.int8:
        # A NaN row (a position past the table, say) is NaN in both, whatever the sign bit of either NaN.
        nan = values.float().isnan()
        assert torch.equal(nan, want_values.float().isnan()), "NaN where the rule has none, or none where it has"
        got, want = (got & 0xFF).masked_fill(nan, 0), (want & 0xFF).masked_fill(nan, 0)
        assert bool(((got ^ want) < 0x80).all()), "a value's sign differs"
    # Counted, not step.max(): a call of no tokens compares empty rows, which have no max.
    off = int(((got - want).abs() > 1).sum())
    assert off == 0, f"{off} values more than one step off"


def run(
    inp: Inputs,
    cache_loc: Tensor,
    layout: Layout,
    dtype: torch.dtype,
    num_slots: int,
    *,
    device: str = "cpu",
    call: Callable[..., None] | None = None,
    expected_rows: tuple[Tensor, Tensor] | None = None,
) -> Run:
    """``layout``'s allocations for ``dtype`` (on ``device``), poisoned, the op run into them (``call``: another way
    to write them, given the cache_loc and the four views); the expected bytes beside them (CPU).

    ``expected_rows``: K and V ``[L, T, H, D]`` before quantization (default: the dense op's, on ``device``).
    """
    heads, head_dim = inp.num_kv_heads, inp.head_dim
    allocated = layout.alloc(inp.num_layers, num_slots, heads, head_dim, dtype)
    for base in allocated:
        base.view(torch.uint8).fill_(SENTINEL)
    expected = [base.clone() for base in allocated]
    bases = [base.to(device) for base in allocated]
    views = layout.view(bases, head_dim, dtype)
    on_device = _on(inp, device)
    if expected_rows is None:
        expected_rows = on_device.dense()
    loc = cache_loc.to(device)
    if call is None:
        on_device.into_pool_scaled(loc, *views, kv_layout=layout.kv_layout)
    else:
        call(loc, *views)
    k_pool, v_pool, k_scales, v_scales = layout.view(expected, head_dim, dtype)
    kept = ((cache_loc >= 0) & (cache_loc < num_slots)).nonzero().flatten().tolist()
    slots = cache_loc[kept].tolist()
    for pool, scales, rows in zip((k_pool, v_pool), (k_scales, v_scales), expected_rows, strict=True):
        stored, row_scales = quantized_rows(rows, dtype)
        # Raw bytes in the oracle's copies are written as the pool's dtype through its own view.
        write_rows(pool, stored, kept, slots, layout)
        write_rows(scales, row_scales, kept, slots, layout)
    return Run(bases, expected)


class ScaledInputs(Inputs):
    """`test_pool.Inputs` with a call that writes scales per row."""

    def into_pool_scaled(
        self, cache_loc: Tensor, k_pool: Any, v_pool: Any, k_scales: Any, v_scales: Any, **kw: Any
    ) -> None:
        typedkv.materialize_kv_into_pool(
            self.kv, self.k_norm_weight, self.eps, self.cos_sin_cache, self.positions, cache_loc, k_pool, v_pool,
            num_kv_heads=self.num_kv_heads, rope_style=self.rope_style,  # type: ignore[arg-type]
            v_norm_weight=self.v_norm_weight, k_scale_out=k_scales, v_scale_out=v_scales, **kw,
        )  # fmt: skip


def _on(inp: Inputs, device: str) -> ScaledInputs:
    eps = inp.eps.to(device) if isinstance(inp.eps, Tensor) else inp.eps
    weight = None if inp.k_norm_weight is None else inp.k_norm_weight.to(device)
    v_weight = None if inp.v_norm_weight is None else inp.v_norm_weight.to(device)
    return ScaledInputs(
        inp.kv.to(device), weight, eps, inp.cos_sin_cache.to(device), inp.positions.to(device), inp.num_kv_heads,
        inp.rope_style, v_weight,
    )  # fmt: skip


# --------------------------------------------------------------------------- layouts, dtypes, shapes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout(layout: str, dtype: torch.dtype, device: str) -> None:
    """Each layout and format: the rule's values and scales at the named slots, nothing anywhere else (padding
    tokens, whose slots are negative, write neither)."""
    inp = make_inputs(7, 2, 2, 16, 8, torch.bfloat16, seed=_seed(layout, dtype))
    cache_loc = slots_for(7, 11, seed=_seed(layout, "slots"))
    assert bool((cache_loc < 0).any())
    run(inp, cache_loc, LAYOUTS[layout], dtype, 11, device=device).check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize(
    ("kv_dtype", "rope_style", "head_dim", "rotary_dim", "norm"),
    [
        (torch.bfloat16, "neox", 16, 16, True),  # K in pieces, full rotary
        (torch.float16, "neox", 32, 8, True),  # K as one tile (NeoX over part of the head)
        (torch.float32, "gptj", 32, 8, True),  # pieces with pass-through dims
        (torch.bfloat16, "gptj", 16, 16, False),  # a RoPE-only draft
        (torch.float16, "neox", 24, 8, False),  # a head dim that is no power of two
    ],
)
def test_shapes_and_styles(
    kv_dtype: torch.dtype, rope_style: str, head_dim: int, rotary_dim: int, norm: bool, dtype: torch.dtype, device: str
) -> None:
    inp = make_inputs(
        6, 3, 3, head_dim, rotary_dim, kv_dtype, rope_style, norm=norm, eps_per_layer=True,
        seed=_seed(kv_dtype, rope_style, head_dim, dtype),
    )  # fmt: skip
    cache_loc = slots_for(6, 9, seed=_seed("shapes"))
    result = run(inp, cache_loc, LAYOUTS["stacked"], dtype, 9, device=device)
    if device == "cuda" and kv_dtype == torch.float32 and norm:
        result.check_within_a_step()
    else:
        result.check()


def _magnitudes(seed: int, head_dim: int = 16) -> Inputs:
    """A RoPE-only draft (K keeps kv's magnitudes) whose rows span 2**-60 to 2**60, with one K row and one V row
    of zeros and one K row of a single nonzero value."""
    inp = make_inputs(6, 2, 2, head_dim, head_dim, torch.float32, norm=False, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = inp.kv.view(6, 2, 4, head_dim)  # per token and layer: K heads, then V heads
    rows *= torch.exp2(torch.randint(-60, 61, (6, 2, 4, 1), generator=gen).float())
    rows[1, 0, 0] = 0.0  # a K row of zeros: its scale is the floor, its values 0
    rows[2, 1, 3] = 0.0  # a V row of zeros
    rows[3, 1, 1] = 0.0
    rows[3, 1, 1, 5] = -3e-12  # one tiny value: amax / qmax below the floor, the floor it is
    return inp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
def test_magnitudes_and_zero_rows(dtype: torch.dtype, device: str) -> None:
    """Rows of very different magnitudes each get their own scale; a row of zeros gets the floor (1e-6) and zeros."""
    inp = _magnitudes(_seed("magnitudes", dtype))
    cache_loc = torch.tensor([3, 0, 7, 5, 1, 2])
    result = run(inp, cache_loc, LAYOUTS["stacked"], dtype, 8, device=device)
    result.check()
    k_scales, v_scales = result.bases[1][0].cpu(), result.bases[1][1].cpu()
    assert k_scales[0, 0, 0] == FLOOR and v_scales[1, 7, 1] == FLOOR  # token 1's K head 0, token 2's V head 1
    assert k_scales[1, 5, 1] == FLOOR  # the tiny row
    written = torch.cat((k_scales[:, cache_loc].flatten(), v_scales[:, cache_loc].flatten()))
    assert written.max() / written.min() > 2.0**50  # the rows' scales span their magnitudes


@pytest.mark.production
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
def test_bad_positions(dtype: torch.dtype, device: str) -> None:
    """Production: a position outside ``[0, P)`` gives NaN K, so a NaN scale and NaN values (int8: zeros); V as
    usual."""
    inp = make_inputs(5, 2, 2, 16, 16, torch.bfloat16, num_positions=20, seed=_seed("positions", dtype))
    inp.positions[1] = 20
    inp.positions[3] = -1
    result = run(inp, torch.tensor([4, 0, 2, 1, 3]), LAYOUTS["stacked"], dtype, 6, device=device)
    result.check()
    k_scales = result.bases[1][0].cpu()
    assert bool(k_scales[:, [0, 1]].isnan().all()) and not bool(k_scales[:, [2, 3, 4]].isnan().any())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=_name)
@pytest.mark.parametrize("layout", ["stacked", "list_paged_hnd", "vllm_packed_nhd"])
def test_all_slots_negative_write_nothing(layout: str, dtype: torch.dtype) -> None:
    inp = make_inputs(4, 2, 2, 16, 16, torch.bfloat16, seed=3)
    run(inp, torch.tensor([-1, -7, -1, -(2**40)]), LAYOUTS[layout], dtype, 9).check()


@pytest.mark.parametrize("device", DEVICES)
def test_int8_rounds_to_nearest_even(device: str) -> None:
    """int8 stores ``row / scale`` rounded to the nearest integer, ties to even, not truncated: a V row
    ``127 * [1, 0.5, 1.5, 2.5, -0.5, -2.5, 0.75, ...] / 127`` has scale 1 exactly (amax 127). A row holding
    a NaN has a NaN scale and stores 0 throughout (on CUDA one conversion instruction does all three)."""
    inp = make_inputs(1, 2, 1, 16, 16, torch.float32, norm=False, seed=4)
    values = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 0.75, -0.75, 126.5, -126.5, 3.49, -3.51, 0, 0, 0, 0])
    inp.kv[0, :, 16:] = values
    inp.kv[0, 1, 16 + 3] = float("nan")
    result = run(inp, torch.tensor([0]), LAYOUTS["stacked"], torch.int8, 1, device=device)
    stored, scales = result.bases[0][1][:, 0, 0].cpu(), result.bases[1][1][:, 0, 0].cpu()
    assert scales[0] == 1.0 and scales[1].isnan()
    assert stored[0].tolist() == [127, 0, 2, 2, 0, -2, 1, -1, 126, -126, 3, -4, 0, 0, 0, 0]
    assert stored[1].tolist() == [0] * 16


# --------------------------------------------------------------------------- with V's norm, with a table per layer


def _reference_rows(inp: Inputs) -> tuple[Tensor, Tensor]:
    """K and V ``[L, T, H, D]`` as the reference path computes them (torch ops, whichever path the run takes):
    K normed and rotated, then rounded to kv's dtype; V normed (with a V norm weight) and rounded to kv's dtype."""
    k, v = kv_reference.rmsnorm_rope(
        inp.kv, (inp.k_norm_weight, inp.eps, inp.cos_sin_cache, inp.positions), inp.num_kv_heads,
        inp.rope_style == "neox", inp.v_norm_weight,
    )  # fmt: skip
    return k.to(inp.kv.dtype), v


MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize("layout", ["stacked", "list_paged_hnd", "vllm_packed_nhd"])
def test_v_norm_with_written_scales(layout: str, dtype: torch.dtype, mode: str) -> None:
    """``v_norm_weight`` beside scales written per row: V normed (float32), rounded to kv's dtype, then quantized
    per row with its own scale. The pools and scales hold, bit for bit, the rule applied to the reference path's
    K and normed V (under the interpreter: the kernel against the reference), in both modes; a V norm changes V's
    values and so its scales."""
    inp = make_inputs(7, 2, 2, 16, 8, torch.bfloat16, eps_per_layer=True, v_norm=True, seed=_seed("vn", layout, dtype))
    assert inp.v_norm_weight is not None
    inp = replace(inp, v_norm_weight=inp.v_norm_weight * torch.tensor([[4.0], [0.25]]))  # layers' other magnitudes
    cache_loc = slots_for(7, 11, seed=_seed("vn-slots", layout))
    normed = run(inp, cache_loc, LAYOUTS[layout], dtype, 11, expected_rows=_reference_rows(inp))
    normed.check()
    plain = run(replace(inp, v_norm_weight=None), cache_loc, LAYOUTS[layout], dtype, 11)
    plain.check()
    for normed_base, plain_base in zip(normed.bases, plain.bases, strict=True):
        assert not torch.equal(normed_base.view(torch.uint8), plain_base.view(torch.uint8))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize(("layout", "rope_style"), [("stacked", "neox"), ("paged_nhd", "gptj"), ("list_flat", "neox")])
def test_layer_tables_with_written_scales(layout: str, rope_style: str, dtype: torch.dtype, mode: str) -> None:
    """A RoPE table per layer (``cos_sin_cache`` ``[L, P, R]``) beside scales written per row: each layer's K
    rotated by its own table, then quantized per row; bit for bit the rule applied to the reference path's K and
    V, in both modes (with a V norm too in the last layout)."""
    inp = make_inputs(
        6, 3, 2, 16, 8, torch.float16, rope_style, layer_tables=True, v_norm=layout == "list_flat",
        seed=_seed("tables", layout, dtype),
    )  # fmt: skip
    assert inp.cos_sin_cache.dim() == 3
    cache_loc = slots_for(6, 9, seed=_seed("tables-slots", layout))
    tabled = run(inp, cache_loc, LAYOUTS[layout], dtype, 9, expected_rows=_reference_rows(inp))
    tabled.check()
    # Layer 0's table for every layer: another K, so other K values and scales.
    one = replace(inp, cos_sin_cache=inp.cos_sin_cache[0])
    assert not torch.equal(_reference_rows(one)[0], _reference_rows(inp)[0])
    run(one, cache_loc, LAYOUTS[layout], dtype, 9, expected_rows=_reference_rows(one)).check()


# --------------------------------------------------------------------------- vLLM's per-token-head caches


def _vllm_rule(x: Tensor, qmax: float, qmin: float) -> tuple[Tensor, Tensor]:
    """vLLM's per-token-head quantization, transcribed: ``scale = max(max(|x|) / QUANT_MAX, 1e-6)``, stored
    ``clamp(x * (1.0 / scale), QUANT_MIN, QUANT_MAX)`` (float32), before the store's conversion."""
    xf = x.detach().cpu().float()
    scale = torch.clamp(xf.abs().amax(-1) / qmax, min=1e-6)
    return (xf * (1.0 / scale).unsqueeze(-1)).clamp(qmin, qmax), scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("layout", ["vllm_packed_nhd", "vllm_packed_hnd"])
def test_vllm_per_token_head(layout: str, dtype: torch.dtype, device: str) -> None:
    """vLLM's ``int8_per_token_head`` / ``fp8_per_token_head`` caches, written through views of their bytes.

    vLLM's Triton attention backend keeps each layer's cache as raw bytes of logical shape ``(num_blocks,
    num_kv_heads, block_size, 2 * (head_size + pad))``, ``pad = sizeof(float32) / sizeof(cache dtype)`` (4 for
    these 1-byte caches), NHD or HND in memory; each (block, head, slot) holds ``[K | K scale | V | V scale]``,
    the float32 scale in the ``pad`` bytes after each half's values, read through strided float32 views
    (``TritonAttentionImpl._ensure_scale_caches`` in ``vllm/v1/attention/backends/triton_attn.py``, ROCm/vllm
    commit 095f6f38ecdd826574d4803a70159a29bf4cfd8f, a fork that follows vllm-project/vllm; the feature is
    vllm-project/vllm#38378). Its cache write quantizes each (token, head) row of the attention layer's K
    (after RoPE, in the model's dtype) and V with ``_reshape_cache_per_token_head`` in
    ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` (ROCm/vllm commit
    d923ce8d9a5b57868c0a2b5e6328dbe58d19087c): ``scale = max(max(|x|) / QUANT_MAX, 1e-6)``, ``x * (1.0 / scale)``
    clamped to ``[QUANT_MIN, QUANT_MAX]`` (int8: -128, 127; FP8: the platform's e4m3 range, 448 for
    float8_e4m3fn), the float stored by the pointer's conversion. `_vllm_rule` transcribes it.

    FP8: the conversion rounds to nearest even, and typedkv stores exactly what the rule gives. int8: Triton's
    float-to-int8 store truncates toward zero (``cvt.rzi`` in the PTX), while typedkv rounds to the nearest
    integer, ties to even (as vLLM's own test reference, ``torch.round``): every value equals the rounded rule and
    is within one step of the truncated one. Divisions are correctly rounded here, as in typedkv; vLLM's kernel
    divides with Triton's default ``/``, which compiles to ``div.full.f32`` (``max / QUANT_MAX``) and
    ``div.approx.f32`` (``1.0 / scale``) for NVIDIA GPUs, so on a GPU its scales and reciprocals may differ from
    these in the last bits.
    """
    inp = make_inputs(7, 2, 2, 16, 16, torch.bfloat16, seed=_seed("vllm", layout, dtype))
    cache_loc = slots_for(7, 11, seed=_seed("vllm slots"))
    result = run(inp, cache_loc, LAYOUTS[layout], dtype, 11, device=device)
    result.check()  # the documented rule, bit for bit, and nothing outside the rows
    k, v = _on(inp, device).dense()
    qmin, qmax = (-128.0, 127.0) if dtype == torch.int8 else (-448.0, 448.0)
    k_pool, v_pool, k_scales, v_scales = LAYOUTS[layout].view([b.cpu() for b in result.bases], 16, dtype)
    kept = (cache_loc >= 0).nonzero().flatten()
    slots = cache_loc[kept]
    for rows, pool, scales in ((k, k_pool, k_scales), (v, v_pool, v_scales)):
        rule, rule_scale = _vllm_rule(rows[:, kept], qmax, qmin)
        for layer in range(inp.num_layers):
            page, within = slots // PAGE, slots % PAGE
            if LAYOUTS[layout].kv_layout == "HND":
                got, got_scale = pool[layer][page, :, within], scales[layer][page, :, within]
            else:
                got, got_scale = pool[layer][page, within], scales[layer][page, within]
            assert torch.equal(got_scale, rule_scale[layer])
            if dtype == torch.int8:
                assert torch.equal(got, torch.round(rule[layer]).to(torch.int8))
                truncated = rule[layer].trunc()
                assert bool(((got.float() - truncated).abs() <= 1).all())
                assert bool((got.float() != truncated).any())  # the two roundings do differ on these rows
            else:
                assert torch.equal(got.view(torch.uint8), rule[layer].to(dtype).view(torch.uint8))


# --------------------------------------------------------------------------- the materializer


def _materializer(
    dtype: torch.dtype, seed: int, *, v_norm: bool = False, layer_tables: bool = False
) -> tuple[typedkv.KVMaterializer, Tensor, Tensor]:
    """A draft of 2 layers, 2 heads of 16 (``v_norm``: V normed too; ``layer_tables``: a RoPE table per layer)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers, heads, head_dim, hidden = 2, 2, 16, 48
    weight = (torch.randn(num_layers, 2 * heads * head_dim, hidden, generator=gen) / 8).to(dtype)
    norm = torch.rand(num_layers, head_dim, generator=gen) + 0.5
    angles = torch.rand(*((num_layers,) if layer_tables else ()), 64, 4, generator=gen) * 6.2
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    v_weight = torch.rand(num_layers, head_dim, generator=gen) + 0.5 if v_norm else None
    m = typedkv.KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=heads, v_norm_weight=v_weight)
    tokens = torch.randn(5, hidden, generator=gen).to(dtype)
    return m, tokens, torch.randint(0, 64, (5,), generator=gen)


# The interpreter computes tl.dot on bfloat16 wrongly (tests/test_fused_projection.py): float16 there.
_MATERIALIZER_DTYPE = torch.float16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["gemm", "fused"])
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize("layout", ["stacked", "list_paged_hnd", "vllm_packed_nhd"])
def test_materializer_paths(layout: str, dtype: torch.dtype, path: str, device: str) -> None:
    """``KVMaterializer.into_pool`` on either projection path: the rule applied to that path's own K and V
    (``m(hidden)``), bit for bit."""
    _materializer_into_pool(layout, dtype, path, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["gemm", "fused"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=_name)
def test_materializer_v_norm_and_layer_tables(dtype: torch.dtype, path: str, device: str) -> None:
    """A draft with V normed and a RoPE table per layer, into pools with scales written per row, on either path:
    the rule applied to that path's own normed V and K (``m(hidden)``), bit for bit."""
    _materializer_into_pool("list_paged_hnd", dtype, path, device, v_norm=True, layer_tables=True)


def _materializer_into_pool(layout: str, dtype: torch.dtype, path: str, device: str, **draft: bool) -> None:
    m, hidden, positions = _materializer(_MATERIALIZER_DTYPE, _seed("materializer", layout), **draft)
    m = m.to(device)
    m.projection_path = path  # type: ignore[assignment]
    hidden, positions = hidden.to(device), positions.to(device)
    k, v = m(hidden, positions)
    inp = make_inputs(5, 2, 2, 16, 8, _MATERIALIZER_DTYPE, seed=0)  # only its sizes are read

    def call(cache_loc: Tensor, *views: Any) -> None:
        k_pool, v_pool, k_scales, v_scales = views
        m.into_pool(
            hidden, positions, cache_loc, k_pool, v_pool, k_scale_out=k_scales, v_scale_out=v_scales,
            kv_layout=LAYOUTS[layout].kv_layout,
        )  # fmt: skip

    cache_loc = torch.tensor([6, -1, 0, 9, 3])
    run(inp, cache_loc, LAYOUTS[layout], dtype, 11, device=device, call=call, expected_rows=(k, v)).check()


def test_split_path_never_takes_written_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split way (V's GEMM writing dense V straight into its output) cannot scale V per row: a pool call,
    scales written or not, never takes it, even where the tables say it is faster."""
    m, hidden, positions = _materializer(torch.float32, 5)
    monkeypatch.setattr(tuning, "split_gemm_faster", lambda device, num_tokens: True)
    monkeypatch.setattr(launcher, "use_kernel", lambda device: True)
    k_pool, v_pool = torch.zeros(2, 8, 2, 16, dtype=torch.int8), torch.zeros(2, 8, 2, 16, dtype=torch.int8)
    k_scales, v_scales = torch.zeros(2, 8, 2), torch.zeros(2, 8, 2)
    state = m._state()
    call = PoolCall(
        hidden, state[2], state[3], state[4], positions, torch.arange(5), k_pool, v_pool, 2, "neox",
        v_norm_weight=None, k_scale=None, v_scale=None, k_scale_out=k_scales, v_scale_out=v_scales, kv_layout=None,
    )  # fmt: skip
    way = dispatch.way("gemm", call, state, num_kv_heads=2, head_dim=16, neox=True)
    assert way == "gemm"
    dense = DenseCall(
        hidden, state[2], state[3], state[4], positions, 2, "neox", v_norm_weight=None, k_out=None, v_out=None
    )
    assert dispatch.way("gemm", dense, state, num_kv_heads=2, head_dim=16, neox=True) == "split"  # the table applies


# --------------------------------------------------------------------------- misuse


def _pools(dtype: torch.dtype = torch.int8) -> dict[str, Any]:
    L, S, H, D = 2, 8, 2, 16
    return {
        "k_pool": torch.full((L, S, H, D), 7).to(dtype),
        "v_pool": torch.full((L, S, H, D), 7).to(dtype),
        "k_scale_out": torch.full((L, S, H), 7.0),
        "v_scale_out": torch.full((L, S, H), 7.0),
    }


def _call(**args: Any) -> None:
    inp = make_inputs(4, 2, 2, 16, 16, torch.bfloat16, seed=9)
    typedkv.materialize_kv_into_pool(
        inp.kv, inp.k_norm_weight, inp.eps, inp.cos_sin_cache, inp.positions, torch.arange(4), **args, num_kv_heads=2
    )


_MISUSE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "bfloat16-pool": (
        lambda a: a.update(k_pool=a["k_pool"].to(torch.bfloat16), v_pool=a["v_pool"].to(torch.bfloat16)),
        "k_scale_out: expected None for a bfloat16 pool (scales are written for FP8 and int8 pools), got a tensor "
        "of shape (2, 8, 2)",
    ),
    "int8-without-scales": (
        lambda a: a.update(k_scale_out=None, v_scale_out=None),
        "k_scale_out: expected a tensor to write K's scales into for an int8 pool, got None: an int8 pool holds "
        "row / scale, with a scale per (token, layer, head) that the call computes: pass k_scale_out and "
        "v_scale_out, float32, shaped like the pools without their last dim",
    ),
    "int8-given-scales": (
        lambda a: a.update(k_scale_out=None, v_scale_out=None, k_scale=0.5),
        "k_scale_out: expected a tensor to write K's scales into for an int8 pool, got None: an int8 pool holds "
        "row / scale, with a scale per (token, layer, head) that the call computes: pass k_scale_out and "
        "v_scale_out, float32, shaped like the pools without their last dim",
    ),
    "only-k": (
        lambda a: a.update(v_scale_out=None),
        "v_scale_out: expected a tensor beside k_scale_out, got None: K's and V's scales are written together "
        "(pass both, or neither)",
    ),
    "only-v": (
        lambda a: a.update(k_scale_out=None),
        "k_scale_out: expected a tensor beside v_scale_out, got None: K's and V's scales are written together "
        "(pass both, or neither)",
    ),
    "given-and-written": (
        lambda a: a.update(
            k_pool=a["k_pool"].view(torch.float8_e4m3fn),
            v_pool=a["v_pool"].view(torch.float8_e4m3fn),
            v_scale=torch.ones(2),
        ),
        "v_scale: expected None beside k_scale_out, got a tensor of shape (2,): the call computes each row's scale "
        "and writes it into k_scale_out; pass scales to apply or tensors to write them into, not both",
    ),
    "scale-dtype": (
        lambda a: a.update(v_scale_out=a["v_scale_out"].to(torch.bfloat16)),
        "v_scale_out: expected dtype float32, got bfloat16: allocate it with one of these dtypes",
    ),
    "scale-shape": (
        lambda a: a.update(k_scale_out=torch.zeros(2, 8, 3)),
        "k_scale_out: expected shape (L=2, S=8, H=2), got (2, 8, 3): H=2 comes from num_kv_heads; one element per "
        "row of k_pool, its shape without the last dim",
    ),
    "scale-with-head-dim": (
        lambda a: a.update(k_scale_out=torch.zeros(2, 8, 2, 16)),
        "k_scale_out: expected shape (L=2, S=8, H=2), got (2, 8, 2, 16): one element per row of k_pool, its shape "
        "without the last dim",
    ),
    "scale-device": (
        lambda a: a.update(v_scale_out=torch.zeros(2, 8, 2, device="meta")),
        "v_scale_out: expected device cpu (kv's device), got meta: allocate it on kv.device",
    ),
    "scale-kind": (
        lambda a: a.update(k_scale_out=list(a["k_scale_out"])),
        "k_scale_out: expected the same layout as k_pool (a stacked tensor), got list",
    ),
    "scale-layer-strides": (
        lambda a: a.update(
            k_pool=list(a["k_pool"]),
            v_pool=list(a["v_pool"]),
            v_scale_out=list(a["v_scale_out"]),
            k_scale_out=[torch.zeros(8, 2), torch.zeros(2, 8).t()],
        ),
        "k_scale_out[1]: expected strides (2, 1) (k_scale_out[0]'s), got (1, 8): per-layer pools must share one layout",
    ),
    "scale-over-pool": (
        lambda a: a.update(k_scale_out=a["k_pool"].view(torch.uint8)[..., :8].view(torch.float32)[..., 0]),
        "k_scale_out: expected memory apart from k_pool, got views that overlap: writes to one would land in the other",
    ),
    "scales-same-memory": (
        lambda a: a.update(v_scale_out=a["k_scale_out"]),
        "v_scale_out: expected memory apart from k_scale_out, got the same tensor",
    ),
    "scale-expanded": (
        lambda a: a.update(k_scale_out=torch.zeros(2, 1, 2).expand(2, 8, 2)),
        "k_scale_out: expected memory of its own for every element, got strides (2, 0, 1) (an expanded view): "
        "writes to it would collide",
    ),
}


@pytest.mark.parametrize("mode", ["debug", pytest.param("production", marks=pytest.mark.production)])
@pytest.mark.parametrize("case", list(_MISUSE))
def test_misuse(case: str, mode: str) -> None:
    """Each misuse is an InputError with its message, in both modes, before anything is written."""
    change, message = _MISUSE[case]
    args = _pools()
    change(args)
    before = {
        name: [t.clone() for t in _layers(value)] for name, value in args.items() if isinstance(value, (Tensor, list))
    }
    with pytest.raises(typedkv.InputError) as err:
        _call(**args)
    assert str(err.value).startswith(message), str(err.value)
    for name, copies in before.items():
        for t, was in zip(_layers(args[name]), copies, strict=True):
            if t.device.type != "meta":
                assert torch.equal(t.float(), was.float()), f"{name} was written"


def test_inline_scales_do_not_collide_with_their_pool() -> None:
    """Scales kept in the 4 bytes after each row's values share no byte with the values, so the call is accepted;
    a scale view 4 bytes earlier would overlap the last values of its row, and is refused."""
    base = torch.zeros(2, 8, 2, 2 * (16 + 4), dtype=torch.int8)
    flat = base.view(torch.float32)  # [2, 8, 2, 10]
    pools = {"k_pool": base[..., :16], "v_pool": base[..., 20:36]}
    _call(**pools, k_scale_out=flat[..., 4], v_scale_out=flat[..., 9])
    early = flat[..., 3]  # bytes 12-15: the row's last four values
    with pytest.raises(typedkv.InputError, match=r"^k_scale_out: expected memory apart from k_pool, got views that"):
        _call(**pools, k_scale_out=early, v_scale_out=flat[..., 9])


def test_meta_dry_run() -> None:
    """Meta tensors (a dry run of shapes) go through the checks and write nothing."""
    args = {name: t.to("meta") for name, t in _pools().items()}
    inp = make_inputs(4, 2, 2, 16, 16, torch.bfloat16, seed=9)
    assert inp.k_norm_weight is not None
    typedkv.materialize_kv_into_pool(
        inp.kv.to("meta"), inp.k_norm_weight.to("meta"), inp.eps, inp.cos_sin_cache.to("meta"),
        inp.positions.to("meta"), torch.arange(4, device="meta"), **args, num_kv_heads=2,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:typedkv. .* shares one allocation")
def test_compiled_matches_eager() -> None:
    """Under ``torch.compile`` (one opaque op per call) the scales are written as eagerly, stacked and per layer."""
    torch._dynamo.reset()
    inp = make_inputs(5, 2, 2, 16, 16, torch.bfloat16, seed=11)
    cache_loc = torch.tensor([3, -1, 0, 6, 2])

    def call(*views: Any) -> None:
        typedkv.materialize_kv_into_pool(
            inp.kv, inp.k_norm_weight, inp.eps, inp.cos_sin_cache, inp.positions, cache_loc, *views[:2],
            num_kv_heads=2, k_scale_out=views[2], v_scale_out=views[3],
        )  # fmt: skip

    compiled = torch.compile(call, fullgraph=True)
    for layout in ("stacked", "list_flat"):
        got, want = (_fresh(LAYOUTS[layout], torch.int8) for _ in range(2))
        compiled(*LAYOUTS[layout].view(got, 16, torch.int8))
        call(*LAYOUTS[layout].view(want, 16, torch.int8))
        for a, b in zip(got, want, strict=True):
            assert_same_bits(a, b)
    torch._dynamo.reset()


def _fresh(layout: Layout, dtype: torch.dtype) -> list[Tensor]:
    bases = layout.alloc(2, 8, 2, 16, dtype)
    for base in bases:
        base.view(torch.uint8).fill_(SENTINEL)
    return bases


@pytest.mark.parametrize("num_layers", [0, 2])
def test_no_tokens_or_layers(num_layers: int) -> None:
    inp = make_inputs(0, max(num_layers, 1), 2, 16, 16, torch.bfloat16, seed=1)
    bases = _fresh(LAYOUTS["list_flat"], torch.int8)
    k, v, k_s, v_s = LAYOUTS["list_flat"].view(bases, 16, torch.int8)
    before = [b.clone() for b in bases]
    layers = slice(0, num_layers)
    assert inp.k_norm_weight is not None
    typedkv.materialize_kv_into_pool(
        inp.kv[:, :num_layers], inp.k_norm_weight[:num_layers], inp.eps, inp.cos_sin_cache, inp.positions,
        torch.zeros(0, dtype=torch.int64), k[layers], v[layers], num_kv_heads=2, k_scale_out=k_s[layers],
        v_scale_out=v_s[layers],
    )  # fmt: skip
    for a, b in zip(bases, before, strict=True):
        assert_same_bits(a, b)


# --------------------------------------------------------------------------- GPU only: syncs and CUDA graphs


@pytest.mark.gpu
@pytest.mark.production
def test_no_sync_and_graph_replay() -> None:
    """On CUDA, production calls writing scales per row never synchronise (stacked and per-layer scale tensors,
    the latter through a layer table), and a CUDA graph captured with them writes what an eager call writes after
    new values are copied into its inputs."""
    inp = _on(make_inputs(24, 3, 2, 64, 32, torch.bfloat16, seed=21), "cuda")
    layouts = [LAYOUTS["stacked"], LAYOUTS["vllm_packed_hnd"]]
    graphed = [[b.cuda() for b in layout.alloc(3, 40, 2, 64, torch.int8)] for layout in layouts]
    eager = [[b.clone() for b in bases] for bases in graphed]
    cache_loc = torch.randperm(40, device="cuda")[:24]
    cache_loc[::5] = -1

    def step(all_bases: list[list[Tensor]]) -> None:
        for layout, bases in zip(layouts, all_bases, strict=True):
            inp.into_pool_scaled(cache_loc, *layout.view(bases, 64, torch.int8), kv_layout=layout.kv_layout)

    step(graphed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(graphed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    inp.kv.copy_(torch.randn_like(inp.kv, dtype=torch.float32).to(inp.kv.dtype) * 3)
    graph.replay()
    step(eager)
    torch.cuda.synchronize()
    for got, want in zip(graphed, eager, strict=True):
        for a, b in zip(got, want, strict=True):
            assert_same_bits(a.cpu(), b.cpu())
