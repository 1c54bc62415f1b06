"""GPU suite (``pytest -m gpu``, ``nox -s gpu``): the Triton kernel on CUDA.

Numerics over the core grid against the float64 reference, the pool op in every
layout and FP8 format, CUDA-graph capture and replay with new values, the
absence of host syncs in production mode, and a ``compute-sanitizer`` memcheck
run. Skipped (by conftest) where no CUDA device is present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from memcheck import run_under_memcheck
from test_numerics import STORAGE, STYLES, Case, _dims_and_rotary, assert_matches_reference, make_case
from test_pool import (
    FP8,
    LAYOUTS,
    PAGED_LAYOUTS,
    SENTINEL,
    Inputs,
    _layers,
    _special_values,
    make_inputs,
    run_pool,
    slots_for,
    write_slots,
)
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.core import reference as core_reference
from typedkv.kv import reference as kv_reference

pytestmark = pytest.mark.gpu

_DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in STORAGE]


def cuda(case: Case) -> Case:
    """The same inputs on the GPU."""
    eps = case.eps.cuda() if isinstance(case.eps, Tensor) else case.eps
    return replace(
        case,
        kv=case.kv.cuda(),
        k_norm_weight=None if case.k_norm_weight is None else case.k_norm_weight.cuda(),
        eps=eps,
        cos_sin_cache=case.cos_sin_cache.cuda(),
        positions=case.positions.cuda(),
    )


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), _dims_and_rotary())
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33, 1000])
def test_grid_cuda(num_tokens: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """The core grid (T x D x R x dtype x style, L=3, H=2) on CUDA against the float64 reference."""
    case = cuda(make_case(num_tokens, 3, 2, head_dim, rotary_dim, dtype, rope_style))
    k, v = case.run()
    assert k.is_cuda and v.is_cuda
    assert_matches_reference(case, k, v)


@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("eps_kind", ["float", "tensor"])
def test_heads_and_eps_cuda(num_kv_heads: int, eps_kind: str) -> None:
    eps: float | Tensor = 1e-5 if eps_kind == "float" else torch.tensor([1e-6, 1e-3, 0.5])
    case = cuda(make_case(129, 3, num_kv_heads, 128, 128, torch.bfloat16, eps=eps))
    k, v = case.run()
    assert_matches_reference(case, k, v)


def test_outputs_into_slab_cuda() -> None:
    """k_out/v_out as [:, :T] views of a larger slab: the rest of the slab is untouched."""
    case = cuda(make_case(33, 3, 2, 128, 64, torch.bfloat16))
    slab = torch.full((2, 3, 64, 2, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    k, v = case.run(k_out=slab[0, :, :33], v_out=slab[1, :, :33])
    assert k.data_ptr() == slab[0].data_ptr()
    assert_matches_reference(case, k, v)
    assert bool((slab[:, :, 33:] == 7.0).all())


@pytest.mark.production
def test_programmatic_launch_reads_the_prior_kernels_output_cuda() -> None:
    """Each call's kv written by the kernel just before it on the stream (a programmatic dependent launch on
    Hopper: launched while that kernel runs, waiting for it before the first load): the reference's K/V,
    eagerly and in a replayed CUDA graph, the two inputs alternating."""
    from typedkv.core import launcher
    from typedkv.kv import impl as kv_impl

    base = cuda(make_case(4096, 5, 8, 128, 128, torch.bfloat16, seed=1))
    cases = [base, replace(base, kv=cuda(make_case(4096, 5, 8, 128, 128, torch.bfloat16, seed=2)).kv)]
    want = [case.run() for case in cases]
    for case, (k, v) in zip(cases, want, strict=True):
        assert_matches_reference(case, k, v)
    kv = torch.empty_like(cases[0].kv)
    live = replace(cases[0], kv=kv)
    k_out, v_out = (torch.empty_like(t) for t in want[0])

    def step(i: int) -> None:
        torch.mul(cases[i % 2].kv, 1.0, out=kv)  # an elementwise kernel writes kv, then ours reads it
        live.run(k_out=k_out, v_out=v_out)

    for i in range(6):
        step(i)
        assert torch.equal(k_out, want[i % 2][0]) and torch.equal(v_out, want[i % 2][1])
    launches = [plan.launch for plan in kv_impl.DENSE.signature._plans.values() if plan.launch is not None]
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert launches and all(launch.programmatic is (hopper and launcher.PROGRAMMATIC_LAUNCH) for launch in launches)
    assert all(launch.compiled.metadata.launch_pdl is launch.programmatic for launch in launches if launch.compiled)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(1)
        step(0)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_out, want[0][0]) and torch.equal(v_out, want[0][1])


@pytest.mark.production
def test_direct_launches_through_the_c_launch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout's calls after its first launch its compiled kernel directly, on Triton 3.6 through the
    launcher's C launch itself: the reference's K and V on new data at every call."""
    import triton

    from typedkv.core import launcher
    from typedkv.kv import impl as kv_impl

    found: list[Any] = []
    unwrapped = launcher._unwrapped_launch

    def recorded(compiled: Any, slots: tuple[int, ...]) -> Any:
        found.append(unwrapped(compiled, slots))
        return found[-1]

    monkeypatch.setattr(launcher, "_unwrapped_launch", recorded)
    kv_impl.DENSE.signature._plans.clear()
    for seed in range(4):
        case = cuda(make_case(40, 3, 2, 128, 64, torch.bfloat16, seed=seed))
        k, v = case.run()
        assert_matches_reference(case, k, v)
    assert found, "no direct launch"
    if triton.__version__.startswith("3.6."):
        assert all(entry is not None and entry[1] == [] for entry in found)
    else:
        assert not any(found)


