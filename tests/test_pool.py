"""``typedkv.materialize_kv_into_pool``: K/V rows written into a paged pool, nothing else.

The oracle is the dense op: row ``cache_loc[t]`` of layer ``l``'s pool must hold
``materialize_kv(...)[l, t]`` bit for bit (16/32-bit pools). FP8 pools store
``saturate(x / scale)`` of the *float32* K (the kernel quantizes K before any
rounding to kv's dtype), so their K oracle is the float32 K -- the dense op itself
for float32 kv, ``typedkv.kv.reference.rmsnorm_rope`` otherwise -- cast with torch;
V is the kv slice divided by the scale. As documented, the division is
``x * (1 / scale)`` in float32 (`to_fp8`).

Every test poisons the pool's whole allocation (padding, other rows, other layers)
with a sentinel byte, builds the expected allocation independently (a copy with the
oracle rows put in with torch indexing) and compares the two bit for bit, so a
stray write anywhere fails.

The file also runs under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, ~0.2-0.9 s
per launch at these sizes, ~40 s for the file): shapes stay small (``T * L`` programs
per launch).

"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv.core import launcher
from typedkv.kv import reference as kv_reference

INTERPRETED = launcher.INTERPRETED
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SENTINEL = 0xA5  # a finite value in every pool dtype, never what the op writes here
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Pool = Tensor | Sequence[Tensor]
Scale = float | Tensor | None


def _seed(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """One set of ``materialize_kv`` inputs (random, never zeros)."""

    kv: Tensor
    k_norm_weight: Tensor | None  # None: a RoPE-only draft
    eps: float | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    num_kv_heads: int
    rope_style: str
    v_norm_weight: Tensor | None = None  # a draft that norms V too

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.kv.shape[2]) // (2 * self.num_kv_heads)

    def dense(self) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(
            self.kv,
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            self.positions,
            num_kv_heads=self.num_kv_heads,
            rope_style=self.rope_style,  # type: ignore[arg-type]
            v_norm_weight=self.v_norm_weight,
        )

    def into_pool(
        self,
        cache_loc: Tensor,
        k_pool: Any,
        v_pool: Any,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        kv_layout: Any = None,
    ) -> None:
        typedkv.materialize_kv_into_pool(
            self.kv,
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            self.positions,
            cache_loc,
            k_pool,
            v_pool,
            num_kv_heads=self.num_kv_heads,
            rope_style=self.rope_style,  # type: ignore[arg-type]
            v_norm_weight=self.v_norm_weight,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_layout=kv_layout,
        )

    def k_float32(self) -> Tensor:
        """K before any rounding to kv's dtype: what an FP8 pool quantizes."""
        if self.kv.dtype == torch.float32:
            return self.dense()[0]
        k, _ = kv_reference.rmsnorm_rope(
            self.kv,
            (self.k_norm_weight, self.eps, self.cos_sin_cache, self.positions),
            self.num_kv_heads,
            self.rope_style == "neox",
        )
        return k

    def v_stored(self) -> Tensor:
        """V as an FP8 pool quantizes it: `v_slice`, or with a V norm the dense op's V (normed, rounded to kv's
        dtype first, as K is)."""
        return self.v_slice() if self.v_norm_weight is None else self.dense()[1]

    def v_slice(self) -> Tensor:
        """V ``[L, T, H, D]`` straight from kv (the FP8 tests' own oracle)."""
        heads = self.num_kv_heads * self.head_dim
        v: Tensor = self.kv[..., heads:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        return v.transpose(0, 1)


def make_inputs(
    num_tokens: int = 6,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    rotary_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    rope_style: str = "neox",
    *,
    num_positions: int = 40,
    eps_per_layer: bool = False,
    seed: int = 0,
    norm: bool = True,
    v_norm: bool = False,
    layer_tables: bool = False,
) -> Inputs:
    """Random inputs; ``v_norm``: a V norm weight too; ``layer_tables``: a cos/sin table per layer ``[L, P, R]``."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_tokens, num_layers, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    weight = torch.rand(num_layers, head_dim, generator=gen) + 0.5
    eps: float | Tensor = torch.rand(num_layers, generator=gen) * 1e-3 + 1e-6 if eps_per_layer else 1e-6
    angles = torch.rand(num_positions, rotary_dim // 2, generator=gen) * 6.2
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, num_positions, (num_tokens,), generator=gen)
    v_weight = torch.rand(num_layers, head_dim, generator=gen) + 0.5 if v_norm else None
    if layer_tables:
        angles = torch.rand(num_layers, num_positions, rotary_dim // 2, generator=gen) * 6.2
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    return Inputs(kv, weight if norm else None, eps, cos_sin, positions, num_kv_heads, rope_style, v_weight)


def slots_for(num_tokens: int, num_slots: int, *, seed: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Distinct random slots in ``[0, S)``, with every third token padding (-1 or -7)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = torch.tensor([-1, -7]).repeat(num_tokens)[: len(slots[::3])]
    return slots.to(dtype)


def to_fp8(x: Tensor, scale: Scale, dtype: torch.dtype) -> Tensor:
    """``saturate(x / scale)`` cast with torch (round to nearest even).

    As documented, the division is ``x * (1 / scale)`` in float32: the reciprocal
    of the float32 scale, rounded, then one product.
    """
    xf = x.float()
    if isinstance(scale, Tensor):
        xf = xf * (1.0 / scale.float()).view(-1, 1, 1, 1)
    elif scale is not None:
        xf = xf * (1.0 / torch.tensor(scale, dtype=torch.float32))
    limit = torch.finfo(dtype).max
    return xf.clamp(-limit, limit).to(dtype)


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """How an engine lays its pools out.

    ``alloc`` makes the raw allocations (contiguous tensors: the bytes the test
    poisons and compares); ``view`` carves ``(k_pool, v_pool)`` out of them. Calling
    ``view`` on copies of the allocations gives the same views into the copies.
    """

    name: str
    alloc: Callable[[int, int, int, int, torch.dtype], list[Tensor]]
    view: Callable[[list[Tensor], int, int], tuple[Pool, Pool]]
    kv_layout: str = "NHD"
    page_size: int = 1  # B of a paged layout (1: no page dims); alloc makes ceil(S / B) pages


PAGE = 4  # slots per page in the paged layouts below: S = 11 leaves the last page part-used


def _pages(num_slots: int) -> int:
    return -(-num_slots // PAGE)


def _paged(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    return bases[0][0], bases[0][1]


def _paged_combined(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # One [L, N, 2, ...] cache: K and V pages interleaved, the two halves as views.
    return bases[0][:, :, 0], bases[0][:, :, 1]


def _paged_flashinfer(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # FlashInfer: a [N, 2, B, H, D] (or [N, 2, H, B, D]) cache per layer.
    return [cache[:, 0] for cache in bases], [cache[:, 1] for cache in bases]


def _paged_vllm(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # vLLM's flash-attention backend: a [2, N, B, H, D] cache per layer.
    return [cache[0] for cache in bases], [cache[1] for cache in bases]


def _paged_padded_heads(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # HND pages with one spare head: K the first H heads, V the last H.
    return bases[0][0][:, :, :heads], bases[0][1][:, :, 1:]


def _stacked(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    return bases[0][0], bases[0][1]


def _stacked_padded_heads(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # Each row holds H + 1 heads; V starts one head in.
    return bases[0][0][:, :, :heads], bases[0][1][:, :, 1:]


def _stacked_wide_rows(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # Row stride H*D + 24; V starts 8 elements into the row.
    width = heads * head_dim
    k = bases[0][0][..., :width].unflatten(-1, (heads, head_dim))
    v = bases[0][1][..., 8 : 8 + width].unflatten(-1, (heads, head_dim))
    return k, v


def _stacked_row_slab(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # A window of rows of a larger slab: layer stride > S*H*D, nonzero start.
    num_slots = bases[0].shape[1] - 5
    return bases[0][:, 2 : 2 + num_slots], bases[1][:, 3 : 3 + num_slots]


def _stacked_mixed(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # K contiguous, V with padded heads: K and V strides differ.
    return bases[0], bases[1][:, :, 1:]


def _list_views(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    return list(bases[0][0]), list(bases[0][1])


def _list_reversed(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # Layer l lives below layer 0 in memory: negative offsets in the layer table.
    # (Views of the base, reversed as a list: .flip would copy, and the op would write the copy.)
    return list(bases[0][0].unbind(0))[::-1], tuple(bases[0][1].unbind(0))[::-1]


def _list_separate(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    half = len(bases) // 2
    return list(bases[:half]), tuple(bases[half:])


def _list_padded_heads(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    return [layer[:, :heads] for layer in bases[0]], [layer[:, 1:] for layer in bases[1]]


def _list_wide_rows(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    width = heads * head_dim
    k = [layer[:, :width].unflatten(-1, (heads, head_dim)) for layer in bases[0]]
    v = [layer[:, 16 : 16 + width].unflatten(-1, (heads, head_dim)) for layer in bases[1]]
    return k, v


def _list_unaligned(bases: list[Tensor], heads: int, head_dim: int) -> tuple[Pool, Pool]:
    # Each layer one element into its own row of the allocation: layer 0 off 16 bytes, and no offset
    # between layers a whole 16-byte vector (the kernels' table launch that stores element by element).
    layers = [row[1:].view(-1, heads, head_dim) for row in bases[0]]
    return layers[: len(layers) // 2], layers[len(layers) // 2 :]


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("stacked", lambda L, S, H, D, dt: [torch.empty(2, L, S, H, D, dtype=dt)], _stacked),
        Layout(
            "stacked_padded_heads",
            lambda L, S, H, D, dt: [torch.empty(2, L, S, H + 1, D, dtype=dt)],
            _stacked_padded_heads,
        ),
        Layout(
            "stacked_wide_rows", lambda L, S, H, D, dt: [torch.empty(2, L, S, H * D + 24, dtype=dt)], _stacked_wide_rows
        ),
        Layout(
            "stacked_row_slab",
            lambda L, S, H, D, dt: [torch.empty(L, S + 5, H, D, dtype=dt), torch.empty(L, S + 5, H, D, dtype=dt)],
            _stacked_row_slab,
        ),
        Layout(
            "stacked_mixed",
            lambda L, S, H, D, dt: [torch.empty(L, S, H, D, dtype=dt), torch.empty(L, S, H + 1, D, dtype=dt)],
            _stacked_mixed,
        ),
        Layout("list_views", lambda L, S, H, D, dt: [torch.empty(2, L, S, H, D, dtype=dt)], _list_views),
        Layout("list_reversed", lambda L, S, H, D, dt: [torch.empty(2, L, S, H, D, dtype=dt)], _list_reversed),
        Layout(
            "list_separate",
            lambda L, S, H, D, dt: [torch.empty(S, H, D, dtype=dt) for _ in range(2 * L)],
            _list_separate,
        ),
        Layout(
            "list_padded_heads",
            lambda L, S, H, D, dt: [torch.empty(L, S, H + 1, D, dtype=dt), torch.empty(L, S, H + 1, D, dtype=dt)],
            _list_padded_heads,
        ),
        Layout(
            "list_wide_rows",
            lambda L, S, H, D, dt: [torch.empty(L, S, H * D + 16, dtype=dt), torch.empty(L, S, H * D + 32, dtype=dt)],
            _list_wide_rows,
        ),
        Layout("list_unaligned", lambda L, S, H, D, dt: [torch.empty(2 * L, S * H * D + 1, dtype=dt)], _list_unaligned),
    )
}


PAGED_LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout(
            "paged_nhd",
            lambda L, S, H, D, dt: [torch.empty(2, L, _pages(S), PAGE, H, D, dtype=dt)],
            _paged,
            page_size=PAGE,
        ),
        Layout(
            "paged_hnd",
            lambda L, S, H, D, dt: [torch.empty(2, L, _pages(S), H, PAGE, D, dtype=dt)],
            _paged,
            "HND",
            PAGE,
        ),
        Layout(
            "paged_nhd_combined",
            lambda L, S, H, D, dt: [torch.empty(L, _pages(S), 2, PAGE, H, D, dtype=dt)],
            _paged_combined,
            page_size=PAGE,
        ),
        Layout(
            "paged_hnd_combined",
            lambda L, S, H, D, dt: [torch.empty(L, _pages(S), 2, H, PAGE, D, dtype=dt)],
            _paged_combined,
            "HND",
            PAGE,
        ),
        Layout(
            "flashinfer_nhd",
            lambda L, S, H, D, dt: [torch.empty(_pages(S), 2, PAGE, H, D, dtype=dt) for _ in range(L)],
            _paged_flashinfer,
            page_size=PAGE,
        ),
        Layout(
            "flashinfer_hnd",
            lambda L, S, H, D, dt: [torch.empty(_pages(S), 2, H, PAGE, D, dtype=dt) for _ in range(L)],
            _paged_flashinfer,
            "HND",
            PAGE,
        ),
        Layout(
            "vllm_flash_attn",
            lambda L, S, H, D, dt: [torch.empty(2, _pages(S), PAGE, H, D, dtype=dt) for _ in range(L)],
            _paged_vllm,
            page_size=PAGE,
        ),
        Layout(
            "paged_hnd_padded_heads",
            lambda L, S, H, D, dt: [torch.empty(2, L, _pages(S), H + 1, PAGE, D, dtype=dt)],
            _paged_padded_heads,
            "HND",
            PAGE,
        ),
    )
}
LAYOUTS.update(PAGED_LAYOUTS)


def write_slots(pool: Pool, rows: Tensor, tokens: Tensor, slots: Tensor, layout: Layout) -> None:
    """The oracle's write, token by token: ``rows[l, t]`` to slot ``s`` of layer ``l``.

    Slot ``s`` is row ``s`` of a pool without pages, else offset ``s % B`` of page ``s // B``.
    """
    page = layout.page_size
    for layer, dst in enumerate(_layers(pool)):
        for token, slot in zip(tokens.tolist(), slots.tolist(), strict=True):
            if page == 1:
                dst[slot] = rows[layer][token]
            elif layout.kv_layout == "HND":
                dst[slot // page, :, slot % page] = rows[layer][token]
            else:
                dst[slot // page, slot % page] = rows[layer][token]


def pool_rows(pool: Pool, layout: Layout) -> Tensor:
    """``[L, N*B (or S), H, D]``: every row of ``layout``'s pool by slot (pages flattened), layers stacked."""
    layers = torch.stack(list(_layers(pool)))
    if layout.kv_layout == "HND" and layout.page_size > 1:
        layers = layers.transpose(2, 3)
    return layers.flatten(1, -3) if layout.page_size > 1 else layers


def _bits(t: Tensor) -> Tensor:
    return t.view(_BITS[t.element_size()])


def assert_same_bits(actual: Tensor, expected: Tensor) -> None:
    """Bit for bit, except that any NaN matches any NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    same = _bits(actual) == _bits(expected)
    nan = actual.float().isnan() & expected.float().isnan()
    bad = ~(same | nan)
    if bool(bad.any()):
        where = bad.nonzero()[:8].tolist()
        got = [actual[tuple(i)].float().item() for i in where]
        want = [expected[tuple(i)].float().item() for i in where]
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} elements differ; at {where}: got {got}, expected {want}"
        )


def _layers(pool: Pool) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def _snapshot(pools: Sequence[Pool]) -> list[Tensor]:
    return [t.clone() for pool in pools for t in _layers(pool)]


def _assert_unchanged(pools: Sequence[Pool], before: list[Tensor]) -> None:
    after = [t for pool in pools for t in _layers(pool)]
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(_bits(a), _bits(b)), "a rejected call wrote into a pool"


@dataclass
class PoolRun:
    """One call into poisoned pools, with everything needed to check it."""

    bases: list[Tensor]
    expected_bases: list[Tensor]
    k_pool: Pool
    v_pool: Pool
    expected_k: Pool
    expected_v: Pool
    kept: Tensor  # the tokens whose slot is in [0, S)
    slots: Tensor  # their slots

    def check(self) -> None:
        for base, expected in zip(self.bases, self.expected_bases, strict=True):
            assert_same_bits(base, expected)


def run_pool(
    inp: Inputs,
    cache_loc: Tensor,
    layout: Layout,
    pool_dtype: torch.dtype,
    num_slots: int,
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
    expected_rows: tuple[Tensor, Tensor] | None = None,
) -> PoolRun:
    """Allocate ``layout``'s pools, poison them, run the op; the expected bytes beside them.

    ``expected_rows`` (``[L, T, H, D]`` K and V in the pool dtype) defaults to the
    dense op's output (16/32-bit pools) or its FP8 quantization.
    """
    heads, head_dim = inp.num_kv_heads, inp.head_dim
    bases = layout.alloc(inp.num_layers, num_slots, heads, head_dim, pool_dtype)
    for base in bases:
        base.view(torch.uint8).fill_(SENTINEL)
    expected_bases = [base.clone() for base in bases]
    k_pool, v_pool = layout.view(bases, heads, head_dim)
    if expected_rows is None:
        if pool_dtype in FP8:
            expected_rows = (
                to_fp8(inp.k_float32(), k_scale, pool_dtype),
                to_fp8(inp.v_stored(), v_scale, pool_dtype),
            )
        else:
            expected_rows = inp.dense()
    inp.into_pool(cache_loc, k_pool, v_pool, k_scale=k_scale, v_scale=v_scale, kv_layout=layout.kv_layout)

    expected_k, expected_v = layout.view(expected_bases, heads, head_dim)
    kept = ((cache_loc >= 0) & (cache_loc < num_slots)).nonzero().flatten()
    slots = cache_loc[kept].long()
    for pool, rows in zip((expected_k, expected_v), expected_rows, strict=True):
        write_slots(pool, rows, kept, slots, layout)
    return PoolRun(bases, expected_bases, k_pool, v_pool, expected_k, expected_v, kept, slots)


# --------------------------------------------------------------------------- layouts and dtypes


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_dense(layout: str) -> None:
    """Every pool layout gets exactly the dense rows at its slots; nothing else changes."""
    inp = make_inputs(6, 3, 2, 16, 16, torch.bfloat16, seed=_seed(layout))
    cache_loc = slots_for(6, 11, seed=_seed(layout, "slots"))
    run_pool(inp, cache_loc, LAYOUTS[layout], torch.bfloat16, 11).check()


@pytest.mark.parametrize("layout", ["stacked", "list_views", *PAGED_LAYOUTS])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_rope_only_drafts(layout: str, rope_style: str) -> None:
    """k_norm_weight=None into every kind of pool: the dense op's RoPE-only rows, eps unused."""
    inp = make_inputs(
        7, 2, 2, 32, 16, torch.float16, rope_style, seed=_seed("rope-only", layout, rope_style), norm=False
    )
    inp = Inputs(inp.kv, None, float("nan"), inp.cos_sin_cache, inp.positions, inp.num_kv_heads, inp.rope_style)
    cache_loc = slots_for(7, 12, seed=_seed("rope-only", layout))
    run = run_pool(inp, cache_loc, LAYOUTS[layout], torch.float16, 12)
    run.check()
    assert not inp.dense()[0].isnan().any(), "eps must not be read without a norm weight"


@pytest.mark.parametrize("layout", list(PAGED_LAYOUTS))
@pytest.mark.parametrize("pool_dtype", FP8, ids=_name)
def test_paged_fp8(layout: str, pool_dtype: torch.dtype) -> None:
    """FP8 with per-layer scales in every paged layout."""
    inp = make_inputs(6, 3, 2, 16, 16, torch.bfloat16, seed=_seed("paged-fp8", layout, pool_dtype))
    cache_loc = slots_for(6, 11, seed=_seed("paged-fp8", layout))
    k_scale, v_scale = torch.tensor([0.02, 0.7, 3.0]), torch.tensor([1.5, 0.25, 0.1])
    run_pool(inp, cache_loc, LAYOUTS[layout], pool_dtype, 11, k_scale=k_scale, v_scale=v_scale).check()


@pytest.mark.parametrize("layout", ["paged_nhd", "flashinfer_hnd"])
def test_paged_slot_addressing(layout: str) -> None:
    """Every slot of a paged pool, in a shuffled order: slot s is page s // B, offset s % B."""
    num_slots = 3 * PAGE
    inp = make_inputs(num_slots, 2, 2, 16, 8, torch.bfloat16, seed=_seed("every-slot", layout))
    cache_loc = torch.randperm(num_slots, generator=torch.Generator().manual_seed(5))
    run_pool(inp, cache_loc, LAYOUTS[layout], torch.bfloat16, num_slots).check()


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_name)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=_name)
def test_dtypes_and_rope_styles(dtype: torch.dtype, rope_style: str, loc_dtype: torch.dtype) -> None:
    layout = "stacked" if loc_dtype == torch.int64 else "list_separate"
    inp = make_inputs(
        5, 2, 2, 32, 16, dtype, rope_style, eps_per_layer=rope_style == "gptj", seed=_seed(dtype, rope_style)
    )
    cache_loc = slots_for(5, 9, seed=_seed(dtype, rope_style, loc_dtype), dtype=loc_dtype)
    run_pool(inp, cache_loc, LAYOUTS[layout], dtype, 9).check()


