"""V normed as K (``v_norm_weight``): every op, pool layout, FP8 pool and materializer path.

A draft that norms V passes ``v_norm_weight`` ``[L, D]``: V is ``RMSNorm(v)`` with the
layer's eps, in float32, rounded to kv's dtype, without RoPE. Checked here:

- the dense op against the float64 oracle (``tests/reference64.py`` with ``v_norm_weight``):
  K within tests/test_numerics.py's tolerance, V the exact norm rounded once
  (`test_numerics.v_normed_ok`: to nearest, or the other neighbour next to a rounding
  boundary; float32 storage within its tolerance);
- V's norm is K's norm: with K and V swapped in kv and a table that turns by no angle, K
  of that call is V of the normed call, bit for bit (K as one tile, whose norm sums the
  row as V's does);
- pools of every layout (tests/test_pool.py's ``LAYOUTS``: stacked, per layer, paged NHD
  and HND) hold the dense op's rows bit for bit, FP8 pools ``saturate(v / scale)`` of
  the dense op's V (normed and rounded to kv's dtype first);
- `KVMaterializer` with ``v_norm_weight`` on GEMM + kernel (bit for bit the op on the
  GEMM's output) and on the fused projection (against the oracle, as
  tests/test_fused_projection.py: the interpreter's `tl.dot` takes float16 and float32
  only); the split GEMM is never taken (its V would have to be read back to be normed);
- misuse: a wrong shape, dtype, layer count or device is an `InputError` naming
  ``v_norm_weight``, before anything is written, in both modes.

The file runs on the reference path and under ``TRITON_INTERPRET=1``; the ``gpu``
tests run the CUDA kernels (the fused projection's TMA path included).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference64 import materialize_kv64
from test_fused_projection import DTYPES, Draft, assert_matches_oracle, fused, split_on_cpu, ways
from test_gpu_fused import weight_loads
from test_numerics import assert_bitwise_equal, assert_k_close, assert_v_normed, make_case
from test_pool import FP8, LAYOUTS, _seed, make_inputs, pool_rows, run_pool, slots_for, write_slots
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.core import launcher

__all__ = ["split_on_cpu", "weight_loads"]  # fixtures, used by name

STORAGE = (torch.bfloat16, torch.float16, torch.float32)
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


def _v_weight(num_layers: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(num_layers, head_dim, generator=g, dtype=torch.float64) + 0.5).to(dtype)


# ------------------------------------------------------------------ dense


@pytest.mark.parametrize("eps", ["float", "tensor"])
@pytest.mark.parametrize("k_norm", [True, False], ids=["k_norm", "k_rope_only"])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(80, 32), (64, 64)], ids=["D80-R32", "D64-R64"])
@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_dense_matches_oracle(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, rope_style: RopeStyle, k_norm: bool, eps: str
) -> None:
    """K as without a V norm; V the exact RMSNorm of v rounded once, eps one or per layer (large enough to count)."""
    case = make_case(7, 3, 2, head_dim, rotary_dim, dtype, rope_style, norm=k_norm)
    eps_value: float | Tensor = 0.5 if eps == "float" else torch.tensor([1e-6, 0.5, 4.0])
    v_weight = _v_weight(3, head_dim, _seed(dtype, head_dim, rope_style), torch.bfloat16)
    k, v = typedkv.materialize_kv(
        case.kv, case.k_norm_weight, eps_value, case.cos_sin_cache, case.positions, num_kv_heads=2,
        rope_style=rope_style, v_norm_weight=v_weight,
    )  # fmt: skip
    ref_k, ref_v = materialize_kv64(
        case.kv, case.k_norm_weight, eps_value, case.cos_sin_cache, case.positions, 2, rope_style,
        v_norm_weight=v_weight,
    )  # fmt: skip
    assert_k_close(k, ref_k, rotary_dim, rope_style)
    assert_v_normed(v, ref_v)
    # K is what it is without a V norm, bit for bit.
    k_plain, v_plain = typedkv.materialize_kv(
        case.kv, case.k_norm_weight, eps_value, case.cos_sin_cache, case.positions, num_kv_heads=2,
        rope_style=rope_style,
    )  # fmt: skip
    assert_bitwise_equal(k, k_plain, "k")
    assert not torch.equal(v, v_plain)


@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_v_norm_is_k_norm(dtype: torch.dtype) -> None:
    """V's norm computes K's bits: kv with its K and V blocks swapped, normed by the V weight as K and turned by
    no angle (cos 1, sin 0), gives as K the V of the call with ``v_norm_weight``. NeoX over part of the head,
    so that K is one tile (`typedkv.kv.kernel._k_row`), its norm summing each row as V's does."""
    T, L, H, D, R = 9, 2, 3, 80, 16
    case = make_case(T, L, H, D, R, dtype, "neox")
    v_weight = _v_weight(L, D, 11)
    _, v = typedkv.materialize_kv(
        case.kv, case.k_norm_weight, 1e-5, case.cos_sin_cache, case.positions, num_kv_heads=H, v_norm_weight=v_weight
    )
    swapped = torch.cat((case.kv[..., H * D :], case.kv[..., : H * D]), dim=-1)
    still = torch.cat((torch.ones(4, R // 2), torch.zeros(4, R // 2)), dim=-1)
    k_of_v, _ = typedkv.materialize_kv(swapped, v_weight, 1e-5, still, torch.zeros(T, dtype=torch.long), num_kv_heads=H)
    assert_bitwise_equal(v, k_of_v, "v")


def test_weightless_norm_is_a_weight_of_ones() -> None:
    """A norm without a weight is passed as ones: every V row then has a mean square of 1 (up to rounding)."""
    case = make_case(5, 2, 2, 64, 64, torch.float32)
    _, v = typedkv.materialize_kv(
        case.kv, None, 1e-12, case.cos_sin_cache, case.positions, num_kv_heads=2, v_norm_weight=torch.ones(2, 64)
    )
    assert torch.allclose(v.double().square().mean(-1), torch.ones(2, 5, 2, dtype=torch.float64), rtol=1e-5)


def test_no_tokens() -> None:
    case = make_case(0, 3, 2, 64, 32, torch.bfloat16)
    k, v = typedkv.materialize_kv(
        case.kv, None, 1e-6, case.cos_sin_cache, case.positions, num_kv_heads=2, v_norm_weight=torch.ones(3, 64)
    )
    assert k.shape == v.shape == (3, 0, 2, 64)


# ------------------------------------------------------------------- pools


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pool_layouts_match_dense(layout: str) -> None:
    """Every pool layout (stacked, per layer, paged NHD and HND) holds the dense op's normed rows at its slots."""
    inp = make_inputs(6, 3, 2, 16, 16, torch.bfloat16, "gptj", seed=_seed("v-norm", layout), v_norm=True)
    cache_loc = slots_for(6, 11, seed=_seed("v-norm", layout, "slots"))
    run_pool(inp, cache_loc, LAYOUTS[layout], torch.bfloat16, 11).check()


@pytest.mark.parametrize("layout", ["stacked", "list_separate", "paged_hnd", "flashinfer_nhd"])
@pytest.mark.parametrize("scales", ["float", "tensor"])
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_fp8_pools(pool_dtype: torch.dtype, scales: str, layout: str) -> None:
    """FP8 pools with given scales: V normed, rounded to kv's dtype, then ``saturate(v / scale)``, bit for bit."""
    inp = make_inputs(6, 3, 2, 32, 16, torch.float16, eps_per_layer=True, seed=_seed("v-fp8", layout), v_norm=True)
    cache_loc = slots_for(6, 11, seed=_seed("v-fp8", layout, "slots"))
    scale: dict[str, Any] = (
        {"k_scale": 0.25, "v_scale": 0.125}
        if scales == "float"
        else {"k_scale": torch.tensor([0.02, 0.7, 3.0]), "v_scale": torch.tensor([1.5, 0.25, 0.1])}
    )
    run_pool(inp, cache_loc, LAYOUTS[layout], pool_dtype, 11, **scale).check()


# ------------------------------------------------------------ materializer


L, H, D, HIDDEN, P = 3, 2, 16, 24, 64


def _materializer(dtype: torch.dtype, **kwargs: Any) -> tuple[typedkv.KVMaterializer, Tensor, Tensor, Tensor]:
    """A materializer that norms V, and its stacked weight, K and V norm weights."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(L, 2 * H * D, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    k_norm, v_norm = torch.rand(L, D, generator=g) + 0.5, torch.rand(L, D, generator=g) + 0.5
    cache = torch.randn(P, D, generator=g)
    m = typedkv.KVMaterializer(weight, k_norm, [1e-6, 1e-3, 0.5], cache, num_kv_heads=H, v_norm_weight=v_norm, **kwargs)
    return m, weight, k_norm, v_norm


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_materializer_gemm_matches_op(per_layer: bool) -> None:
    """GEMM + kernel: the op with ``v_norm_weight`` on the GEMM's output, bit for bit (dense and into a pool);
    per-layer norm weights are stacked as given."""
    m, weight, k_norm, v_norm = _materializer(torch.float32)
    if per_layer:
        m = typedkv.KVMaterializer(
            list(weight), list(k_norm), [1e-6, 1e-3, 0.5], m.cos_sin_cache, num_kv_heads=H, v_norm_weight=list(v_norm)
        )
    m.projection_path = "gemm"
    g = torch.Generator().manual_seed(4)
    hidden, positions = torch.randn(5, HIDDEN, generator=g), torch.randint(0, P, (5,), generator=g)
    kv = F.linear(hidden, weight.reshape(-1, HIDDEN)).view(5, L, 2 * H * D)
    eps = torch.tensor([1e-6, 1e-3, 0.5])
    want = typedkv.materialize_kv(kv, k_norm, eps, m.cos_sin_cache, positions, num_kv_heads=H, v_norm_weight=v_norm)
    got = m(hidden, positions)
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b, "k/v")
    cache_loc = torch.tensor([4, -1, 0, 7, 2])
    k_pool, v_pool = torch.zeros(L, 8, H, D), torch.zeros(L, 8, H, D)
    m.into_pool(hidden, positions, cache_loc, k_pool, v_pool)
    kept = cache_loc >= 0
    assert torch.equal(v_pool[:, cache_loc[kept]], want[1][:, kept])
    assert torch.equal(k_pool[:, cache_loc[kept]], want[0][:, kept])


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (24, 8)])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_materializer_fused_matches_oracle(
    dtype: torch.dtype, rope_style: RopeStyle, head_dim: int, rotary_dim: int
) -> None:
    """The fused projection (its V head programs norm V in the epilogue): K within the fused path's tolerance,
    V the exact norm of the exact (rounded) projection, rounded once; GEMM + kernel the same."""
    draft = Draft(dtype, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style, v_norm=True)
    x, positions = draft.call(5)
    want = draft.oracle(x, positions)
    assert want[1].dtype == torch.float64  # V normed: the exact value, for `test_numerics.v_normed_ok`
    for path in ("fused", "gemm"):
        draft.m.projection_path = path
        assert_matches_oracle(draft.m(x, positions), want, dtype)


@pytest.mark.parametrize("layout", ["stacked", "list_views", "paged_nhd", "paged_hnd"])
def test_materializer_fused_into_pools(layout: str) -> None:
    """The fused projection into pools: the rows its dense call returns, bit for bit; nothing else written."""
    draft = Draft(torch.float16, rope_style="gptj", rotary_dim=8, v_norm=True)
    x, positions = draft.call(6)
    k, v = fused(draft)(x, positions)
    pools = LAYOUTS[layout]
    bases = pools.alloc(L, 11, H, draft.head_dim, torch.float16)
    for base in bases:
        base.fill_(7.0)
    expected = [base.clone() for base in bases]
    cache_loc = slots_for(6, 11, seed=_seed("fused-v-norm", layout))
    k_pool, v_pool = pools.view(bases, H, draft.head_dim)
    draft.m.into_pool(x, positions, cache_loc, k_pool, v_pool, kv_layout=pools.kv_layout)  # type: ignore[arg-type]
    kept = (cache_loc >= 0).nonzero().flatten()
    for pool, rows in zip(pools.view(expected, H, draft.head_dim), (k, v), strict=True):
        write_slots(pool, rows, kept, cache_loc[kept], pools)
    for base, want in zip(bases, expected, strict=True):
        assert_bitwise_equal(base, want, "pool allocation")


@pytest.mark.usefixtures("split_on_cpu")
def test_materializer_never_splits() -> None:
    """Where V's GEMM would write v_out directly (the split), a V norm keeps GEMM + kernel, with its results."""
    m, *_ = _materializer(torch.float32)
    g = torch.Generator().manual_seed(6)
    hidden, positions = torch.randn(4, HIDDEN, generator=g), torch.randint(0, P, (4,), generator=g)
    got = m(hidden, positions)
    if launcher.INTERPRETED:  # only where there is a kernel does the table offer the split
        assert ways(m) == {"gemm"}
    plain, *_ = _materializer(torch.float32)
    plain.v_norm_weight = None  # the same draft, V not normed: the split takes it
    plain(hidden, positions)
    if launcher.INTERPRETED:
        assert ways(plain) == {"split"}
    plain.projection_path = "gemm"
    k, _ = plain(hidden, positions)
    assert_bitwise_equal(got[0], k, "k")


@pytest.mark.usefixtures("fresh_compile")
def test_compiled() -> None:
    """Under torch.compile (one op, v_norm_weight in its schema): the eager bits, dense and into a pool."""
    inp = make_inputs(5, 3, 2, 16, 16, torch.bfloat16, seed=7, v_norm=True)

    def fn(kv: Tensor, k_pool: Tensor, v_pool: Tensor) -> tuple[Tensor, Tensor]:
        k, v = typedkv.materialize_kv(
            kv, inp.k_norm_weight, 1e-6, inp.cos_sin_cache, inp.positions, num_kv_heads=2,
            v_norm_weight=inp.v_norm_weight,
        )  # fmt: skip
        typedkv.materialize_kv_into_pool(
            kv, inp.k_norm_weight, 1e-6, inp.cos_sin_cache, inp.positions, torch.tensor([3, -1, 0, 7, 1]), k_pool,
            v_pool, num_kv_heads=2, v_norm_weight=inp.v_norm_weight,
        )  # fmt: skip
        return k, v

    pools = [torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    got = torch.compile(fn, fullgraph=True)(inp.kv, pools[0], pools[1])
    want = fn(inp.kv, pools[2], pools[3])
    for a, b in zip((*got, *pools[:2]), (*want, *pools[2:]), strict=True):
        assert_bitwise_equal(a, b, "compiled")


# ------------------------------------------------------------------- misuse


def _call(**changes: Any) -> tuple[dict[str, Any], Tensor, Tensor]:
    """A pool call's arguments with ``changes``, and its pools (sentinel-filled)."""
    inp = make_inputs(4, 3, 2, 16, 16, torch.bfloat16, seed=2, v_norm=True)
    k_pool, v_pool = torch.full((3, 6, 2, 16), 7.0).bfloat16(), torch.full((3, 6, 2, 16), 7.0).bfloat16()
    args: dict[str, Any] = dict(
        kv=inp.kv, k_norm_weight=inp.k_norm_weight, eps=inp.eps, cos_sin_cache=inp.cos_sin_cache,
        positions=inp.positions, cache_loc=torch.tensor([0, 3, -1, 5]), k_pool=k_pool, v_pool=v_pool,
        num_kv_heads=2, v_norm_weight=inp.v_norm_weight,
    )  # fmt: skip
    args.update(changes)
    return args, k_pool, v_pool


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (torch.ones(4, 16), r"v_norm_weight: expected shape \(L=3, D=16\), got \(4, 16\): L=3 comes from kv"),
        (
            torch.ones(3, 32),
            r"v_norm_weight: expected shape \(L=3, D=16\), got \(3, 32\): D=16 comes from k_norm_weight",
        ),
        (torch.ones(16), r"v_norm_weight: expected shape \(L=3, D=16\), got \(16,\)"),
        (torch.ones(16, 3), r"v_norm_weight: expected shape \(L=3, D=16\), got \(16, 3\): dims 0 and 1 look swapped"),
        (
            torch.ones(3, 16, dtype=torch.int32),
            r"v_norm_weight: expected dtype bfloat16, float16, float32 or float64, got int32: "
            r"convert it with v_norm_weight.to\(torch.float32\)",
        ),
        (torch.ones(3, 16, device="meta"), r"v_norm_weight: expected device cpu \(kv's device\), got meta"),
        ([torch.ones(16)] * 3, r"v_norm_weight: expected a torch.Tensor or None, got list"),
    ],
    ids=["layers", "head-dim", "1d", "swapped", "dtype", "device", "list"],
)
def test_misuse_is_rejected_before_any_write(mode: str, weight: Any, message: str) -> None:
    """A wrong v_norm_weight names itself, the bound dims and the fix; both ops, nothing written."""
    args, k_pool, v_pool = _call(v_norm_weight=weight)
    with pytest.raises(typedkv.InputError, match=f"^{message}"):
        typedkv.materialize_kv_into_pool(**args)
    assert bool((k_pool.float() == 7.0).all()) and bool((v_pool.float() == 7.0).all())
    dense = {k: v for k, v in args.items() if k not in ("cache_loc", "k_pool", "v_pool")}
    with pytest.raises(typedkv.InputError, match=f"^{message}"):
        typedkv.materialize_kv(**dense)


def test_v_norm_alone_binds_the_head_dim() -> None:
    """Without a K norm weight, D comes from v_norm_weight: kv's width must then be 2*H*D of it."""
    args, _, _ = _call(k_norm_weight=None, v_norm_weight=torch.ones(3, 8))
    with pytest.raises(typedkv.InputError, match=r"^kv: expected shape \(T=4, L=3, 2\*H\*D=32\), got \(4, 3, 64\)"):
        typedkv.materialize_kv_into_pool(**args)


@pytest.mark.parametrize("mode", MODES)
def test_eps_is_checked_with_a_v_norm_alone(mode: str) -> None:
    """eps is read by V's norm: without a K norm weight it is still checked (a RoPE-only K leaves it unread)."""
    args, _, _ = _call(k_norm_weight=None, eps=float("nan"))
    with pytest.raises(typedkv.InputError, match=r"^eps: expected a number from 0 to float32's max"):
        typedkv.materialize_kv_into_pool(**args)
    args["v_norm_weight"] = None
    typedkv.materialize_kv_into_pool(**args)  # nothing reads eps


def test_materializer_misuse() -> None:
    """The constructor names v_norm_weight: a layer count other than kv_weight's, a layer of another dtype."""
    g = torch.Generator().manual_seed(0)
    weight, cache = torch.randn(L, 2 * H * D, HIDDEN, generator=g), torch.randn(P, D, generator=g)
    with pytest.raises(typedkv.InputError, match=r"^v_norm_weight: expected L=3 layers \(kv_weight has 3\), got 2$"):
        typedkv.KVMaterializer(weight, None, 1e-6, cache, num_kv_heads=H, v_norm_weight=torch.ones(2, D))
    with pytest.raises(
        typedkv.InputError, match=r"^v_norm_weight\[1\]: expected dtype float32 \(v_norm_weight\[0\]'s\)"
    ):
        typedkv.KVMaterializer(
            weight,
            None,
            1e-6,
            cache,
            num_kv_heads=H,
            v_norm_weight=[torch.ones(D), torch.ones(D).half(), torch.ones(D)],
        )
    with pytest.raises(
        typedkv.InputError, match=r"^v_norm_weight: expected shape \(L=3, D=16\), got \(3, 8\): D=16 comes from k_norm"
    ):
        typedkv.KVMaterializer(weight, torch.ones(L, D), 1e-6, cache, num_kv_heads=H, v_norm_weight=torch.ones(L, 8))


# --------------------------------------------------------------------- GPU


CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "stacked", "list_separate", "paged_hnd"])
@pytest.mark.parametrize("num_tokens", [3, 300, 5000], ids=["T3", "T300", "T5000"])
@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_cuda_kernel(dtype: torch.dtype, num_tokens: int, layout: str) -> None:
    """The K/V kernel on CUDA (K and V in one program or split, by T): V against the oracle, pools the dense rows."""
    case = make_case(num_tokens, 3, 8, 128, 64, dtype, "neox")
    assert case.k_norm_weight is not None
    v_weight = _v_weight(3, 128, 9).cuda()
    kv, k_norm, cache, positions = (t.cuda() for t in (case.kv, case.k_norm_weight, case.cos_sin_cache, case.positions))
    k, v = typedkv.materialize_kv(kv, k_norm, 1e-6, cache, positions, num_kv_heads=8, v_norm_weight=v_weight)
    ref_k, ref_v = materialize_kv64(
        case.kv, case.k_norm_weight, 1e-6, case.cos_sin_cache, case.positions, 8, "neox", v_norm_weight=v_weight.cpu()
    )
    assert_k_close(k.cpu(), ref_k, 64, "neox")
    assert_v_normed(v.cpu(), ref_v)
    if layout == "dense":
        return
    slots = torch.randperm(num_tokens + 7)[:num_tokens].cuda()
    pools = LAYOUTS[layout]
    k_pool, v_pool = pools.view([b.cuda() for b in pools.alloc(3, num_tokens + 7, 8, 128, dtype)], 8, 128)
    typedkv.materialize_kv_into_pool(
        kv, k_norm, 1e-6, cache, positions, slots, k_pool, v_pool, num_kv_heads=8, v_norm_weight=v_weight,
        kv_layout="HND" if pools.kv_layout == "HND" else "NHD",
    )  # fmt: skip
    # The pool op is a kernel of its own: the float32 sum of V's squares may add in another order than the
    # dense op's (docs/concepts.md, Numerics), so the rows are held to the oracle, not to the dense bits.
    assert_v_normed(pool_rows(v_pool, pools)[:, slots].cpu(), ref_v)