@pytest.mark.production
def test_unaligned_kv_after_aligned_cuda() -> None:
    """One layout, kv 16-byte aligned and then two bytes off (the same shape and strides).

    The launch kept from the first call was compiled for aligned pointers (16-byte vector
    loads); the second call must not reuse it, or the GPU faults on a misaligned address.
    """
    case = cuda(make_case(33, 3, 2, 128, 64, torch.bfloat16))
    k, v = case.run()
    assert_matches_reference(case, k, v)
    buffer = torch.empty(case.kv.numel() + 1, dtype=case.kv.dtype, device="cuda")
    shifted = buffer[1:].view(case.kv.shape)
    shifted.copy_(case.kv)
    assert shifted.data_ptr() % 16 and shifted.stride() == case.kv.stride()
    shifted_case = replace(case, kv=shifted)
    k, v = shifted_case.run()
    torch.cuda.synchronize()
    assert_matches_reference(shifted_case, k, v)


def test_out_of_range_positions_cuda() -> None:
    """Production: a position outside [0, P) gives NaN K for that token and touches nothing else."""
    typedkv.set_debug(False)
    case = cuda(make_case(16, 2, 2, 128, 128, torch.bfloat16))
    positions = case.positions.clone()
    positions[3] = 10**9
    positions[5] = -1
    k, v = replace(case, positions=positions).run()
    assert bool(k[:, [3, 5]].isnan().all())
    good = [t for t in range(16) if t not in (3, 5)]
    ref_k, ref_v = case.reference()
    assert torch.equal(v, ref_v)
    assert not bool(k[:, good].isnan().any())
    assert float((k[:, good].double() - ref_k[:, good]).abs().max()) < 0.1


# ------------------------------------------------------------------------ pools


def _pool_inputs(num_tokens: int, num_slots: int, fmt: torch.dtype, rotary_dim: int = 128) -> tuple[Case, Tensor]:
    case = cuda(make_case(num_tokens, 3, 2, 128, rotary_dim, torch.bfloat16, num_positions=4096))
    slots = torch.randperm(num_slots, device="cuda")[:num_tokens]
    slots[::7] = -1  # padding tokens
    return case, slots