@pytest.mark.parametrize(
    ("heads", "head_dim", "rotary_dim", "layout"),
    [
        (3, 80, 32, "list_padded_heads"),  # H and D not powers of two: masked lanes must not write
        (1, 64, 64, "stacked_wide_rows"),
        (5, 16, 2, "stacked_padded_heads"),
    ],
)
def test_head_geometry(heads: int, head_dim: int, rotary_dim: int, layout: str) -> None:
    inp = make_inputs(3, 2, heads, head_dim, rotary_dim, torch.float16, "gptj", seed=_seed(heads, head_dim))
    cache_loc = torch.tensor([4, -1, 0])
    run_pool(inp, cache_loc, LAYOUTS[layout], torch.float16, 6).check()


def test_pool_rows_equal_dense_rows() -> None:
    """The plain statement of the contract, written out once without the harness."""
    inp = make_inputs(4, 2, 2, 16, 8, torch.bfloat16, seed=7)
    k, v = inp.dense()
    k_pool = torch.randn(2, 10, 2, 16).bfloat16()
    v_pool = torch.randn(2, 10, 2, 16).bfloat16()
    before_k, before_v = k_pool.clone(), v_pool.clone()
    cache_loc = torch.tensor([7, -1, 2, 9])
    inp.into_pool(cache_loc, k_pool, v_pool)
    for layer in range(2):
        for token, slot in ((0, 7), (2, 2), (3, 9)):
            assert torch.equal(k_pool[layer, slot], k[layer, token])
            assert torch.equal(v_pool[layer, slot], v[layer, token])
    untouched = [s for s in range(10) if s not in (7, 2, 9)]
    assert torch.equal(k_pool[:, untouched], before_k[:, untouched])
    assert torch.equal(v_pool[:, untouched], before_v[:, untouched])