@pytest.mark.gpu
@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("pool", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("num_tokens", [1, 16, 100], ids=["T1", "T16", "T100"])
@pytest.mark.parametrize(("rotary_dim", "rope_style"), [(128, "neox"), (64, "neox"), (64, "gptj")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_fused_projection(
    dtype: torch.dtype, rotary_dim: int, rope_style: RopeStyle, num_tokens: int, pool: bool
) -> None:
    """The fused projection on CUDA, its weight tiles by pointer and by TMA (NeoX heads of 128: a whole V head one
    tile), dense and into a pool: V normed in the epilogue is the oracle's, as GEMM + kernel's is."""
    draft = Draft(dtype, head_dim=128, rotary_dim=rotary_dim, rope_style=rope_style, hidden=256, v_norm=True)
    draft.m.to("cuda")
    x, positions = draft.call(num_tokens)
    want = draft.oracle(x, positions)
    for path in ("fused", "gemm"):
        draft.m.projection_path = path
        if pool:
            slots = torch.randperm(num_tokens + 5)[:num_tokens]
            k_pool = torch.zeros(L, num_tokens + 5, H, 128, dtype=dtype, device="cuda")
            v_pool = torch.zeros_like(k_pool)
            draft.m.into_pool(x.cuda(), positions.cuda(), slots.cuda(), k_pool, v_pool)
            v = v_pool[:, slots.cuda()].cpu()
            assert_v_normed(v, want[1])
        else:
            k, v = draft.m(x.cuda(), positions.cuda())
            assert_matches_oracle((k.cpu(), v.cpu()), want, dtype)


@pytest.mark.gpu
def test_cuda_warp_specialised_kernel_not_taken() -> None:
    """The warp-specialised kernel norms no V: a call with a V norm is not launchable there (the fused path's
    Triton kernel takes it)."""
    from typedkv.projection import warp_specialized

    hidden = torch.zeros(2048, 512, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(2 * 2 * 2 * 128, 512, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(64, 128, device="cuda")
    plain = warp_specialized.launchable(
        hidden, weight, None, cache, None, None, num_kv_heads=2, head_dim=128, neox=True
    )
    if not plain:
        pytest.skip("the warp-specialised kernel runs on sm_90 under Triton 3.6 only")
    v_norm = torch.ones(2, 128, device="cuda")
    assert not warp_specialized.launchable(
        hidden, weight, None, cache, None, None, num_kv_heads=2, head_dim=128, neox=True, v_norm_weight=v_norm
    )
    pool = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert not warp_specialized.launchable_pool(
        hidden, weight, None, cache, pool, (None, None), num_kv_heads=2, head_dim=128, neox=True, v_norm_weight=v_norm
    )
