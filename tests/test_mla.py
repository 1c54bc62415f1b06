"""MLA drafts: ``typedkv.materialize_mla_kv`` and ``typedkv.materialize_mla_kv_into_pool``.

Numerics against the independent float64 oracle (tests/reference64.py); pools
poisoned over their whole allocation and compared bit for bit with the dense
op's rows put in by torch indexing, so a stray write anywhere fails. The file
runs twice, as the rest of the suite: the PyTorch reference path, then the
Triton kernel under ``TRITON_INTERPRET=1`` (shapes stay small for it).

Tolerances follow tests/test_numerics.py: the normed latent is rounded to the
storage dtype by both the op (from a float32 norm) and the oracle (from the
exact one), so the two may land one ulp apart; the rope part is rounded once,
at the store. Per element ``|out - ref| <= ulps * eps * m`` with ``m`` the
element's size (a rotated pair's length for the rope part), ``ulps`` 2 for the
16-bit dtypes and 32 for float32 (whose error is the float32 math itself).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from reference64 import materialize_mla_kv64, rotation_pairs
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.core import launcher
from typedkv.mla import reference as mla_reference
from typedkv.tools import cases

INTERPRETED = launcher.INTERPRETED
STORAGE = (torch.bfloat16, torch.float16, torch.float32)
STYLES: tuple[RopeStyle, ...] = ("gptj", "neox")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ULPS = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 32.0}
SENTINEL = 0xA5  # a finite value in every pool dtype, never what the op writes here
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# Debug mode (the suite's default: full annotation checks) and production (the cheap check, cached plans).
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]

Pool = Tensor | Sequence[Tensor]


def _seed(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


@dataclass(frozen=True)
class Inputs:
    ckv: Tensor
    kv_norm_weight: Tensor | None
    eps: float | Sequence[float] | Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    rope_style: RopeStyle

    @property
    def shape(self) -> tuple[int, int, int]:
        tokens, layers, width = self.ckv.shape
        return int(tokens), int(layers), int(width)

    def dense(self, out: Tensor | None = None) -> Tensor:
        return typedkv.materialize_mla_kv(
            self.ckv, self.kv_norm_weight, self.eps, self.cos_sin_cache, self.positions,
            rope_style=self.rope_style, out=out,
        )  # fmt: skip

    def into_pool(
        self, cache_loc: Tensor, kv_pool: Pool, kv_scale: Any = None, cache_format: typedkv.CacheFormat = "plain"
    ) -> None:
        typedkv.materialize_mla_kv_into_pool(
            self.ckv, self.kv_norm_weight, self.eps, self.cos_sin_cache, self.positions, cache_loc, kv_pool,
            rope_style=self.rope_style, kv_scale=kv_scale, cache_format=cache_format,
        )  # fmt: skip

    def cpu(self) -> Inputs:
        return self.to("cpu")

    def to(self, device: str) -> Inputs:
        eps = self.eps.to(device) if isinstance(self.eps, Tensor) else self.eps
        weight = None if self.kv_norm_weight is None else self.kv_norm_weight.to(device)
        return Inputs(
            self.ckv.to(device), weight, eps, self.cos_sin_cache.to(device), self.positions.to(device), self.rope_style
        )

    def rows_float32(self) -> Tensor:
        """The rows before the store's rounding: what an FP8 pool quantizes."""
        eps = self.eps if isinstance(self.eps, (float, Tensor)) else torch.tensor(self.eps)
        inputs = (self.kv_norm_weight, eps, self.cos_sin_cache, self.positions)
        return mla_reference.mla_rows(self.ckv, inputs, self.rope_style == "neox")