@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), _dims_and_rotary((64, 80, 128, 256)))
@pytest.mark.parametrize("num_tokens", [1, 7, 1000])
def test_rope_only_cuda(
    num_tokens: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, rope_style: RopeStyle
) -> None:
    """k_norm_weight=None on CUDA: RoPE(k) against the float64 reference (eps NaN: never read)."""
    case = make_case(num_tokens, 3, 2, head_dim, rotary_dim, dtype, rope_style, eps=float("nan"), norm=False)
    case = cuda(case)
    k, v = case.run()
    assert_matches_reference(case, k, v)


def _on(inp: Inputs, device: str) -> Inputs:
    eps = inp.eps.to(device) if isinstance(inp.eps, Tensor) else inp.eps
    weight = None if inp.k_norm_weight is None else inp.k_norm_weight.to(device)
    return replace(
        inp, kv=inp.kv.to(device), k_norm_weight=weight, eps=eps,
        cos_sin_cache=inp.cos_sin_cache.to(device), positions=inp.positions.to(device),
    )  # fmt: skip


@pytest.mark.parametrize("layout", list(PAGED_LAYOUTS))
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3fn"])
def test_paged_cuda(layout: str, norm: bool, fmt: torch.dtype) -> None:
    """Paged NHD/HND pools, combined-cache views (FlashInfer, vLLM) on CUDA: the CPU path's bytes.

    V bit for bit, K within one step of the pool format (float32 math may round
    differently in the last bit), every byte no slot names untouched.
    """
    num_tokens, num_slots = 300, 1000
    inp = make_inputs(num_tokens, 3, 4, 128, 64, torch.bfloat16, seed=11, num_positions=512, norm=norm)
    cache_loc = slots_for(num_tokens, num_slots, seed=12)
    cache_loc[5] = num_slots + 7  # past the last page: skipped in production
    scales = (torch.tensor([0.5, 2.0, 0.125]), torch.tensor([1.5, 0.25, 1.0])) if fmt in FP8 else (None, None)
    typedkv.set_debug(False)
    _check_pool_cuda(inp, cache_loc, LAYOUTS[layout], fmt, num_slots, scales)


def _check_pool_cuda(
    inp: Inputs, cache_loc: Tensor, spec: Any, fmt: torch.dtype, num_slots: int, scales: tuple[Any, Any]
) -> None:
    """``inp`` into ``spec``'s pools on CUDA against the CPU path's bytes (`run_pool`): V bit for bit, K
    within one step of the pool format, every byte no slot names untouched."""
    L, T, H, D = inp.num_layers, inp.num_tokens, inp.num_kv_heads, inp.head_dim
    want = run_pool(inp, cache_loc, spec, fmt, num_slots, k_scale=scales[0], v_scale=scales[1])
    bases = [b.cuda() for b in spec.alloc(L, num_slots, H, D, fmt)]
    for base in bases:
        base.view(torch.uint8).fill_(SENTINEL)
    k_pool, v_pool = spec.view(bases, H, D)
    gpu = _on(inp, "cuda")
    gpu.into_pool(
        cache_loc.cuda(), k_pool, v_pool, kv_layout=spec.kv_layout,
        k_scale=None if scales[0] is None else scales[0].cuda(), v_scale=None if scales[1] is None else scales[1].cuda(),
    )  # fmt: skip
    info = torch.finfo(fmt)
    for got_pool, want_pool, exact in ((v_pool, want.v_pool, True), (k_pool, want.k_pool, False)):
        for got, expected in zip(_layers(got_pool), _layers(want_pool), strict=True):
            got = got.cpu()
            if exact:
                assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
                continue
            # The intermediate rounding after the norm may differ in the last bit, and RoPE
            # carries it into the partner dim: within two steps of the head's largest value.
            step = 2 * expected.float().abs().amax(-1, keepdim=True) * info.eps + info.smallest_normal * info.eps
            err = (got.float() - expected.float()).abs()
            assert bool((err <= step).all()), f"K off by {float((err / step).max()):.2f} of the bound"
    # Every byte but the written slots still the sentinel: overwrite those with it, then look.
    filler = torch.empty(L, T, H, D, dtype=fmt, device="cuda")
    filler.view(torch.uint8).fill_(SENTINEL)
    for pool in (k_pool, v_pool):
        write_slots(pool, filler, want.kept, want.slots, spec)
    for base in bases:
        assert bool((base.view(torch.uint8) == SENTINEL).all()), "a byte no slot names was written"


