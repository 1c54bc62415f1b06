"""DeepSeek's FP8 MLA rows: ``materialize_mla_kv_into_pool(..., cache_format="fp8_ds_mla")``.

A row is 656 bytes: the latent's 512 values in ``float8_e4m3fn``, 4 float32 scales (one per 128
values), the rope part's 64 values in bfloat16. typedkv's bytes are checked against

- vLLM's own PyTorch reference for this format, transcribed below (`vllm_ds_mla_rows`), fed
  with the rows `typedkv.materialize_mla_kv` computes (a bfloat16 ckv: vLLM's op takes the
  normed latent and the rotated rope part in the model's 16-bit dtype);
- the float64 oracle (tests/reference64.py), decoded (`assert_ds_rows_close_to_oracle`), for
  every storage dtype;
- typedkv's reference path, bit for bit (`typedkv.mla.reference.ds_mla_rows`): this file runs
  twice, as the rest of the suite, the second time with the Triton kernel under
  ``TRITON_INTERPRET=1``.

Pools are poisoned over their whole allocation (`SENTINEL`), so a byte written outside the
rows ``cache_loc`` names fails. Data: random rows whose 128-value tiles differ in magnitude by
up to eight orders, with an all-zero tile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from reference64 import materialize_mla_kv64, rotation_pairs
from test_mla import SENTINEL, STYLES, Inputs, Layout, Pool, _pages, _pool_rows, _seed, _slots
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.mla import reference as mla_reference

C, R, ROW = 512, 64, 656
TILE = 128
FLT_MIN = torch.finfo(torch.float32).tiny
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]
PAGE = 4


def vllm_ds_mla_rows(kv_c: Tensor, k_pe: Tensor) -> Tensor:
    """vLLM's reference of its ``fp8_ds_mla`` cache entries, ``[T, 656]`` bytes, from ``kv_c`` ``[T, 512]`` and
    ``k_pe`` ``[T, 64]`` (16-bit).

    Transcribed from ``test_concat_and_cache_ds_mla`` in vLLM's tests/kernels/attention/test_cache.py
    (vllm-project/vllm, commit 00228592456192abf9bea6f7ac937fa367f007a3), which checks vLLM's CUDA op
    ``concat_and_cache_mla(..., kv_cache_dtype="fp8_ds_mla")`` against it. Per token and 128-value tile of
    ``kv_c``: ``tile_scale = max(|tile| as float32) / 448.0`` (vLLM takes the maximum in a Python loop, noting
    that ``tile.amax()`` differs: it has no absolute value), stored as float32 at float index
    ``kv_lora_rank // 4 + tile``; the tile's bytes ``ops.convert_fp8(tile, tile_scale, kv_dtype="fp8")``, vLLM's
    ``scaled_convert``, ``__nv_cvt_float_to_fp8(float(x) / scale, __NV_SATFINITE, E4M3)``: written here as
    ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``; ``k_pe`` at 16-bit index
    ``kv_lora_rank // 2 + 8``.

    One line more than the test: vLLM's kernel (``concat_and_cache_ds_mla_kernel``, csrc/cache_kernels.cu)
    floors the scale, ``tile_scale = fmaxf(tile_scale, FLT_MIN)``, which the test's random data never reaches;
    without it an all-zero tile would divide 0 by 0.
    """
    num_tokens, kv_lora_rank = kv_c.shape
    entries = torch.zeros(num_tokens, kv_lora_rank + 4 * 4 + 2 * k_pe.shape[1], dtype=torch.uint8)
    for i in range(num_tokens):
        entry = entries[i]
        entry_16bit = entry.view(kv_c.dtype)
        entry_32bit = entry.view(torch.float32)
        for tile_idx in range(kv_lora_rank // TILE):
            tile_start, tile_end = tile_idx * TILE, (tile_idx + 1) * TILE
            tile_data = kv_c[i, tile_start:tile_end]
            tile_scale = tile_data.to(torch.float32).abs().max() / 448.0
            tile_scale = torch.clamp_min(tile_scale, FLT_MIN)  # the kernel's fmaxf(tile_scale, FLT_MIN)
            entry_32bit[kv_lora_rank // 4 + tile_idx] = tile_scale
            quantized = (tile_data.to(torch.float32) / tile_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            entry[tile_start:tile_end] = quantized.view(torch.uint8)
        for j in range(k_pe.shape[1]):
            entry_16bit[kv_lora_rank // 2 + 8 + j] = k_pe[i, j]
    return entries


def vllm_rows_of(inputs: Inputs) -> Tensor:
    """``[L, T, 656]`` (on the CPU): vLLM's entries of the rows `typedkv.materialize_mla_kv` gives on the inputs'
    device (a bfloat16 ckv)."""
    assert inputs.ckv.dtype == torch.bfloat16, "vLLM's fp8_ds_mla takes bfloat16 rows"
    dense = inputs.dense().cpu()
    return torch.stack([vllm_ds_mla_rows(layer[:, :C], layer[:, C:]) for layer in dense])


def ds_inputs(
    num_tokens: int = 6,
    num_layers: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    rope_style: RopeStyle = "gptj",
    *,
    norm: bool = True,
    num_positions: int = 40,
    device: str = "cpu",
) -> Inputs:
    """Random rows whose tiles differ in magnitude (1e-4 to 1e4 before a norm: float16 holds them), token 1's tile
    1 all zero."""
    g = torch.Generator().manual_seed(_seed("ds", num_tokens, num_layers, dtype, rope_style, norm))
    ckv = torch.randn(num_tokens, num_layers, C + R, generator=g)
    magnitudes = torch.tensor([1e-4, 1e-2, 1.0, 3e2, 1e4])
    pick = torch.randint(0, len(magnitudes), (num_tokens, num_layers, C // TILE), generator=g)
    ckv[..., :C] *= magnitudes[pick].repeat_interleave(TILE, dim=-1)
    if num_tokens > 1:
        ckv[1, :, TILE : 2 * TILE] = 0.0
    weight = torch.rand(num_layers, C, generator=g) * 4 + 0.25 if norm else None
    angles = torch.rand(num_positions, R // 2, generator=g) * 6.2
    return Inputs(
        ckv.to(dtype).to(device),
        None if weight is None else weight.to(device),
        torch.linspace(1e-6, 1e-3, num_layers).to(device),
        torch.cat((angles.cos(), angles.sin()), dim=-1).to(device),
        torch.randint(0, num_positions, (num_tokens,), generator=g).to(device),
        rope_style,
    )


def reference_rows(inputs: Inputs) -> Tensor:
    """``[L, T, 656]``: typedkv's reference path (`typedkv.mla.reference.ds_mla_rows`) on the CPU."""
    host = inputs.cpu()
    eps = host.eps if isinstance(host.eps, (float, Tensor)) else torch.tensor(host.eps)
    return mla_reference.ds_mla_rows(
        host.ckv, (host.kv_norm_weight, eps, host.cos_sin_cache, host.positions), host.rope_style == "neox"
    )