# --------------------------------------------------------------------------- slots


@pytest.mark.parametrize("layout", ["stacked", "list_separate"])
def test_all_slots_negative_writes_nothing(layout: str) -> None:
    inp = make_inputs(4, 2, seed=_seed("negative", layout))
    run = run_pool(inp, torch.tensor([-1, -2, -100, -(2**40)]), LAYOUTS[layout], torch.bfloat16, 5)
    assert run.kept.numel() == 0
    run.check()


@pytest.mark.parametrize("layout", ["stacked", "list_views"])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=_name)
def test_zero_tokens_writes_nothing(layout: str, pool_dtype: torch.dtype) -> None:
    inp = make_inputs(0, 3, seed=1)
    assert inp.kv.shape == (0, 3, 64)
    scale = torch.tensor([0.5, 1.0, 2.0]) if pool_dtype in FP8 else None
    run_pool(inp, torch.empty(0, dtype=torch.int32), LAYOUTS[layout], pool_dtype, 4, k_scale=scale).check()


@pytest.mark.production
@pytest.mark.parametrize("layout", ["stacked", "list_reversed"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=_name)
def test_production_skips_slots_past_the_pool(layout: str, loc_dtype: torch.dtype) -> None:
    """In production a slot >= S is skipped (the kernel never writes out of bounds)."""
    assert not typedkv.debug_enabled()
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    cache_loc = torch.tensor([3, 8, 0, 9, big, -1, 5], dtype=loc_dtype)
    inp = make_inputs(7, 2, seed=_seed("past", layout))
    run = run_pool(inp, cache_loc, LAYOUTS[layout], torch.bfloat16, 8)
    assert run.kept.tolist() == [0, 2, 6]
    run.check()


@pytest.mark.parametrize(
    ("cache_loc", "num_slots"),
    [([0, 8, 1], 8), ([0, 1, 2**40], 8), ([2, -1, 2], 8), ([5, 1, 5], 8), ([0], 0)],
    ids=["at-S", "far-past-S", "duplicate", "duplicate-again", "empty-pool"],
)
@pytest.mark.parametrize("layout", ["stacked", "list_separate"])
def test_debug_rejects_bad_slots(cache_loc: list[int], num_slots: int, layout: str) -> None:
    """Debug mode raises for a slot >= S and for a slot used twice, before writing."""
    assert typedkv.debug_enabled()
    inp = make_inputs(len(cache_loc), 2, seed=3)
    bases = LAYOUTS[layout].alloc(2, num_slots, 2, 16, torch.bfloat16)
    for base in bases:
        base.view(torch.uint8).fill_(SENTINEL)
    k_pool, v_pool = LAYOUTS[layout].view(bases, 2, 16)
    before = _snapshot([k_pool, v_pool])
    with pytest.raises(typedkv.InputError, match=r"^cache_loc: expected"):
        inp.into_pool(torch.tensor(cache_loc), k_pool, v_pool)
    _assert_unchanged([k_pool, v_pool], before)


def test_negative_slots_may_repeat() -> None:
    """Padding slots are not 'duplicates': several tokens may skip."""
    inp = make_inputs(5, 2, seed=4)
    cache_loc = torch.tensor([-1, 3, -1, -1, 0], dtype=torch.int32)
    run_pool(inp, cache_loc, LAYOUTS["stacked"], torch.bfloat16, 4).check()


# --------------------------------------------------------------------------- FP8


SCALES: dict[str, Callable[[int], tuple[Scale, Scale]]] = {
    "none": lambda layers: (None, None),
    "float": lambda layers: (0.37, 2.5),
    "per-layer": lambda layers: (
        torch.tensor([0.02, 0.7, 3.0])[:layers],
        torch.tensor([1.5, 0.25, 0.1], dtype=torch.float64)[:layers],
    ),
    "k-only": lambda layers: (torch.tensor([0.3, 0.6, 0.9], dtype=torch.bfloat16)[:layers], None),
}


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("pool_dtype", FP8, ids=_name)
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=_name)
def test_fp8_pools(kv_dtype: torch.dtype, pool_dtype: torch.dtype, scales: str) -> None:
    """FP8 pools hold saturate(x / scale) of the float32 K and of V, exactly."""
    layout = "list_padded_heads" if scales in ("float", "k-only") else "stacked_row_slab"
    inp = make_inputs(6, 2, 2, 32, 16, kv_dtype, "gptj" if scales == "none" else "neox", seed=_seed(kv_dtype, scales))
    # Values large enough that some of V saturates, whatever the scale.
    inp.kv[..., 64:] *= torch.where(torch.rand(inp.kv[..., 64:].shape) < 0.1, 3e4, 1.0).to(kv_dtype)
    k_scale, v_scale = SCALES[scales](2)
    cache_loc = slots_for(6, 8, seed=_seed(pool_dtype, scales))
    run_pool(inp, cache_loc, LAYOUTS[layout], pool_dtype, 8, k_scale=k_scale, v_scale=v_scale).check()