def make_inputs(
    num_tokens: int = 6,
    num_layers: int = 2,
    kv_lora_rank: int = 32,
    rotary_dim: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    rope_style: RopeStyle = "gptj",
    *,
    norm: bool = True,
    per_layer_eps: bool = False,
    num_positions: int = 40,
    device: str = "cpu",
) -> Inputs:
    g = torch.Generator().manual_seed(_seed(num_tokens, num_layers, kv_lora_rank, rotary_dim, dtype, rope_style))
    ckv = (torch.randn(num_tokens, num_layers, kv_lora_rank + rotary_dim, generator=g) * 3).to(dtype)
    weight = torch.rand(num_layers, kv_lora_rank, generator=g) + 0.5 if norm else None
    angles = torch.rand(num_positions, rotary_dim // 2, generator=g) * 6.2
    eps: float | Tensor = torch.linspace(1e-6, 1e-2, num_layers) if per_layer_eps else 1e-6
    return Inputs(
        ckv.to(device),
        None if weight is None else weight.to(device),
        eps.to(device) if isinstance(eps, Tensor) else eps,
        torch.cat((angles.cos(), angles.sin()), dim=-1).to(device),
        torch.randint(0, num_positions, (num_tokens,), generator=g).to(device),
        rope_style,
    )


def assert_close_to_oracle(out: Tensor, inputs: Inputs) -> None:
    out, inputs = out.cpu(), inputs.cpu()
    ref = materialize_mla_kv64(
        inputs.ckv, inputs.kv_norm_weight, inputs.eps, inputs.cos_sin_cache, inputs.positions, inputs.rope_style
    )
    rotary_dim = inputs.cos_sin_cache.shape[-1]
    latent_dim = ref.shape[-1] - rotary_dim
    size = ref.abs()
    # A rotated pair keeps its length: each element's error scales with the pair's.
    first, second = (i + latent_dim for i in rotation_pairs(rotary_dim, inputs.rope_style))
    pair = torch.hypot(ref[..., first], ref[..., second])
    size[..., first] = pair
    size[..., second] = pair
    dtype = inputs.ckv.dtype
    tiny = torch.finfo(dtype).tiny if dtype != torch.float16 else 2**-23
    bound = ULPS[dtype] * torch.finfo(dtype).eps * size + 2 * tiny
    err = (out.double() - ref).abs()
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isnan(out).equal(torch.isnan(ref))
    if not ref.numel():
        return
    worst = torch.where(torch.isnan(ref), 0.0, err - bound).max()
    assert worst <= 0, f"an element is off by {worst:.3g} more than its bound"


# ----------------------------------------------------------------- dense numerics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize(("kv_lora_rank", "rotary_dim"), [(32, 16), (96, 64), (512, 64)])
def test_matches_float64(
    dtype: torch.dtype, rope_style: RopeStyle, kv_lora_rank: int, rotary_dim: int, mode: str
) -> None:
    inputs = make_inputs(5, 2, kv_lora_rank, rotary_dim, dtype, rope_style)
    assert_close_to_oracle(inputs.dense(), inputs)


@pytest.mark.parametrize("rope_style", STYLES)
def test_per_layer_eps(rope_style: RopeStyle) -> None:
    inputs = make_inputs(4, 3, 32, 16, torch.float32, rope_style, per_layer_eps=True)
    # Tiny latents: eps decides the scale, so a wrong layer's eps shows.
    inputs = Inputs(inputs.ckv * 1e-2, *list(inputs.__dict__.values())[1:])
    assert_close_to_oracle(inputs.dense(), inputs)


@pytest.mark.parametrize("pool", [False, True])
def test_eps_as_a_sequence_of_layer_numbers(pool: bool) -> None:
    """eps as L Python numbers writes what the same values as an [L] tensor write."""
    inputs = make_inputs(4, 3, 32, 16, torch.float32, "neox", per_layer_eps=True)
    inputs = Inputs(inputs.ckv * 1e-2, *list(inputs.__dict__.values())[1:])
    assert isinstance(inputs.eps, Tensor)
    as_list = Inputs(inputs.ckv, inputs.kv_norm_weight, inputs.eps.tolist(), *list(inputs.__dict__.values())[3:])
    if not pool:
        assert torch.equal(as_list.dense(), inputs.dense())
        return
    got, want = torch.zeros(3, 6, 48), torch.zeros(3, 6, 48)
    as_list.into_pool(torch.arange(4), got)
    inputs.into_pool(torch.arange(4), want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("rope_style", STYLES)
def test_without_norm_the_latent_passes_bit_for_bit(dtype: torch.dtype, rope_style: RopeStyle) -> None:
    inputs = make_inputs(5, 2, 96, 64, dtype, rope_style, norm=False)
    ckv = inputs.ckv.clone()
    ckv[0, 0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40 if dtype == torch.float32 else 1e-7])
    inputs = Inputs(ckv, None, inputs.eps, inputs.cos_sin_cache, inputs.positions, rope_style)
    out = inputs.dense()
    latent = ckv.transpose(0, 1)[..., :96]
    bits = _BITS[dtype.itemsize]
    assert out[..., :96].view(bits).equal(latent.contiguous().view(bits))
    clean = Inputs(ckv.clone(), None, inputs.eps, inputs.cos_sin_cache, inputs.positions, rope_style)
    clean.ckv[0, 0, :4] = 1.0
    assert_close_to_oracle(clean.dense(), clean)


def test_normed_latent_is_rounded_to_the_storage_dtype() -> None:
    """The latent of a bfloat16 ckv is what bfloat16 can hold, and the oracle's value to one ulp."""
    inputs = make_inputs(5, 2, 512, 64, torch.bfloat16)
    out = inputs.dense()
    ref = materialize_mla_kv64(
        inputs.ckv, inputs.kv_norm_weight, inputs.eps, inputs.cos_sin_cache, inputs.positions, "gptj"
    )
    latent, exact = out[..., :512].double(), ref[..., :512]
    assert ((latent - exact).abs() <= torch.finfo(torch.bfloat16).eps * exact.abs()).all()
    # At least most of them exactly the oracle's rounding (which the op shares but for float32's norm).
    assert (latent == exact).float().mean() > 0.95


def test_position_outside_the_cache_gives_nan_in_the_rope_part_only() -> None:
    inputs = make_inputs(4, 2, 32, 16, torch.float32, norm=False)
    positions = torch.tensor([0, 40, -1, 3])
    inputs = Inputs(inputs.ckv, None, inputs.eps, inputs.cos_sin_cache, positions, "gptj")
    typedkv.set_debug(False)
    out = inputs.dense()
    assert out[:, [1, 2], 32:].isnan().all() and not out[:, [0, 3]].isnan().any()
    assert out[..., :32].equal(inputs.ckv.transpose(0, 1)[..., :32])


def test_given_out_is_written_and_returned() -> None:
    inputs = make_inputs()
    t, layers, width = inputs.shape
    slab = torch.full((layers, t + 3, width), 7.0, dtype=inputs.ckv.dtype)
    out = inputs.dense(slab[:, :t])
    assert out.data_ptr() == slab.data_ptr()
    assert slab[:, :t].equal(inputs.dense())
    assert (slab[:, t:] == 7.0).all()


def test_strided_ckv() -> None:
    inputs = make_inputs(5, 2, 32, 16, torch.float16)
    wide = torch.zeros(5, 3, 64, dtype=torch.float16)
    wide[:, :2, :48] = inputs.ckv
    strided = Inputs(wide[:, :2, :48], *list(inputs.__dict__.values())[1:])
    assert strided.dense().equal(inputs.dense())


@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_token_counts(num_tokens: int) -> None:
    inputs = make_inputs(num_tokens, 3, 512, 64, torch.float16, "neox")
    out = inputs.dense()
    assert out.shape == (3, num_tokens, 576)
    if num_tokens:
        assert_close_to_oracle(out, inputs)


def test_zero_width_latent() -> None:
    """Without a norm C is ckv's width minus R, which may be 0: the whole row is the rope part."""
    inputs = make_inputs(3, 2, 0, 16, torch.float32, norm=False)
    assert_close_to_oracle(inputs.dense(), inputs)


# --------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class Layout:
    """How a pool is carved out of its allocation: ``make(base, layers, slots, width)``."""

    make: Callable[[Tensor, int, int, int], Pool]
    base: Callable[[int, int, int], tuple[int, ...]]
    page: int = 1


PAGE = 4


def _pages(slots: int) -> int:
    return -(-slots // PAGE)


LAYOUTS = {
    # vLLM-style stacked slab [L, S, C+R]
    "stacked": Layout(lambda b, n, s, w: b, lambda n, s, w: (n, s, w)),
    # rows padded past C+R, and the layers of a larger cache
    "stacked_padded": Layout(lambda b, n, s, w: b[1 : n + 1, :, :w], lambda n, s, w: (n + 2, s, w + 8)),
    "stacked_paged": Layout(lambda b, n, s, w: b, lambda n, s, w: (n, _pages(s), PAGE, w), PAGE),
    # vLLM per layer: [num_blocks, block_size, C+R], views of one buffer
    "vllm": Layout(lambda b, n, s, w: list(b.unbind(0)), lambda n, s, w: (n, _pages(s), PAGE, w), PAGE),
    # sglang per layer: [size, 1, C+R]; layers in reverse order of memory
    "sglang": Layout(lambda b, n, s, w: list(b.unbind(0))[::-1], lambda n, s, w: (n, s, 1, w)),
    "flat_list": Layout(lambda b, n, s, w: list(b[:, :, 2 : 2 + w].unbind(0)), lambda n, s, w: (n, s, w + 4)),
    # contiguous [S, C+R] layers, one after another
    "contiguous_list": Layout(lambda b, n, s, w: list(b.unbind(0)), lambda n, s, w: (n, s, w)),
    # the same, one element into the buffer: no layer is 16-byte aligned (a launch of its own, not vectorised)
    "unaligned_list": Layout(
        lambda b, n, s, w: list(b[1 : 1 + n * s * w].view(n, s, w).unbind(0)), lambda n, s, w: (n * s * w + 8,)
    ),
}


def _bits(t: Tensor) -> Tensor:
    return t.view(_BITS[t.element_size()])


def _pool_rows(pool: Pool, layer: int, slots: int) -> Tensor:
    """Layer ``layer``'s ``[S, C+R]`` rows as a view (pages flattened)."""
    t = pool[layer]
    return t.reshape(-1, t.shape[-1])[:slots] if t.dim() == 3 else t


def run_pool(
    inputs: Inputs,
    layout: str,
    cache_loc: Tensor,
    num_slots: int,
    pool_dtype: torch.dtype | None = None,
    kv_scale: Any = None,
) -> None:
    """Poison ``layout``'s allocation, run the op into it, compare every byte with the oracle's."""
    _, layers, width = inputs.shape
    spec = LAYOUTS[layout]
    dtype = pool_dtype or inputs.ckv.dtype
    base = torch.full(spec.base(layers, num_slots, width), 0.0, device=inputs.ckv.device).to(dtype)
    _bits(base).fill_(SENTINEL if dtype.itemsize == 1 else int.from_bytes([SENTINEL] * dtype.itemsize, "little") >> 1)
    pool = spec.make(base, layers, num_slots, width)
    expected_base = base.clone()
    expected_pool = spec.make(expected_base, layers, num_slots, width)
    if dtype.itemsize == 1:
        scale = (
            kv_scale if isinstance(kv_scale, Tensor) else torch.tensor([kv_scale or 1.0] * layers, device=base.device)
        )
        limit = torch.finfo(dtype).max
        rows = (inputs.rows_float32() * scale.float().reciprocal().view(-1, 1, 1)).clamp(-limit, limit).to(dtype)
    else:
        rows = inputs.dense()
    keep = (cache_loc >= 0) & (cache_loc < num_slots)
    for layer in range(layers):
        target = _pool_rows(expected_pool, layer, num_slots)
        target[cache_loc[keep].long()] = rows[layer][keep]
    inputs.into_pool(cache_loc, pool, kv_scale)
    assert _bits(base).equal(_bits(expected_base))


def _slots(num_tokens: int, num_slots: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_slots, generator=g)[:num_tokens]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rope_style", STYLES)
def test_pool_layouts(layout: str, rope_style: RopeStyle, mode: str) -> None:
    inputs = make_inputs(6, 3, 32, 16, torch.bfloat16, rope_style)
    cache_loc = _slots(6, 13, _seed(layout, rope_style))
    cache_loc[2] = -1
    run_pool(inputs, layout, cache_loc, 13)


@pytest.mark.parametrize("layout", ["stacked_paged", "sglang"])
def test_pool_deepseek_geometry(layout: str) -> None:
    inputs = make_inputs(5, 2, 512, 64, torch.bfloat16, "gptj")
    run_pool(inputs, layout, _slots(5, 9, 1), 9)


@pytest.mark.parametrize("pool_dtype", FP8)
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
@pytest.mark.parametrize("norm", [True, False])
def test_fp8_pools(pool_dtype: torch.dtype, scale: str, norm: bool) -> None:
    inputs = make_inputs(6, 3, 32, 16, torch.bfloat16, "neox", norm=norm)
    kv_scale = {"none": None, "float": 0.25, "tensor": torch.tensor([0.5, 2.0, 0.01])}[scale]
    run_pool(inputs, "vllm", _slots(6, 11, 2), 11, pool_dtype, kv_scale)


def test_fp8_saturates() -> None:
    inputs = make_inputs(4, 2, 32, 16, torch.float32, norm=False)
    pool = torch.zeros(2, 4, 48, dtype=torch.float8_e4m3fn)
    inputs.into_pool(torch.arange(4), pool, kv_scale=1e-6)
    values = pool.float()
    assert values.abs().max() == 448 and not values.isnan().any()
    assert (values[..., :32].abs() == 448).float().mean() > 0.9


def test_uint8_pool_may_be_viewed_as_fp8() -> None:
    inputs = make_inputs(4, 2, 32, 16, torch.bfloat16)
    raw = torch.zeros(2, 8, 48, dtype=torch.uint8)
    inputs.into_pool(torch.arange(4), raw.view(torch.float8_e4m3fn), kv_scale=0.5)
    assert raw[:, :4].any() and not raw[:, 4:].any()


@pytest.mark.production
@pytest.mark.parametrize("layout", ["stacked", "vllm"])
def test_production_skips_slots_past_the_pool(layout: str) -> None:
    inputs = make_inputs(5, 2)
    run_pool(inputs, layout, torch.tensor([3, 12, -5, 100, 0], dtype=torch.int32), 12)


@pytest.mark.parametrize(
    ("cache_loc", "message"),
    [
        ([3, 12, 0], "cache_loc: expected slots below S=12 (or negative to skip), got 12 at token 1"),
        (
            [3, 5, 3],
            "cache_loc: expected distinct slots, got slot 3 for tokens [0, 2]: two tokens written to one slot race",
        ),
    ],
)
def test_debug_rejects_bad_slots(cache_loc: list[int], message: str) -> None:
    inputs = make_inputs(3, 2)
    pool = torch.zeros(2, 3, 4, 48, dtype=torch.bfloat16)
    with pytest.raises(typedkv.InputError) as err:
        inputs.into_pool(torch.tensor(cache_loc), pool)
    assert str(err.value) == message
    assert not pool.any()


def test_all_slots_negative_writes_nothing() -> None:
    inputs = make_inputs(4, 2)
    run_pool(inputs, "sglang", torch.full((4,), -1), 7)


def test_per_layer_eps_into_pool() -> None:
    inputs = make_inputs(4, 3, 32, 16, torch.float32, "gptj", per_layer_eps=True)
    run_pool(inputs, "flat_list", _slots(4, 6, 3), 6)


def test_layout_change_between_calls() -> None:
    """One plan per layout: a second layout, then the first again, each written right."""
    inputs = make_inputs(4, 2)
    for layout in ("stacked", "vllm", "stacked", "sglang", "vllm"):
        run_pool(inputs, layout, _slots(4, 9, 4), 9)


@pytest.mark.parametrize("mode", MODES)
def test_layer_alignment_changes_between_calls(mode: str) -> None:
    """Per-layer pools of one layout, 16-byte aligned or not, call after call: the cached launch
    assumes aligned layers, so a call whose layers are not takes a launch of its own."""
    inputs = make_inputs(5, 3, 32, 16, torch.bfloat16)
    for layout in ("contiguous_list", "unaligned_list", "contiguous_list", "unaligned_list"):
        run_pool(inputs, layout, _slots(5, 9, 5), 9)


@pytest.mark.parametrize(
    "name", [c.name for c in cases.GPU_CASES if c.kv_lora_rank and c.pool not in ("fp8", "fp8_ds_mla")]
)
def test_bench_cases_match_their_eager_baseline(name: str) -> None:
    """`typedkv bench --only MLA` times what it claims: its typedkv call writes what the eager baseline writes."""
    case = next(c for c in cases.GPU_CASES if c.name == name)
    x = cases.make_inputs(case, 8, torch.device("cpu"))
    cases.typedkv_call(case, x)()
    target = x.k_pool.view(case.num_layers, -1, x.k_pool.shape[-1])[:, x.slots] if case.pool else x.k_out
    got = target.clone()
    cases.eager_call(case, x)()
    target = x.k_pool.view(case.num_layers, -1, x.k_pool.shape[-1])[:, x.slots] if case.pool else x.k_out
    # The kernel's float32 norm may round one ulp away from PyTorch's (under TRITON_INTERPRET=1).
    got, want = got.float(), target.float()
    assert ((got - want).abs() <= torch.finfo(case.dtype).eps * want.abs()).all()