@pytest.mark.production
@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3fn"])
def test_per_layer_pools_off_16_bytes_after_aligned_cuda(fmt: torch.dtype) -> None:
    """Per-layer pools on 16 bytes, then one element off them, then on again: one layout (shapes, strides).

    The launch kept from the first call stores whole vectors (every layer's offset from
    layer 0 a multiple of 16 bytes); the second call must not reuse it, or the GPU faults
    on a misaligned address. Each call against the CPU path's bytes.
    """
    typedkv.set_debug(False)
    inp = make_inputs(40, 3, 4, 128, 64, torch.bfloat16, seed=21, num_positions=512)
    cache_loc = slots_for(40, 96, seed=22)
    for layout in ("list_views", "list_unaligned", "list_views"):
        _check_pool_cuda(inp, cache_loc, LAYOUTS[layout], fmt, 96, (None, None))
        torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["stacked", "list", "padded-list"])
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("rotary_dim", [128, 64], ids=["R128", "R64"])  # R < D: the one-tile K
def test_pool_cuda(fmt: torch.dtype, layout: str, scale_kind: str, rotary_dim: int) -> None:
    if fmt == torch.bfloat16 and scale_kind != "none":
        pytest.skip("scales are for FP8 pools")
    # 300 tokens of 3 layers launch K and V as separate programs; 1500 as one.
    num_tokens, num_slots, L = (300, 1000, 3) if rotary_dim == 128 else (1500, 4000, 3)
    case, slots = _pool_inputs(num_tokens, num_slots, fmt, rotary_dim)
    scale: float | Tensor | None = {
        "none": None,
        "float": 0.25,
        "tensor": torch.tensor([0.5, 2.0, 0.125], device="cuda"),
    }[scale_kind]
    sentinel = torch.full((L, num_slots, 2, 128), 3.0, device="cuda").to(fmt)
    k_buf, v_buf = sentinel.clone(), sentinel.clone()
    k_pool: Any
    v_pool: Any
    if layout == "stacked":
        k_pool, v_pool = k_buf, v_buf
    elif layout == "list":
        k_pool, v_pool = list(k_buf.unbind(0)), list(v_buf.unbind(0))
    else:
        # Per-layer views with padded rows: each row of 4 heads holds our 2.
        wide_k = torch.full((L, num_slots, 4, 128), 3.0, device="cuda").to(fmt)
        wide_v = wide_k.clone()
        k_pool, v_pool = [w[:, :2] for w in wide_k.unbind(0)], [w[:, :2] for w in wide_v.unbind(0)]
    typedkv.materialize_kv_into_pool(
        case.kv, case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions, slots, k_pool, v_pool,
        num_kv_heads=2, k_scale=scale, v_scale=scale,
    )  # fmt: skip
    inputs = (case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions)
    k32, v = kv_reference.rmsnorm_rope(case.kv, inputs, 2, True)
    want_k = core_reference.quantize(k32 if fmt.itemsize == 1 else k32.to(case.kv.dtype), scale, fmt)
    want_v = core_reference.quantize(v, scale, fmt)
    k_got = torch.stack(list(k_pool)) if isinstance(k_pool, list) else k_pool
    v_got = torch.stack(list(v_pool)) if isinstance(v_pool, list) else v_pool
    keep = slots >= 0
    rows = slots[keep]
    assert torch.equal(v_got[:, rows].view(torch.uint8), want_v[:, keep].contiguous().view(torch.uint8))
    # K: the kernel's float32 norm may differ from the reference's in the last
    # bit, which can move a value across a rounding boundary of the pool's
    # format: at most one step of that format at the value's magnitude.
    info = torch.finfo(fmt)
    want = want_k[:, keep].float()
    diff = (k_got[:, rows].float() - want).abs()
    step = want.abs() * info.eps + info.smallest_normal * info.eps
    assert bool((diff <= step).all()), f"K off by more than one {fmt} step: max {float((diff - step).max())}"
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert bool((k_got[:, untouched].float() == 3.0).all()) and bool((v_got[:, untouched].float() == 3.0).all())
    if layout == "padded-list":
        assert bool((wide_k[:, :, 2:].float() == 3.0).all()) and bool((wide_v[:, :, 2:].float() == 3.0).all())


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_special_values_cuda(fmt: torch.dtype) -> None:
    """The hardware FP8 conversion saturates (inf and overflow to +-max) and rounds to nearest even."""
    values = torch.tensor(_special_values(fmt))
    T, L, H, D = 4, 2, 2, 64
    case = make_case(T, L, H, D, D, torch.float32, num_positions=64)
    kv = case.kv.clone()
    block = kv[:, :, H * D :].clone()  # V of every layer, [T, L, H*D]: the specials first
    block.view(-1)[: len(values)] = values * 4.0  # divided by v_scale = 4: exactly the special value
    kv[:, :, H * D :] = block
    slots = torch.tensor([3, 0, 6, 1], device="cuda")
    k_pool = torch.zeros(L, 8, H, D, device="cuda").to(fmt)
    v_pool = torch.zeros_like(k_pool)
    gpu = cuda(replace(case, kv=kv))
    # Small enough that most normed K values pass the format's range.
    k_scale = 2.0**-12 if fmt == torch.float8_e4m3fn else 2.0**-17
    typedkv.materialize_kv_into_pool(
        gpu.kv, gpu.k_norm_weight, gpu.eps, gpu.cos_sin_cache, gpu.positions, slots, k_pool, v_pool,
        num_kv_heads=H, k_scale=k_scale, v_scale=4.0,
    )  # fmt: skip
    want_v = core_reference.quantize(kv[:, :, H * D :].reshape(T, L, H, D).transpose(0, 1), 4.0, fmt)
    got_v = v_pool[:, slots].cpu()
    assert torch.equal(got_v.view(torch.uint8), want_v.contiguous().view(torch.uint8))
    fmax = torch.finfo(fmt).max
    got = dict(zip(_special_values(fmt), got_v.transpose(0, 1).reshape(-1)[: len(values)].tolist(), strict=True))
    assert got[float("inf")] == fmax and got[float("-inf")] == -fmax and got[fmax * 1.5] == fmax
    assert got[1e30] == fmax and got[1.9375] == 2.0 and got[-1.9375] == -2.0
    assert bool((k_pool[:, slots].float().abs() == fmax).any())
    assert not bool(k_pool[:, slots].float().isnan().any())