def decode(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(latent, scales, rope)`` of ``[.., 656]`` rows, in float64: the latent dequantized (value * its tile's scale)."""
    scales = rows[..., C : C + 16].contiguous().view(torch.float32).double()
    values = rows[..., :C].contiguous().view(torch.float8_e4m3fn).double()
    latent = values * scales.repeat_interleave(TILE, dim=-1)
    return latent, scales, rows[..., C + 16 :].contiguous().view(torch.bfloat16).double()


def assert_ds_rows_close_to_oracle(rows: Tensor, inputs: Inputs) -> None:
    """``rows`` (``[L, T, 656]``) against the float64 oracle: each tile's scale its bfloat16 amax over 448 (the
    smallest normal float32 for a zero tile), each latent value within an e4m3 rounding of the oracle's, the
    rope part within two bfloat16 ulps of its rotated pair's length (NaN where the oracle's is)."""
    host = inputs.cpu()
    ref = materialize_mla_kv64(
        host.ckv, host.kv_norm_weight, host.eps, host.cos_sin_cache, host.positions, host.rope_style
    )
    latent, scales, rope = decode(rows.cpu())
    ref_latent, ref_rope = ref[..., :C], ref[..., C:]
    tiles = ref_latent.unflatten(-1, (-1, TILE))
    amax = tiles.abs().amax(-1)
    bf16_eps = torch.finfo(torch.bfloat16).eps
    # The oracle rounds a normed latent to ckv's dtype (this format, to bfloat16): float16's subnormal spacing
    # on top of bfloat16's rounding.
    spacing = torch.finfo(host.ckv.dtype).tiny * torch.finfo(host.ckv.dtype).eps
    nonzero = amax > 0
    assert ((scales - amax / 448).abs() <= ((bf16_eps + 1e-6) * amax + spacing) / 448)[nonzero].all()
    assert (scales[~nonzero] == FLT_MIN).all()
    # e4m3 rounds to 3 mantissa bits (half a step: 2**-4 relative), after bfloat16's and the norm's roundings;
    # below e4m3's smallest normal (2**-6 of the scale) the grid is uniform, 2**-9 apart.
    tile_scales = scales.repeat_interleave(TILE, dim=-1)
    assert ((latent - ref_latent).abs() <= 0.07 * ref_latent.abs() + tile_scales * 2**-9 + spacing).all()
    first, second = rotation_pairs(R, host.rope_style)
    size = ref_rope.abs()
    pair = torch.hypot(ref_rope[..., first], ref_rope[..., second])
    size[..., first], size[..., second] = pair, pair
    assert rope.isnan().equal(ref_rope.isnan())
    err = torch.where(ref_rope.isnan(), 0.0, (rope - ref_rope).abs() - 2 * bf16_eps * size - 1e-30)
    assert (err <= 0).all()


# ------------------------------------------------------------------------- pools


def _offset_list(b: Tensor, n: int, s: int, w: int) -> Pool:
    """Per-layer ``[S, 656]`` views 4 bytes into wider rows: on 4-byte boundaries, none on 16."""
    return list(b[:, :, 4 : 4 + w].unbind(0))


LAYOUTS = {
    # [L, S, 656]
    "stacked": Layout(lambda b, n, s, w: b, lambda n, s, w: (n, s, w)),
    # rows padded past 656, and the layers of a larger cache
    "stacked_padded": Layout(lambda b, n, s, w: b[1 : n + 1, :, :w], lambda n, s, w: (n + 2, s, w + 16)),
    # [L, N, B, 656]
    "stacked_paged": Layout(lambda b, n, s, w: b, lambda n, s, w: (n, _pages(s), PAGE, w), PAGE),
    # vLLM per layer: [num_blocks, block_size, 656]
    "vllm": Layout(lambda b, n, s, w: list(b.unbind(0)), lambda n, s, w: (n, _pages(s), PAGE, w), PAGE),
    # the same, as a tuple
    "vllm_tuple": Layout(lambda b, n, s, w: tuple(b.unbind(0)), lambda n, s, w: (n, _pages(s), PAGE, w), PAGE),
    # sglang per layer: [size, 1, 656]; layers in reverse order of memory
    "sglang": Layout(lambda b, n, s, w: list(b.unbind(0))[::-1], lambda n, s, w: (n, s, 1, w)),
    # [S, 656] per layer
    "list": Layout(lambda b, n, s, w: list(b.unbind(0)), lambda n, s, w: (n, s, w)),
    # per layer, not 16-byte aligned (a launch of its own, not vectorised)
    "offset_list": Layout(_offset_list, lambda n, s, w: (n, s, w + 8)),
}


def run_ds_pool(
    inputs: Inputs,
    layout: str,
    cache_loc: Tensor,
    num_slots: int,
    rows: Tensor,
    into_pool: Callable[[Tensor, Any], None] | None = None,
) -> None:
    """Poison ``layout``'s allocation, write into it, compare every byte with ``rows`` (``[L, T, 656]``) put in
    by torch indexing. ``into_pool(cache_loc, pool)``: the call (the op by default)."""
    layers = inputs.shape[1]
    spec = LAYOUTS[layout]
    base = torch.full(spec.base(layers, num_slots, ROW), SENTINEL, dtype=torch.uint8, device=inputs.ckv.device)
    pool = spec.make(base, layers, num_slots, ROW)
    expected_base = base.clone().cpu()
    expected_pool = spec.make(expected_base, layers, num_slots, ROW)
    keep = (cache_loc >= 0) & (cache_loc < num_slots)
    host_loc = cache_loc.cpu()
    for layer in range(layers):
        _pool_rows(expected_pool, layer, num_slots)[host_loc[keep.cpu()]] = rows[layer][keep.cpu()]
    if into_pool is None:
        inputs.into_pool(cache_loc, pool, cache_format="fp8_ds_mla")
    else:
        into_pool(cache_loc, pool)
    assert base.cpu().equal(expected_base)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rope_style", STYLES)
def test_matches_vllm_reference(layout: str, norm: bool, rope_style: RopeStyle, mode: str) -> None:
    inputs = ds_inputs(6, 3, torch.bfloat16, rope_style, norm=norm)
    cache_loc = _slots(6, 11, _seed(layout, norm, rope_style))
    cache_loc[2] = -1
    rows = vllm_rows_of(inputs)
    assert rows.equal(reference_rows(inputs))
    run_ds_pool(inputs, layout, cache_loc, 11, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_the_oracle_and_the_reference(dtype: torch.dtype, norm: bool) -> None:
    """Every storage dtype: the latent rounded to bfloat16 (vLLM's op takes 16-bit rows in the model's dtype; this
    format's rows are bfloat16's), then quantized per tile."""
    inputs = ds_inputs(7, 2, dtype, "neox", norm=norm)
    rows = reference_rows(inputs)
    assert_ds_rows_close_to_oracle(rows, inputs)
    run_ds_pool(inputs, "stacked_paged", _slots(7, 9, 3), 9, rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_zero_nan_and_inf_tiles(device: str) -> None:
    """A zero tile's scale is the smallest normal float32 (vLLM's floor), its values +0; NaN is left out of a tile's
    amax and stays NaN (of either sign); an infinite value makes its tile's scale infinite (finite values 0, itself
    NaN). On CUDA too, where each value's division is a reciprocal and two corrections, not a division."""
    inputs = ds_inputs(3, 2, torch.float32, norm=False, device=device)
    ckv = inputs.ckv.clone()
    ckv[0, 0, :TILE] = 0.0
    ckv[0, 0, TILE : 2 * TILE] = torch.linspace(-2.0, 2.0, TILE)
    ckv[0, 0, TILE + 5] = float("nan")
    ckv[0, 0, 2 * TILE + 7] = float("inf")
    inputs = Inputs(ckv, None, inputs.eps, inputs.cos_sin_cache, inputs.positions, inputs.rope_style)
    on_device = torch.full((2, 4, ROW), SENTINEL, dtype=torch.uint8, device=device)
    inputs.into_pool(torch.tensor([2, 0, 3], device=device), on_device, cache_format="fp8_ds_mla")
    pool = on_device.cpu()
    row = pool[0, 2]
    scales = row[C : C + 16].view(torch.float32)
    values = row[:C].view(torch.float8_e4m3fn).float()
    assert scales[0] == FLT_MIN and (row[:TILE] == 0).all()
    assert scales[1] == torch.tensor(2.0) / 448  # the NaN left out
    assert values[TILE + 5].isnan() and not values[TILE : TILE + 5].isnan().any()
    assert values[TILE : 2 * TILE].abs().nan_to_num().max() == 448
    assert scales[2] == float("inf") and values[2 * TILE + 7].isnan()
    assert (values[2 * TILE : 2 * TILE + 7] == 0).all()
    # A NaN's sign is not kept alike: torch's float32 -> bfloat16 on the CPU gives a negative NaN, CUDA a positive.
    got, want = pool[:, [2, 0, 3]], reference_rows(inputs)
    nan = (want[..., :C] & 0x7F) == 0x7F
    assert got[..., :C][nan].bitwise_or(0x80).equal(want[..., :C][nan].bitwise_or(0x80))
    got[..., :C][nan] = want[..., :C][nan]
    assert got.equal(want)


@pytest.mark.production
def test_production_skips_slots_past_the_pool() -> None:
    inputs = ds_inputs(5, 2)
    run_ds_pool(inputs, "vllm", torch.tensor([3, 12, -5, 100, 0], dtype=torch.int32), 12, vllm_rows_of(inputs))


def test_all_slots_negative_writes_nothing() -> None:
    inputs = ds_inputs(4, 2)
    run_ds_pool(inputs, "sglang", torch.full((4,), -1), 7, reference_rows(inputs))


def test_layout_change_between_calls() -> None:
    """One plan per layout and format: plain and DeepSeek rows in turn, each written right."""
    inputs = ds_inputs(4, 2)
    rows = vllm_rows_of(inputs)
    plain = torch.zeros(2, 9, C + R, dtype=torch.bfloat16)
    for layout in ("stacked", "vllm", "stacked", "offset_list", "vllm"):
        run_ds_pool(inputs, layout, _slots(4, 9, 4), 9, rows)
        inputs.into_pool(torch.arange(4), plain)
        assert plain[:, :4].equal(inputs.dense())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: torch.zeros(2, 9, ROW + 2, dtype=torch.uint8)[..., :ROW],
            "kv_pool: expected strides that are multiples of 4 for cache_format='fp8_ds_mla', got (5922, 658, 1): "
            "each row holds float32 scales and bfloat16 rope values, written on 4-byte boundaries",
        ),
        (
            lambda: list(torch.zeros(2 * 9 * ROW + 2, dtype=torch.uint8)[2:].view(2, 9, ROW).unbind(0)),
            "kv_pool[0]: expected memory starting on a 4-byte boundary for cache_format='fp8_ds_mla', got an "
            "address 2 bytes past one: each row holds float32 scales and bfloat16 rope values, written on 4-byte "
            "boundaries",
        ),
        (
            lambda: torch.zeros(2 * 9 * ROW + 1, dtype=torch.uint8)[1:].view(2, 9, ROW),
            "kv_pool: expected memory starting on a 4-byte boundary for cache_format='fp8_ds_mla', got an "
            "address 1 bytes past one: each row holds float32 scales and bfloat16 rope values, written on 4-byte "
            "boundaries",
        ),
    ],
    ids=["stride", "layer-address", "address"],
)
@pytest.mark.parametrize("mode", MODES)
def test_rows_off_4_byte_boundaries_are_refused(make: Callable[[], Pool], message: str, mode: str) -> None:
    """Each row's scales and rope part are stored as float32 and bfloat16: a pool whose rows do not start on 4 bytes
    is an InputError, before anything is written."""
    inputs = ds_inputs(4, 2)
    pool = make()
    layers: Sequence[Tensor] = [pool] if isinstance(pool, Tensor) else pool
    with pytest.raises(typedkv.InputError) as err:
        inputs.into_pool(torch.arange(4), pool, cache_format="fp8_ds_mla")
    assert str(err.value) == message
    assert not any(bool(t.any()) for t in layers)


# ------------------------------------------------------------------ materializer


HIDDEN = 48


def _materializer(norm: bool) -> tuple[typedkv.MLAKVMaterializer, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(11)
    weight = (torch.randn(2, C + R, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    kv_norm = torch.rand(2, C, generator=g) + 0.5 if norm else None
    cache = torch.randn(40, R, generator=g)
    m = typedkv.MLAKVMaterializer(weight, kv_norm, 1e-6, cache, rope_style="gptj")
    hidden = torch.randn(5, HIDDEN, generator=g).to(torch.bfloat16)
    ckv = torch.stack([torch.nn.functional.linear(hidden, weight[i]) for i in range(2)], 1)
    return m, hidden, ckv, cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("layout", ["stacked_paged", "sglang"])
def test_materializer_into_pool(layout: str, norm: bool, mode: str) -> None:
    """`MLAKVMaterializer.into_pool` writes vLLM's rows of the unfused projection; twice (the kept layout)."""
    m, hidden, ckv, cache = _materializer(norm)
    positions = torch.tensor([0, 5, 39, 2, 2])
    inputs = Inputs(ckv, m.kv_norm_weight, 1e-6, cache, positions, "gptj")
    rows = vllm_rows_of(inputs)
    for _ in range(2):
        run_ds_pool(
            inputs, layout, torch.tensor([8, 0, -1, 4, 2]), 9, rows,
            lambda loc, pool: m.into_pool(hidden, positions, loc, pool, cache_format="fp8_ds_mla"),
        )  # fmt: skip


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_materializer_into_pool_compiled() -> None:
    """Under torch.compile (the GEMM in the graph, then the traced op): the eager bytes."""
    m, hidden, _, _ = _materializer(True)
    positions, cache_loc = torch.tensor([0, 5, 39, 2, 2]), torch.tensor([8, 0, -1, 4, 2])

    def fn(h: Tensor, pool: Tensor) -> None:
        m.into_pool(h, positions, cache_loc, pool, cache_format="fp8_ds_mla")

    got, want = torch.zeros(2, 3, 4, ROW, dtype=torch.uint8), torch.zeros(2, 3, 4, ROW, dtype=torch.uint8)
    torch.compile(fn, fullgraph=True)(hidden, got)
    fn(hidden, want)
    assert got.equal(want) and bool(want.any())


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_pools_poisoned(layout: str) -> None:
    """On CUDA, without a norm (no float32 sum whose order may differ between two kernels): vLLM's rows of the
    dense op's on the GPU (the same RoPE code, compiled alike), exactly."""
    inputs = ds_inputs(70, 5, torch.bfloat16, "gptj", norm=False, device="cuda")
    cache_loc = torch.randperm(200, device="cuda")[:70]
    cache_loc[::7] = -1
    run_ds_pool(inputs, layout, cache_loc, 200, vllm_rows_of(inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_the_cpu_path(rope_style: RopeStyle, dtype: torch.dtype) -> None:
    """With a norm, on CUDA: the oracle's values, and the CPU path's bytes but where the float32 norm's order (or a
    fused multiply-add in RoPE) moved a value to its other bfloat16 neighbour: then one e4m3 step, or a scale or a
    rope value one bfloat16 ulp, apart."""
    inputs = ds_inputs(64, 5, dtype, rope_style, device="cuda")
    pool = torch.zeros(5, 64, ROW, dtype=torch.uint8, device="cuda")
    inputs.into_pool(torch.arange(64, device="cuda"), pool, cache_format="fp8_ds_mla")
    got = pool.cpu()  # token t in slot t: [L, T, 656]
    assert_ds_rows_close_to_oracle(got, inputs)
    want = reference_rows(inputs)
    assert (got == want).float().mean() > 0.99
    latent, scales, rope = decode(got)
    want_latent, want_scales, want_rope = decode(want)
    assert ((scales - want_scales).abs() <= torch.finfo(torch.bfloat16).eps * want_scales).all()
    # One e4m3 step (2**-3 of a normal value, 2**-9 of the scale below them), and a scale one bfloat16 ulp apart.
    step = (2.0**-3 + 2.0**-6) * want_latent.abs() + want_scales.repeat_interleave(TILE, dim=-1) * 2**-8
    assert ((latent - want_latent).abs() <= step).all()
    row_max = want_rope.abs().amax(-1, keepdim=True)
    assert ((rope - want_rope).abs() <= torch.finfo(torch.bfloat16).eps * row_max).all()


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph() -> None:
    typedkv.set_debug(False)
    inputs = ds_inputs(16, 5, torch.bfloat16, "gptj", norm=False, device="cuda")
    pool = [torch.zeros(8, 64, ROW, dtype=torch.uint8, device="cuda") for _ in range(5)]
    loc = torch.randperm(512, device="cuda")[:16]
    inputs.into_pool(loc, pool, cache_format="fp8_ds_mla")  # first call: plan built, kernel compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs.into_pool(loc, pool, cache_format="fp8_ds_mla")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inputs.into_pool(loc, pool, cache_format="fp8_ds_mla")
    for layer_pool in pool:
        layer_pool.zero_()
    fresh = ds_inputs(16, 5, torch.bfloat16, "neox", norm=False)
    inputs.ckv.copy_(fresh.ckv)
    graph.replay()
    torch.cuda.synchronize()
    want = vllm_rows_of(inputs)
    for layer in range(5):
        assert pool[layer].view(-1, ROW)[loc].cpu().equal(want[layer])