@pytest.mark.parametrize("pool_dtype", FP8, ids=_name)
def test_fp8_from_bfloat16_kv(pool_dtype: torch.dtype) -> None:
    """The common engine setup: bfloat16 model, FP8 cache; exact in both modes.

    Under the interpreter this needs the kernel's own round-to-nearest-even of the
    normed K to bfloat16 (Triton's interpreter truncates float32 -> bfloat16).
    """
    inp = make_inputs(8, 2, 2, 64, 32, torch.bfloat16, seed=_seed("bf16", pool_dtype))
    k_scale, v_scale = torch.tensor([0.5, 0.05]), 0.125
    cache_loc = slots_for(8, 9, seed=_seed("bf16", "slots"))
    run_pool(inp, cache_loc, LAYOUTS["stacked"], pool_dtype, 9, k_scale=k_scale, v_scale=v_scale).check()


def _special_values(dtype: torch.dtype) -> list[float]:
    """Values on which an FP8 cast goes wrong if done carelessly (all finite, none -0.0)."""
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny  # smallest normal
    return [
        1.9375,  # halfway 1.875 <-> 2.0 in e4m3: ties to even, carries into the exponent
        -1.9375,
        1.97,  # rounds up across the exponent boundary (e4m3 and e5m2)
        3.875,  # halfway 3.75 <-> 4.0 in e4m3
        0.9999,  # rounds to 1.0 in both
        fmax,  # the largest finite value is kept
        -fmax,
        fmax * 1.03,  # rounds past the largest finite value: saturates
        fmax * 1.5,
        -fmax * 4,
        1e30,
        -1e30,
        float("inf"),  # saturates too
        float("-inf"),
        tiny,  # smallest normal
        tiny * 0.5,  # subnormals
        tiny * 0.75,
        -tiny * 0.375,
        tiny * (1 - 2**-7),  # rounds up to the smallest normal
        tiny * 2**-4,  # the smallest e4m3 subnormal is tiny / 8, e5m2's tiny / 4
        tiny * 2**-5,  # halfway to zero: ties to even (0)
        tiny * 3 * 2**-5,
        tiny * 2**-10,  # flushes to +0 / -0
        -(tiny * 2**-10),
        0.1,
        1 / 3,
        -7.0,
        17.0,
    ]