def test_pool_memory_stable_cuda() -> None:
    """Repeated pool writes allocate nothing (the layer table is cached per set of pools)."""
    case, slots = _pool_inputs(64, 256, torch.bfloat16)
    k_pool = [torch.empty(256, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    v_pool = [torch.empty(256, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    typedkv.set_debug(False)

    def call() -> None:
        typedkv.materialize_kv_into_pool(
            case.kv, case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions, slots, k_pool, v_pool,
            num_kv_heads=2,
        )  # fmt: skip

    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


# ---------------------------------------------------------- no syncs, CUDA graphs


def test_production_makes_no_sync() -> None:
    """Production mode never synchronises with the device (both ops, dense and pool; outputs given, whose
    addresses are compared with the inputs' at every call, at new addresses each time too)."""
    typedkv.set_debug(False)
    case = cuda(make_case(64, 3, 2, 128, 128, torch.bfloat16, eps=torch.full((3,), 1e-6)))
    slots = torch.randperm(256, device="cuda")[:64]
    k_pool = torch.empty(3, 256, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
    v_pool = torch.empty_like(k_pool)
    pools = [torch.empty(256, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(6)]
    scale = torch.ones(3, device="cuda")
    slabs = [torch.empty(3, 64, 2, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]

    def calls() -> None:
        case.run()
        slab = slabs.pop(0)  # K and V interleaved token by token, at addresses not seen before
        slabs.append(slab)
        case.run(k_out=slab[:, :, 0], v_out=slab[:, :, 1])
        typedkv.materialize_kv_into_pool(
            case.kv, case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions, slots, k_pool, v_pool,
            num_kv_heads=2, k_scale=scale, v_scale=0.5,
        )  # fmt: skip
        typedkv.materialize_kv_into_pool(
            case.kv, case.k_norm_weight, case.eps, case.cos_sin_cache, case.positions, slots, pools[:3], pools[3:],
            num_kv_heads=2,
        )  # fmt: skip

    assert_no_sync(calls)


def assert_no_sync(calls: Callable[[], None]) -> None:
    """``calls`` runs three times under ``set_sync_debug_mode("error")`` (a sync raises).

    One call first, outside the check: the first call per layout builds its plan
    (and a list pool's layer table, a KVMaterializer's workspace).
    """
    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_debug_mode_does_sync_and_checks() -> None:
    """Debug mode catches out-of-range positions on CUDA (it may sync to do so)."""
    typedkv.set_debug(True)
    case = cuda(make_case(8, 2, 2, 64, 64, torch.float16))
    positions = case.positions.clone()
    positions[2] = 10**6
    with pytest.raises(typedkv.InputError, match="positions: expected values in"):
        replace(case, positions=positions).run()


@pytest.mark.parametrize("kind", ["dense", "pool", "paged-hnd", "rope-only-paged-nhd"])
def test_cuda_graph_replay_new_values(kind: str) -> None:
    """Captured at fixed T, replayed with new inputs copied in: results follow the new values.

    Paged pools are the K/V halves of one combined cache ``[L, N, 2, ...]`` with pages of 16 slots.
    """
    typedkv.set_debug(False)
    T, L, H, D, B = 48, 3, 2, 128, 16
    norm = not kind.startswith("rope-only")
    case = cuda(make_case(T, L, H, D, D, torch.bfloat16, num_positions=512, norm=norm))
    static = replace(
        case,
        kv=case.kv.clone(),
        positions=case.positions.clone(),
    )
    slots = torch.randperm(208, device="cuda")[:T]
    layout: typedkv.KVLayout = "HND" if kind == "paged-hnd" else "NHD"
    if kind == "pool":
        k_pool = torch.zeros(L, 208, H, D, dtype=torch.bfloat16, device="cuda")
        v_pool = torch.zeros_like(k_pool)
    else:
        page = (H, B) if layout == "HND" else (B, H)
        cache = torch.zeros(L, 208 // B, 2, *page, D, dtype=torch.bfloat16, device="cuda")
        k_pool, v_pool = cache[:, :, 0], cache[:, :, 1]
    k_out = torch.empty(L, T, H, D, dtype=torch.bfloat16, device="cuda")
    v_out = torch.empty_like(k_out)

    def step() -> None:
        if kind == "dense":
            static.run(k_out=k_out, v_out=v_out)
        else:
            typedkv.materialize_kv_into_pool(
                static.kv, static.k_norm_weight, static.eps, static.cos_sin_cache, static.positions, slots,
                k_pool, v_pool, num_kv_heads=H, kv_layout=layout,
            )  # fmt: skip

    def rows(pool: Tensor) -> Tensor:
        # [L, T, H, D]: the rows of the written slots, read back by page and offset.
        if kind == "pool":
            return pool[:, slots]
        if layout == "HND":
            return pool[:, slots // B, :, slots % B].transpose(0, 1)
        return pool[:, slots // B, slots % B]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture: compiles, builds the plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        # New activations and positions; the weights and the cache are the captured ones.
        fresh = cuda(make_case(T, L, H, D, D, torch.bfloat16, num_positions=512, seed=100 + seed, norm=norm))
        static.kv.copy_(fresh.kv)
        static.positions.copy_(fresh.positions)
        graph.replay()
        torch.cuda.synchronize()
        k, v = (k_out, v_out) if kind == "dense" else (rows(k_pool), rows(v_pool))
        assert_matches_reference(replace(static, kv=fresh.kv, positions=fresh.positions), k, v)


# -------------------------------------------------------------- compute-sanitizer

_SANITIZED = """
import torch, typedkv
torch.manual_seed(0)
T, L, H, D, P = 37, 2, 3, 80, 50
kv = torch.randn(T, L, 2 * H * D, device="cuda", dtype=torch.bfloat16)
w = torch.rand(L, D, device="cuda") + 0.5
cs = torch.randn(P, 32, device="cuda")
pos = torch.randint(0, P, (T,), device="cuda")
pos[0] = 10**9  # out of range: must not be read
k, v = typedkv.materialize_kv(kv, w, 1e-6, cs, pos, num_kv_heads=H, rope_style="gptj")
slots = torch.randperm(100, device="cuda")[:T]
slots[1] = -5
slots[2] = 10**6  # beyond the pool: must not be written
pools = [torch.empty(100, H, D, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2 * L)]
typedkv.materialize_kv_into_pool(kv, w, 1e-6, cs, pos, slots, pools[:L], pools[L:], num_kv_heads=H, k_scale=0.5)
# Paged: the K/V halves of combined caches, NHD and HND, pages of 16 (6 pages: slots >= 96 skipped).
for page in ((16, H), (H, 16)):
    cache = torch.empty(L, 6, 2, *page, D, device="cuda", dtype=torch.bfloat16)
    layout = "NHD" if page[0] == 16 else "HND"
    typedkv.materialize_kv_into_pool(
        kv, None, 1e-6, cs, pos, slots, cache[:, :, 0], cache[:, :, 1], num_kv_heads=H, kv_layout=layout
    )
    per_layer = [torch.empty(6, 2, *page, D, device="cuda", dtype=torch.float8_e5m2) for _ in range(L)]
    typedkv.materialize_kv_into_pool(
        kv, w, 1e-6, cs, pos, slots, [c[:, 0] for c in per_layer], [c[:, 1] for c in per_layer],
        num_kv_heads=H, kv_layout=layout, v_scale=2.0,
    )
torch.cuda.synchronize()
print("sanitized run done")
"""


def test_compute_sanitizer_memcheck(tmp_path: Path) -> None:
    """compute-sanitizer's memcheck finds no invalid access, out-of-range positions and slots included."""
    script = tmp_path / "sanitized.py"
    script.write_text(_SANITIZED)
    run_under_memcheck(script, [], "sanitized run done", 600)


# ------------------------------------------------------------ compilations


def compiled_variants(kernel: Any) -> int:
    """How many variants of ``kernel`` Triton has compiled for the current device."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.production
def test_new_token_count_compiles_nothing_cuda() -> None:
    """T is not specialised on: once a layout's three regimes (K and V split on 8 warps at the
    smallest T, split on 4, or not split) ran, no new T compiles the kernel again (a kernel with
    T a constexpr would compile at each)."""
    from typedkv.kv import kernel as kv_kernel
    from typedkv.tools import cases

    def call(num_tokens: int) -> None:
        x = cases.make_inputs(cases.MAIN, num_tokens, torch.device("cuda"))
        typedkv.materialize_kv(
            x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, num_kv_heads=8, k_out=x.k_out, v_out=x.v_out
        )

    for num_tokens in (16, 256, 8192):
        call(num_tokens)
    before = compiled_variants(kv_kernel.materialize_kv_kernel)
    for num_tokens in (1, 17, 100, 999, 5000, 12345):
        call(num_tokens)
    torch.cuda.synchronize()
    assert compiled_variants(kv_kernel.materialize_kv_kernel) == before