@pytest.mark.parametrize("scales", ["none", "float", "per-layer"])
@pytest.mark.parametrize("pool_dtype", FP8, ids=_name)
def test_fp8_special_values(pool_dtype: torch.dtype, scales: str) -> None:
    """Saturation, exponent-boundary rounding, subnormals: V (and K via a tiny scale)."""
    inp = make_inputs(4, 2, 2, 16, 16, torch.float32, seed=_seed("special", pool_dtype))
    scale = {"none": [1.0, 1.0], "float": [4.0, 4.0], "per-layer": [0.25, 8.0]}[scales]
    values = torch.tensor(_special_values(pool_dtype))
    for layer in range(2):
        # Multiplied by a power of two: v / scale is exactly the special value.
        block = inp.kv[:, layer, 32:].clone()  # V of this layer, [T, H*D]: 4 * 32 values
        block.view(-1)[: len(values)] = values * scale[layer]
        inp.kv[:, layer, 32:] = block
    # A K scale that pushes most normed K values past the format's range.
    k_scale_value = 2.0**-12 if pool_dtype == torch.float8_e4m3fn else 2.0**-17
    if scales == "none":
        k_scale: Scale = None
        v_scale: Scale = None
    elif scales == "float":
        k_scale, v_scale = k_scale_value, 4.0
    else:
        k_scale, v_scale = torch.tensor([k_scale_value, 1.0]), torch.tensor(scale)
    run = run_pool(inp, torch.tensor([2, 0, 5, 3]), LAYOUTS["stacked"], pool_dtype, 6, k_scale=k_scale, v_scale=v_scale)
    run.check()

    # The oracle is torch's cast; pin the values that matter independently of it.
    assert isinstance(run.v_pool, Tensor) and isinstance(run.k_pool, Tensor)
    fmax = torch.finfo(pool_dtype).max
    stored = run.v_pool[:, [2, 0, 5, 3]].reshape(2, -1)[:, : len(values)].float()
    for layer in range(2):
        got = dict(zip(_special_values(pool_dtype), stored[layer].tolist(), strict=True))
        assert got[1.9375] == 2.0 and got[-1.9375] == -2.0 and got[1.97] == 2.0
        assert got[fmax * 1.5] == fmax and got[float("inf")] == fmax and got[float("-inf")] == -fmax
        assert got[1e30] == fmax and got[-1e30] == -fmax
    if scales != "none":
        k_stored = run.k_pool[0, [2, 0, 5, 3]].float()
        assert bool((k_stored.abs() == fmax).any()), "a tiny k_scale must saturate some K"


@pytest.mark.production
@pytest.mark.parametrize(
    "pool_dtype",
    [
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
    ids=_name,
)
def test_fp8_nan_stays_nan(pool_dtype: torch.dtype) -> None:
    """NaN in V, NaN in a K head (from its input or from a position outside [0, P)) stays NaN."""
    inp = make_inputs(4, 2, 2, 16, 16, torch.bfloat16, num_positions=20, seed=_seed("nan", pool_dtype))
    inp.kv[0, 1, 40] = float("nan")  # V of token 0, layer 1
    inp.kv[1, 0, 3] = float("nan")  # K head 0 of token 1, layer 0: the whole head
    inp.positions[2] = 20  # == P: token 2's K is NaN (production mode: no check)
    run = run_pool(inp, torch.tensor([0, 1, 2, 3]), LAYOUTS["stacked"], pool_dtype, 4, v_scale=0.5)
    run.check()
    assert isinstance(run.k_pool, Tensor) and isinstance(run.v_pool, Tensor)
    assert bool(run.v_pool[1, 0, 0, 8].float().isnan())
    assert bool(run.k_pool[0, 1, 0].float().isnan().all()) and not bool(run.k_pool[0, 1, 1].float().isnan().any())
    assert bool(run.k_pool[:, 2].float().isnan().all())


@pytest.mark.production
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=_name)
def test_nan_in_16_bit_pools(pool_dtype: torch.dtype) -> None:
    """V NaN copied bit for bit; K NaN where its input or its position is bad."""
    inp = make_inputs(4, 2, 2, 16, 16, pool_dtype, num_positions=20, seed=_seed("nan16", pool_dtype))
    inp.kv[0, 1, 40] = float("nan")
    inp.kv[3, 0, 20] = float("nan")  # K head 1 of token 3, layer 0
    inp.positions[2] = -3
    run = run_pool(inp, torch.tensor([3, 1, 0, 2]), LAYOUTS["list_views"], pool_dtype, 4)
    run.check()
    k_layers, v_layers = _layers(run.k_pool), _layers(run.v_pool)
    assert bool(v_layers[1][3, 0, 8].isnan())
    assert bool(k_layers[0][2, 1].isnan().all()) and not bool(k_layers[0][2, 0].isnan().any())
    assert bool(k_layers[0][0].isnan().all()) and bool(k_layers[1][0].isnan().all())


@pytest.mark.parametrize("pool_dtype", FP8, ids=_name)
def test_fp8_negative_zero(pool_dtype: torch.dtype) -> None:
    """-0.0 keeps its sign bit (0x80), as ``saturate(-0.0 / scale)`` does."""
    inp = make_inputs(2, 2, 2, 16, 16, torch.bfloat16, seed=_seed("zero", pool_dtype))
    inp.kv[..., 32:40] = -0.0
    run = run_pool(inp, torch.tensor([1, 0]), LAYOUTS["stacked"], pool_dtype, 2)
    assert isinstance(run.v_pool, Tensor)
    assert bool((run.v_pool[:, :, 0, :8].view(torch.uint8) == 0x80).all())
    run.check()


def test_per_layer_pools_reallocated_with_another_dtype() -> None:
    """An engine frees a float16 cache and allocates an FP8 one at the same addresses."""
    layers, slots, heads, head_dim = 3, 8, 2, 16
    layer_bytes = slots * heads * head_dim * 2
    raw = [torch.empty(layers * layer_bytes, dtype=torch.uint8) for _ in range(2)]

    def per_layer(buffer: Tensor, dtype: torch.dtype) -> list[Tensor]:
        size = slots * heads * head_dim * dtype.itemsize
        starts = range(0, layers * layer_bytes, layer_bytes)
        return [buffer[s : s + size].view(dtype).view(slots, heads, head_dim) for s in starts]

    inp = make_inputs(4, layers, heads, head_dim, 16, torch.float16, seed=21)
    cache_loc = torch.tensor([1, 5, 0, 7])
    inp.into_pool(cache_loc, per_layer(raw[0], torch.float16), per_layer(raw[1], torch.float16))

    for buffer in raw:
        buffer.fill_(SENTINEL)
    expected = [buffer.clone() for buffer in raw]
    k_rows = to_fp8(inp.k_float32(), None, torch.float8_e4m3fn)
    v_rows = to_fp8(inp.v_slice(), None, torch.float8_e4m3fn)
    for buffer, rows in zip(expected, (k_rows, v_rows), strict=True):
        for layer, dst in enumerate(per_layer(buffer, torch.float8_e4m3fn)):
            dst[cache_loc] = rows[layer]
    inp.into_pool(cache_loc, per_layer(raw[0], torch.float8_e4m3fn), per_layer(raw[1], torch.float8_e4m3fn))
    for buffer, want in zip(raw, expected, strict=True):
        assert torch.equal(buffer, want)


# --------------------------------------------------------------------------- misuse


L, S, H, D, T = 2, 6, 2, 16, 4


def _pool(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = (L, S, H, D)) -> Tensor:
    pool = torch.empty(shape, dtype=dtype)
    pool.view(torch.uint8).fill_(SENTINEL)
    return pool


def _fp8(**kw: Any) -> dict[str, Any]:
    return {"k_pool": _pool(torch.float8_e4m3fn), "v_pool": _pool(torch.float8_e4m3fn), **kw}


def _shared() -> dict[str, Any]:
    pool = _pool()
    return {"k_pool": pool, "v_pool": pool}


def _shared_list() -> dict[str, Any]:
    layers = list(_pool())
    return {"k_pool": layers, "v_pool": list(layers)}


def _padded_layer() -> Tensor:
    return _pool(shape=(S, H + 1, D))[:, :H]


MISUSE: dict[str, Callable[[], dict[str, Any]]] = {
    # k_pool shape
    "k_pool-wrong-H": lambda: {"k_pool": _pool(shape=(L, S, H + 1, D))},
    "k_pool-wrong-D": lambda: {"k_pool": _pool(shape=(L, S, H, D * 2))},
    "k_pool-wrong-L": lambda: {"k_pool": _pool(shape=(L + 1, S, H, D))},
    "k_pool-3d": lambda: {"k_pool": _pool(shape=(S, H, D))},
    "k_pool-flat-rows": lambda: {"k_pool": _pool(shape=(L, S, H * D))},
    "k_pool-heads-before-slots": lambda: {"k_pool": _pool(shape=(L, H, S, D))},
    "v_pool-other-S": lambda: {"v_pool": _pool(shape=(L, S + 1, H, D))},
    "k_pool-layer-wrong-S": lambda: {
        "k_pool": [_pool(shape=(S, H, D)), _pool(shape=(S + 1, H, D))],
        "v_pool": list(_pool()),
    },
    "k_pool-layer-4d": lambda: {"k_pool": list(_pool(shape=(L, 1, S, H, D))), "v_pool": list(_pool())},
    "k_pool-not-contiguous": lambda: {"k_pool": _pool(shape=(L, S, H, 2 * D))[..., ::2]},
    "k_pool-layer-not-contiguous": lambda: {
        "k_pool": list(_pool(shape=(L, S, H, 2 * D))[..., ::2]),
        "v_pool": list(_pool()),
    },
    # layout kinds
    "v_pool-list-k_pool-stacked": lambda: {"v_pool": list(_pool())},
    "v_pool-stacked-k_pool-list": lambda: {"k_pool": list(_pool())},
    "k_pool-none": lambda: {"k_pool": None},
    "k_pool-layer-none": lambda: {"k_pool": [_pool(shape=(S, H, D)), None], "v_pool": list(_pool())},
    # dtypes
    "pool-float16-for-bfloat16-kv": lambda: {"k_pool": _pool(torch.float16), "v_pool": _pool(torch.float16)},
    "pool-float32-for-bfloat16-kv": lambda: {"k_pool": _pool(torch.float32), "v_pool": _pool(torch.float32)},
    "pool-float64": lambda: {"k_pool": _pool(torch.float64), "v_pool": _pool(torch.float64)},
    "pool-int8": lambda: {"k_pool": _pool(torch.int8), "v_pool": _pool(torch.int8)},
    "pool-uint8": lambda: {"k_pool": _pool(torch.uint8), "v_pool": _pool(torch.uint8)},
    "v_pool-fp8-k_pool-bfloat16": lambda: {"v_pool": _pool(torch.float8_e4m3fn)},
    "v_pool-bfloat16-k_pool-fp8": lambda: {"k_pool": _pool(torch.float8_e5m2)},
    "v_pool-e5m2-k_pool-e4m3": lambda: {"k_pool": _pool(torch.float8_e4m3fn), "v_pool": _pool(torch.float8_e5m2)},
    "k_pool-layers-differ": lambda: {
        "k_pool": [_pool(shape=(S, H, D)), _pool(torch.float8_e4m3fn, (S, H, D))],
        "v_pool": list(_pool()),
    },
    # scales
    "k_scale-for-bfloat16-pool": lambda: {"k_scale": 0.5},
    "v_scale-tensor-for-bfloat16-pool": lambda: {"v_scale": torch.ones(L)},
    "k_scale-wrong-length": lambda: _fp8(k_scale=torch.ones(L + 1)),
    "k_scale-0d": lambda: _fp8(k_scale=torch.tensor(0.5)),
    "v_scale-int-tensor": lambda: _fp8(v_scale=torch.ones(L, dtype=torch.int32)),
    "v_scale-str": lambda: _fp8(v_scale="1.0"),
    "v_scale-meta": lambda: _fp8(v_scale=torch.ones(L, device="meta")),
    # per-layer sequences
    "k_pool-short-list": lambda: {"k_pool": list(_pool())[:1], "v_pool": list(_pool())},
    "v_pool-long-list": lambda: {"k_pool": list(_pool()), "v_pool": [*_pool(), _pool(shape=(S, H, D))]},
    "k_pool-empty-list": lambda: {"k_pool": [], "v_pool": list(_pool())},
    "k_pool-layer-strides-differ": lambda: {
        "k_pool": [_pool(shape=(S, H, D)), _padded_layer()],
        "v_pool": list(_pool()),
    },
    "v_pool-layer-strides-differ": lambda: {
        "k_pool": list(_pool()),
        "v_pool": [_pool(shape=(S, H, D)), _padded_layer()],
    },
    # cache_loc
    "cache_loc-float": lambda: {"cache_loc": torch.tensor([0.0, 1.0, 2.0, 3.0])},
    "cache_loc-int16": lambda: {"cache_loc": torch.tensor([0, 1, 2, 3], dtype=torch.int16)},
    "cache_loc-uint8": lambda: {"cache_loc": torch.tensor([0, 1, 2, 3], dtype=torch.uint8)},
    "cache_loc-short": lambda: {"cache_loc": torch.tensor([0, 1, 2])},
    "cache_loc-long": lambda: {"cache_loc": torch.tensor([0, 1, 2, 3, 4])},
    "cache_loc-2d": lambda: {"cache_loc": torch.tensor([[0], [1], [2], [3]])},
    "cache_loc-list": lambda: {"cache_loc": [0, 1, 2, 3]},
    "cache_loc-meta": lambda: {"cache_loc": torch.tensor([0, 1, 2, 3], device="meta")},
    # aliasing
    "same-tensor": _shared,
    "same-list": lambda: (lambda d: {"k_pool": d["k_pool"], "v_pool": d["k_pool"]})(_shared_list()),
    "same-layers": _shared_list,
    # a pool on another device
    "k_pool-meta": lambda: {"k_pool": torch.empty(L, S, H, D, dtype=torch.bfloat16, device="meta")},
}


def _pools_of(kwargs: dict[str, Any]) -> list[Pool]:
    pools: list[Pool] = []
    for name in ("k_pool", "v_pool"):
        pool = kwargs[name]
        if isinstance(pool, Tensor):
            if pool.device.type != "meta":
                pools.append(pool)
        elif isinstance(pool, (list, tuple)):
            pools.append([t for t in pool if isinstance(t, Tensor)])
    return pools


@pytest.mark.parametrize("mode", ["debug", pytest.param("production", marks=pytest.mark.production)])
@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_rejected_before_writing(case: str, mode: str) -> None:
    """Each misuse raises InputError in both modes, and no pool byte changes."""
    assert typedkv.debug_enabled() == (mode == "debug")
    inp = make_inputs(T, L, H, D, 16, torch.bfloat16, seed=_seed(case))
    kwargs: dict[str, Any] = {"cache_loc": torch.tensor([3, -1, 0, 5]), "k_pool": _pool(), "v_pool": _pool()}
    kwargs.update(MISUSE[case]())
    pools = _pools_of(kwargs)
    before = _snapshot(pools)
    with pytest.raises(typedkv.InputError):
        inp.into_pool(kwargs.pop("cache_loc"), kwargs.pop("k_pool"), kwargs.pop("v_pool"), **kwargs)
    _assert_unchanged(pools, before)


@pytest.mark.parametrize("mode", ["debug", pytest.param("production", marks=pytest.mark.production)])
def test_engine_pool_halves_of_one_allocation_are_fine(mode: str) -> None:
    """K and V as the two halves of one buffer (the usual engine pool) are not 'the same tensor'."""
    inp = make_inputs(T, L, H, D, 16, torch.bfloat16, seed=5)
    run_pool(inp, torch.tensor([3, -1, 0, 5]), LAYOUTS["stacked"], torch.bfloat16, S).check()


@pytest.mark.parametrize("mode", ["debug", pytest.param("production", marks=pytest.mark.production)])
@pytest.mark.parametrize("kind", ["stacked", "list"])
def test_aliasing_rejected_after_a_good_call_with_the_same_layout(kind: str, mode: str) -> None:
    """Checks cached per layout must not skip the per-call check that K and V pools are apart."""
    inp = make_inputs(T, L, H, D, 16, torch.bfloat16, seed=_seed("alias", kind))
    cache_loc = torch.tensor([3, -1, 0, 5])

    def pools() -> tuple[Pool, Pool]:
        k, v = _pool(), _pool()
        return (k, v) if kind == "stacked" else (list(k), list(v))

    inp.into_pool(cache_loc, *pools())
    k_pool, _ = pools()
    v_pool: Pool = k_pool if kind == "stacked" else list(k_pool)
    before = _snapshot([k_pool])
    expected = r"^v_pool: expected memory apart from k_pool" if kind == "stacked" else r"^v_pool\[0\]: expected memory"
    with pytest.raises(typedkv.InputError, match=expected):
        inp.into_pool(cache_loc, k_pool, v_pool)
    _assert_unchanged([k_pool], before)


def test_repeated_layout_uses_each_calls_values() -> None:
    """Same shapes, strides and dtypes twice: the second call's tensors, eps and scales are the ones used."""
    first = make_inputs(5, 2, 2, 16, 16, torch.float16, seed=31)
    second = make_inputs(5, 2, 2, 16, 16, torch.float16, seed=32)
    second = Inputs(second.kv, second.k_norm_weight, 0.25, second.cos_sin_cache, second.positions, 2, second.rope_style)
    for inp, k_scale, v_scale, loc in ((first, 0.5, 3.0, [0, 1, 2, 3, 4]), (second, 2.0, 0.125, [6, -1, 5, 4, 7])):
        cache_loc = torch.tensor(loc)
        run_pool(inp, cache_loc, LAYOUTS["stacked"], torch.float8_e5m2, 8, k_scale=k_scale, v_scale=v_scale).check()
        # Per-layer pools on 16 bytes, then off them, then on again: one layout (shapes and strides),
        # two launches (whole-vector stores need every layer on 16 bytes).
        for layout in ("list_views", "list_unaligned", "list_views"):
            run_pool(inp, cache_loc, LAYOUTS[layout], torch.float16, 8).check()
        # [L] scales (the kernel's scale argument a tuple holding the tensor): refilled on each call too.
        scales = torch.tensor([k_scale, 1.0]), torch.tensor([v_scale, 0.25])
        run_pool(
            inp, cache_loc, LAYOUTS["stacked"], torch.float8_e4m3fn, 8, k_scale=scales[0], v_scale=scales[1]
        ).check()


# --------------------------------------------------------------------------- paged misuse


def _paged_pair(layers: int = 2, pages: int = 3, heads: int = 2, head_dim: int = 16) -> tuple[Tensor, Tensor]:
    pools = torch.empty(2, layers, pages, PAGE, heads, head_dim, dtype=torch.bfloat16)
    pools.view(torch.uint8).fill_(SENTINEL)
    return pools[0], pools[1]


def _misuse_cases() -> dict[str, tuple[Callable[[], tuple[Any, Any, dict[str, Any]]], str]]:
    k, v = _paged_pair()
    return {
        "v-other-N": (
            lambda: (k, _paged_pair(pages=4)[1], {}),
            "v_pool: expected shape (L=2, N=3, B=4, H=2, D=16), got (2, 4, 4, 2, 16): N=3 comes from k_pool",
        ),
        "v-other-B": (
            lambda: (k, v.flatten(1, 2).unflatten(1, (6, 2)), {}),
            "v_pool: expected shape (L=2, N=3, B=4, H=2, D=16), got (2, 6, 2, 2, 16): N=3 comes from k_pool; "
            "B=4 comes from k_pool",
        ),
        "hnd-without-pages": (
            lambda: (k.flatten(1, 2), v.flatten(1, 2), {"kv_layout": "HND"}),
            "k_pool: expected shape (L=2, N, H=2, B, D=16) for kv_layout='HND', got (2, 12, 2, 16): "
            "kv_layout='NHD' takes a tensor of 4 dims",
        ),
        "unknown-layout": (lambda: (k, v, {"kv_layout": "NDH"}), "kv_layout: expected 'NHD' or 'HND', got 'NDH'"),
        "paged-and-flat": (
            lambda: (k, v.flatten(1, 2), {}),
            "v_pool: expected k_pool's layout [L, N, B, H, D], got [L, S, H, D]: K and V pools are paged alike",
        ),
        "paged-and-list": (
            lambda: (k, list(v), {}),
            "v_pool: expected the same layout as k_pool (a stacked tensor), got list",
        ),
        "list-hnd-of-nhd-rank": (
            lambda: (list(k.flatten(1, 2)), list(v.flatten(1, 2)), {"kv_layout": "HND"}),
            "k_pool[0]: expected shape (N, H=2, B, D=16) for kv_layout='HND', got (12, 2, 16): "
            "kv_layout='NHD' takes a tensor of 3 dims",
        ),
    }


@pytest.mark.parametrize("mode", ["production", "debug"])
@pytest.mark.parametrize("case", list(_misuse_cases()))
def test_paged_misuse_rejected_before_writing(case: str, mode: str) -> None:
    """Pools that disagree on N or B, layouts without pages, unknown or mixed layouts: InputError, nothing written."""
    typedkv.set_debug(mode == "debug")
    make, message = _misuse_cases()[case]
    k_pool, v_pool, extra = make()
    inp = make_inputs(5, 2, seed=_seed("paged-misuse", case))
    before = _snapshot([k_pool, v_pool])
    with pytest.raises(typedkv.InputError) as info:
        inp.into_pool(torch.tensor([0, 5, -1, 11, 3]), k_pool, v_pool, **extra)
    assert str(info.value) == message
    _assert_unchanged([k_pool, v_pool], before)


@pytest.mark.parametrize("mode", ["production", "debug"])
@pytest.mark.parametrize("layout", list(PAGED_LAYOUTS))
def test_heads_equal_to_page_size_need_kv_layout(layout: str, mode: str) -> None:
    """H == B: a paged pool reads as NHD and as HND. Without kv_layout: InputError, nothing written; with it: its rows."""
    typedkv.set_debug(mode == "debug")
    spec = PAGED_LAYOUTS[layout]
    inp = make_inputs(6, 2, PAGE, 16, 16, torch.bfloat16, seed=_seed("heads-equal-page", layout))
    cache_loc = slots_for(6, 11, seed=_seed("heads-equal-page", layout, "slots"))
    bases = spec.alloc(2, 11, PAGE, 16, torch.bfloat16)
    for base in bases:
        base.view(torch.uint8).fill_(SENTINEL)
    k_pool, v_pool = spec.view(bases, PAGE, 16)
    before = _snapshot(bases)
    label = "k_pool" if isinstance(k_pool, Tensor) else "k_pool[0]"
    shape = tuple((k_pool if isinstance(k_pool, Tensor) else k_pool[0]).shape)
    with pytest.raises(typedkv.InputError) as info:
        inp.into_pool(cache_loc, k_pool, v_pool)
    dims = "[L, N, B, H, D]" if label == "k_pool" else "[N, B, H, D]"
    hnd = "[L, N, H, B, D]" if label == "k_pool" else "[N, H, B, D]"
    assert str(info.value) == (
        f"kv_layout: expected 'NHD' or 'HND' for {label} of shape {shape}, got None: with H=4 heads and pages of 4 "
        f"slots it reads as kv_layout='NHD' {dims} or kv_layout='HND' {hnd}; pass the layout the cache was "
        "allocated with"
    )
    _assert_unchanged(bases, before)
    run_pool(inp, cache_loc, spec, torch.bfloat16, 11).check()


@pytest.mark.parametrize("mode", ["production", "debug"])
@pytest.mark.parametrize("layout", list(PAGED_LAYOUTS))
def test_paged_pool_without_kv_layout(layout: str, mode: str) -> None:
    """kv_layout omitted, H != B: an NHD pool is written as NHD; an HND pool is refused, naming kv_layout='HND'."""
    typedkv.set_debug(mode == "debug")
    spec = PAGED_LAYOUTS[layout]
    inp = make_inputs(6, 2, 2, 16, 16, torch.bfloat16, seed=_seed("no-kv-layout", layout))
    cache_loc = slots_for(6, 11, seed=_seed("no-kv-layout", layout, "slots"))
    if spec.kv_layout == "NHD":
        run_pool(inp, cache_loc, dataclasses.replace(spec, kv_layout=None), torch.bfloat16, 11).check()  # type: ignore[arg-type]
        return
    bases = spec.alloc(2, 11, 2, 16, torch.bfloat16)
    k_pool, v_pool = spec.view(bases, 2, 16)
    before = _snapshot(bases)
    with pytest.raises(typedkv.InputError, match=r"that is an HND pool \[(L, )?N, H, B, D\]: pass kv_layout='HND'$"):
        inp.into_pool(cache_loc, k_pool, v_pool)
    _assert_unchanged(bases, before)


@pytest.mark.parametrize("layout", ["paged_nhd_combined", "flashinfer_nhd", "vllm_flash_attn"])
def test_combined_cache_passed_whole_gets_its_halves(layout: str) -> None:
    """A combined K/V cache passed as the pool: the message names the views of its halves."""
    spec = PAGED_LAYOUTS[layout]
    inp = make_inputs(6, 2, 2, 16, 16, torch.bfloat16, seed=_seed("combined-whole", layout))
    bases = spec.alloc(2, 11, 2, 16, torch.bfloat16)
    whole: Pool = bases[0] if len(bases) == 1 else bases
    halves = {
        "paged_nhd_combined": "k_pool=cache[:, :, 0] and v_pool=cache[:, :, 1]",
        "flashinfer_nhd": "k_pool=[c[:, 0] for c in caches] and v_pool=[c[:, 1] for c in caches]",
        "vllm_flash_attn": "k_pool=[c[0] for c in caches] and v_pool=[c[1] for c in caches]",
    }[layout]
    with pytest.raises(typedkv.InputError) as info:
        inp.into_pool(torch.arange(6), whole, whole)
    assert str(info.value).endswith(f"? pass its halves, {halves} (views: written in place)"), str(info.value)


@pytest.mark.parametrize("layout", ["paged_hnd", "flashinfer_nhd"])
def test_debug_rejects_slot_past_the_pages(layout: str) -> None:
    """N*B slots: slot N*B is past the end (debug raises; production skips it, as for S)."""
    inp = make_inputs(3, 2, seed=9)
    bases = LAYOUTS[layout].alloc(2, 3 * PAGE, 2, 16, torch.bfloat16)
    k_pool, v_pool = LAYOUTS[layout].view(bases, 2, 16)
    with pytest.raises(
        typedkv.InputError, match=r"^cache_loc: expected slots below S=12 \(or negative to skip\), got 12"
    ):
        inp.into_pool(torch.tensor([0, 12, 3]), k_pool, v_pool, kv_layout=LAYOUTS[layout].kv_layout)


@pytest.mark.production
@pytest.mark.parametrize("layout", ["paged_hnd_combined", "vllm_flash_attn"])
def test_production_skips_slots_past_the_pages(layout: str) -> None:
    inp = make_inputs(5, 2, seed=_seed("past-pages", layout))
    run = run_pool(inp, torch.tensor([11, 12, 0, 2**40, 7]), LAYOUTS[layout], torch.bfloat16, 12)
    assert run.kept.tolist() == [0, 2, 4]
    run.check()


def test_empty_per_layer_pools_share_no_memory() -> None:
    """Per-layer pools of zero slots all report address 0: that is not one tensor passed twice."""
    num_layers, heads, dim, tokens = 2, 2, 16, 3
    kv = torch.randn(tokens, num_layers, 2 * heads * dim)
    k_pool = [torch.empty(0, heads, dim) for _ in range(num_layers)]
    v_pool = [torch.empty(0, heads, dim) for _ in range(num_layers)]
    assert {t.data_ptr() for t in (*k_pool, *v_pool)} == {0}
    typedkv.materialize_kv_into_pool(
        kv, torch.ones(num_layers, dim), 1e-6, torch.randn(8, dim), torch.arange(tokens),
        torch.full((tokens,), -1), k_pool, v_pool, num_kv_heads=heads,
    )  # fmt: skip


def test_mla_empty_per_layer_pools_share_no_memory() -> None:
    """The same for MLA pools."""
    num_layers, latent, rotary, tokens = 2, 32, 16, 3
    ckv = torch.randn(tokens, num_layers, latent + rotary)
    kv_pool = [torch.empty(0, latent + rotary) for _ in range(num_layers)]
    typedkv.materialize_mla_kv_into_pool(
        ckv, torch.ones(num_layers, latent), 1e-6, torch.randn(8, rotary), torch.arange(tokens),
        torch.full((tokens,), -1), kv_pool, rope_style="gptj",
    )  # fmt: skip
