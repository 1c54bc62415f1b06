"""A RoPE table per layer: ``cos_sin_cache`` of shape ``[L, P, R]`` (layer ``l`` rotates with table ``l``).

Drafts whose layers differ in RoPE base or scaling pass one table per layer. Checked
here, for every op and materializer that takes a cache:

- layer ``l`` of a call with ``[L, P, R]`` is, bit for bit, the same call on layer ``l``
  alone with table ``l`` (``[P, R]``): the per-layer table changes which table a layer
  reads and nothing else (the K/V and MLA ops, dense and into pools, the materializers);
- the dense ops against the float64 oracle (``tests/reference64.py`` reads a table per
  layer), tolerances as tests/test_numerics.py and tests/test_mla.py;
- pools of every layout (stacked, per layer, paged NHD and HND; tests/test_pool.py's and
  tests/test_mla.py's harnesses: the dense op's rows at the slots, every other byte
  unchanged), FP8 pools with given scales;
- the table's strides are honoured (a strided view, one table expanded over the layers);
- misuse: a table for another number of layers is an `InputError` naming
  ``cos_sin_cache`` and where ``L`` comes from, before anything is written, in both modes.

The file runs on the reference path and under ``TRITON_INTERPRET=1``; the ``gpu`` tests
run the CUDA kernels (the fused projection's TMA path included).
"""

from __future__ import annotations

from typing import Any

import pytest
import test_mla
import test_mla_fp8_ds
import torch
import torch.nn.functional as F
from reference64 import materialize_kv64, materialize_mla_kv64
from test_fused_projection import DTYPES, Draft, assert_matches_oracle
from test_gpu_fused import weight_loads
from test_numerics import assert_bitwise_equal, assert_k_close
from test_pool import FP8, LAYOUTS, _seed, make_inputs, pool_rows, run_pool, slots_for
from torch import Tensor

import typedkv
from typedkv import RopeStyle

__all__ = ["weight_loads"]  # a fixture, used by name

STORAGE = (torch.bfloat16, torch.float16, torch.float32)
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


def tables(num_layers: int, num_positions: int, rotary_dim: int, seed: int) -> Tensor:
    """``[L, P, R]``: random angles per layer (every quadrant), cos then sin."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(num_layers, num_positions, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.2
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


# ------------------------------------------------------------------ K/V ops


@pytest.mark.parametrize("v_norm", [False, True], ids=["v", "v_norm"])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(80, 32), (64, 64)], ids=["D80-R32", "D64-R64"])
@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_dense_layers_read_their_own_table(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, rope_style: RopeStyle, v_norm: bool
) -> None:
    """Each layer is the one-layer call with its own table, bit for bit; K against the oracle."""
    inp = make_inputs(
        7, 3, 2, head_dim, rotary_dim, dtype, rope_style, eps_per_layer=True,
        seed=_seed("tables", dtype, head_dim, rope_style), v_norm=v_norm, layer_tables=True,
    )  # fmt: skip
    assert inp.cos_sin_cache.shape == (3, 40, rotary_dim)
    k, v = inp.dense()
    assert isinstance(inp.eps, Tensor)
    for layer in range(3):
        one = typedkv.materialize_kv(
            inp.kv[:, layer : layer + 1], inp.k_norm_weight[layer : layer + 1],  # type: ignore[index]
            inp.eps[layer : layer + 1], inp.cos_sin_cache[layer], inp.positions, num_kv_heads=2,
            rope_style=rope_style, v_norm_weight=None if inp.v_norm_weight is None else inp.v_norm_weight[layer : layer + 1],
        )  # fmt: skip
        assert_bitwise_equal(k[layer], one[0][0], f"k of layer {layer}")
        assert_bitwise_equal(v[layer], one[1][0], f"v of layer {layer}")
    ref_k, _ = materialize_kv64(inp.kv, inp.k_norm_weight, inp.eps, inp.cos_sin_cache, inp.positions, 2, rope_style)
    assert_k_close(k, ref_k, rotary_dim, rope_style)


def test_layers_differ_by_their_tables() -> None:
    """Two layers of equal K and weights, two tables: their K differs; with one table repeated, it does not."""
    inp = make_inputs(5, 1, 2, 32, 32, torch.float32, seed=3)
    kv = inp.kv.expand(5, 2, inp.kv.shape[2])  # layer 1 reads layer 0's values
    weight = inp.k_norm_weight.expand(2, 32)  # type: ignore[union-attr]
    two = tables(2, 40, 32, 4)
    k, _ = typedkv.materialize_kv(kv, weight, 1e-6, two, inp.positions, num_kv_heads=2)
    assert not torch.equal(k[0], k[1])
    same, _ = typedkv.materialize_kv(kv, weight, 1e-6, two[:1].expand(2, 40, 32), inp.positions, num_kv_heads=2)
    assert torch.equal(same[0], same[1])
    assert_bitwise_equal(same[0], k[0], "k of layer 0")


@pytest.mark.parametrize(
    "view",
    ["expanded", "strided-rows", "layers-last"],
)
def test_table_strides_are_honoured(view: str) -> None:
    """A table that is a view: one [P, R] table expanded over the layers (layer stride 0), rows of a wider
    buffer, layers stored innermost but the rotary dim (the last dim stays contiguous)."""
    inp = make_inputs(6, 3, 2, 32, 16, torch.bfloat16, "gptj", seed=5, layer_tables=True)
    table = inp.cos_sin_cache
    strided: Tensor
    if view == "expanded":
        table = table[:1].expand(3, 40, 16)
        strided = table
    elif view == "strided-rows":
        strided = torch.zeros(3, 40, 24)[..., 4:20]
        strided.copy_(table)
    else:
        strided = torch.zeros(40, 3, 16).transpose(0, 1)
        strided.copy_(table)
    got = typedkv.materialize_kv(
        inp.kv, inp.k_norm_weight, 1e-6, strided, inp.positions, num_kv_heads=2, rope_style="gptj"
    )
    want = typedkv.materialize_kv(
        inp.kv, inp.k_norm_weight, 1e-6, table.contiguous(), inp.positions, num_kv_heads=2, rope_style="gptj"
    )
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b, view)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pool_layouts_match_dense(layout: str) -> None:
    """Every pool layout (stacked, per layer, paged NHD and HND) holds the dense op's rows at its slots."""
    inp = make_inputs(6, 3, 2, 16, 8, torch.bfloat16, "neox", seed=_seed("tables", layout), layer_tables=True)
    cache_loc = slots_for(6, 11, seed=_seed("tables", layout, "slots"))
    run_pool(inp, cache_loc, LAYOUTS[layout], torch.bfloat16, 11).check()


@pytest.mark.parametrize("layout", ["stacked", "list_views", "paged_nhd", "flashinfer_hnd"])
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_fp8_pools(pool_dtype: torch.dtype, layout: str) -> None:
    """FP8 pools with per-layer scales: ``saturate(k / scale)`` of the float32 K of each layer's own table."""
    inp = make_inputs(6, 3, 2, 32, 16, torch.float16, seed=_seed("tables-fp8", layout), layer_tables=True)
    cache_loc = slots_for(6, 11, seed=_seed("tables-fp8", layout, "slots"))
    k_scale, v_scale = torch.tensor([0.02, 0.7, 3.0]), torch.tensor([1.5, 0.25, 0.1])
    run_pool(inp, cache_loc, LAYOUTS[layout], pool_dtype, 11, k_scale=k_scale, v_scale=v_scale).check()


# --------------------------------------------------------------------- MLA


def _mla_inputs(dtype: torch.dtype, rope_style: RopeStyle, *, norm: bool = True) -> test_mla.Inputs:
    inputs = test_mla.make_inputs(6, 3, 32, 16, dtype, rope_style, norm=norm)
    return test_mla.Inputs(
        inputs.ckv, inputs.kv_norm_weight, inputs.eps, tables(3, 40, 16, _seed("mla", dtype)), inputs.positions,
        rope_style,
    )  # fmt: skip


@pytest.mark.parametrize("rope_style", ["gptj", "neox"])
@pytest.mark.parametrize("dtype", STORAGE, ids=str)
def test_mla_dense(dtype: torch.dtype, rope_style: RopeStyle) -> None:
    """MLA rows: each layer the one-layer call with its own table, bit for bit, and the float64 oracle's."""
    inputs = _mla_inputs(dtype, rope_style)
    out = inputs.dense()
    test_mla.assert_close_to_oracle(out, inputs)
    weight = inputs.kv_norm_weight
    assert weight is not None
    for layer in range(3):
        one = typedkv.materialize_mla_kv(
            inputs.ckv[:, layer : layer + 1], weight[layer : layer + 1], inputs.eps, inputs.cos_sin_cache[layer],
            inputs.positions, rope_style=rope_style,
        )  # fmt: skip
        assert_bitwise_equal(out[layer], one[0], f"layer {layer}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(test_mla.LAYOUTS))
def test_mla_pools(layout: str, mode: str) -> None:
    """Every MLA pool layout holds the dense op's rows at its slots; nothing else of the allocation changes."""
    inputs = _mla_inputs(torch.bfloat16, "gptj")
    cache_loc = test_mla._slots(6, 13, _seed("mla-tables", layout))
    cache_loc[2] = -1
    test_mla.run_pool(inputs, layout, cache_loc, 13)


@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_mla_fp8_pool(pool_dtype: torch.dtype) -> None:
    inputs = _mla_inputs(torch.bfloat16, "neox")
    test_mla.run_pool(inputs, "vllm", test_mla._slots(6, 11, 2), 11, pool_dtype, torch.tensor([0.5, 2.0, 0.01]))


@pytest.mark.parametrize("layout", ["stacked", "vllm", "sglang"])
def test_mla_fp8_ds_pools(layout: str) -> None:
    """DeepSeek's FP8 rows (``cache_format="fp8_ds_mla"``) with a table per layer: vLLM's entries of the dense op's
    rows, typedkv's reference bit for bit, and the float64 oracle's (tests/test_mla_fp8_ds.py's checks)."""
    inputs = test_mla_fp8_ds.ds_inputs(6, 3, torch.bfloat16, "gptj")
    inputs = test_mla.Inputs(
        inputs.ckv, inputs.kv_norm_weight, inputs.eps, tables(3, 40, 64, _seed("ds", layout)), inputs.positions,
        "gptj",
    )  # fmt: skip
    rows = test_mla_fp8_ds.vllm_rows_of(inputs)
    assert rows.equal(test_mla_fp8_ds.reference_rows(inputs))
    test_mla_fp8_ds.assert_ds_rows_close_to_oracle(rows, inputs)
    cache_loc = test_mla._slots(6, 11, _seed("ds-slots", layout))
    cache_loc[2] = -1
    test_mla_fp8_ds.run_ds_pool(inputs, layout, cache_loc, 11, rows)


# ------------------------------------------------------------ materializers


L, H, D, HIDDEN, P = 3, 2, 16, 24, 64


@pytest.mark.parametrize("path", ["gemm", "fused"])
def test_kv_materializer(path: str) -> None:
    """`KVMaterializer` with ``[L, P, R]`` (and a V norm): GEMM + kernel is the op on its GEMM's output, bit for
    bit; both paths' K is the oracle's (weights on a grid: an exact GEMM); into a pool, the rows returned."""
    draft = Draft(torch.float16, head_dim=D, rotary_dim=8, rope_style="gptj")
    per_layer = tables(L, P, 8, 9)
    m = typedkv.KVMaterializer(
        draft.weight.half(), draft.norm, 1e-6, per_layer, num_kv_heads=H, rope_style="gptj", v_norm_weight=draft.norm
    )
    m.projection_path = path  # type: ignore[assignment]
    x, positions = draft.call(5)
    got = m(x, positions)
    if path == "gemm":  # the op on the materializer's GEMM, bit for bit
        kv = F.linear(x, m.kv_weight).view(5, L, 2 * H * D)
        want = typedkv.materialize_kv(
            kv, draft.norm, 1e-6, per_layer, positions, num_kv_heads=H, rope_style="gptj", v_norm_weight=draft.norm
        )
        for a, b in zip(got, want, strict=True):
            assert_bitwise_equal(a, b, "gemm")
    kv = torch.einsum("th,lnh->tln", x.double(), draft.weight).half()  # the exact GEMM, rounded
    ref_k, _ = materialize_kv64(kv, draft.norm, 1e-6, per_layer, positions, H, "gptj")
    assert_matches_oracle((got[0], got[1]), (ref_k, got[1]), torch.float16)
    cache_loc = torch.tensor([6, -1, 0, 3, 1])
    k_pool, v_pool = torch.zeros(L, 8, H, D).half(), torch.zeros(L, 8, H, D).half()
    m.into_pool(x, positions, cache_loc, k_pool, v_pool)
    kept = cache_loc >= 0
    assert torch.equal(k_pool[:, cache_loc[kept]], got[0][:, kept])
    assert torch.equal(v_pool[:, cache_loc[kept]], got[1][:, kept])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_kv_materializer_fused_matches_oracle(rope_style: RopeStyle, dtype: torch.dtype) -> None:
    """Both paths read each layer's table (partial rotary: the fused kernel's pass-through third accumulator)."""
    draft = Draft(dtype, head_dim=24, rotary_dim=8, rope_style=rope_style, layer_tables=True)
    assert draft.cos_sin_cache.shape == (L, P, 8)
    x, positions = draft.call(5)
    for path in ("fused", "gemm"):
        draft.m.projection_path = path
        assert_matches_oracle(draft.m(x, positions), draft.oracle(x, positions), dtype)


def test_mla_materializer() -> None:
    """`MLAKVMaterializer` with ``[L, P, R]``: the MLA op on the GEMM's output, bit for bit."""
    g = torch.Generator().manual_seed(11)
    C, R = 32, 16
    weight, norm = torch.randn(L, C + R, HIDDEN, generator=g), torch.rand(L, C, generator=g) + 0.5
    per_layer = tables(L, P, R, 12)
    m = typedkv.MLAKVMaterializer(weight, norm, 1e-6, per_layer, rope_style="gptj")
    hidden, positions = torch.randn(4, HIDDEN, generator=g), torch.randint(0, P, (4,), generator=g)
    ckv = F.linear(hidden, weight.reshape(-1, HIDDEN)).view(4, L, C + R)
    want = typedkv.materialize_mla_kv(ckv, norm, 1e-6, per_layer, positions, rope_style="gptj")
    assert_bitwise_equal(m(hidden, positions), want, "mla")
    ref = materialize_mla_kv64(ckv, norm, 1e-6, per_layer, positions, "gptj")
    assert float((want.double() - ref).abs().max()) < 1e-4
    pool = torch.zeros(L, 9, C + R)
    cache_loc = torch.tensor([8, 2, -1, 0])
    m.into_pool(hidden, positions, cache_loc, pool)
    kept = cache_loc >= 0
    assert torch.equal(pool[:, cache_loc[kept]], want[:, kept])


@pytest.mark.usefixtures("fresh_compile")
def test_compiled() -> None:
    """Under torch.compile (one op per call; a table of any rank is a Tensor in the schema): the eager bits."""
    inp = make_inputs(5, 3, 2, 16, 16, torch.bfloat16, seed=8, layer_tables=True)
    mla = _mla_inputs(torch.bfloat16, "gptj")

    def fn(kv: Tensor, ckv: Tensor) -> tuple[Tensor, Tensor]:
        k, _ = typedkv.materialize_kv(kv, inp.k_norm_weight, 1e-6, inp.cos_sin_cache, inp.positions, num_kv_heads=2)
        rows = typedkv.materialize_mla_kv(
            ckv, mla.kv_norm_weight, 1e-6, mla.cos_sin_cache, mla.positions, rope_style="gptj"
        )
        return k, rows

    got = torch.compile(fn, fullgraph=True)(inp.kv, mla.ckv)
    want = fn(inp.kv, mla.ckv)
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b, "compiled")


# ------------------------------------------------------------------- misuse


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["dense", "pool", "mla", "mla_pool"])
def test_table_for_other_layers_is_rejected(op: str, mode: str) -> None:
    """A table per layer for another number of layers names cos_sin_cache and where L comes from; nothing written."""
    inp = make_inputs(4, 3, 2, 16, 16, torch.bfloat16, seed=2)
    wrong = tables(2, 40, 16, 1)
    message = r"^cos_sin_cache: expected shape \(L=3, P, R\), got \(2, 40, 16\): L=3 comes from "
    if op.startswith("mla"):
        ckv = torch.randn(4, 3, 48).bfloat16()
        pool = torch.full((3, 6, 48), 7.0).bfloat16()
        with pytest.raises(typedkv.InputError, match=message + "ckv$"):
            if op == "mla":
                typedkv.materialize_mla_kv(ckv, None, 1e-6, wrong, inp.positions, rope_style="gptj")
            else:
                typedkv.materialize_mla_kv_into_pool(
                    ckv, None, 1e-6, wrong, inp.positions, torch.tensor([0, 1, 2, 3]), pool, rope_style="gptj"
                )
        assert bool((pool.float() == 7.0).all())
        return
    k_pool, v_pool = torch.full((3, 6, 2, 16), 7.0).bfloat16(), torch.full((3, 6, 2, 16), 7.0).bfloat16()
    with pytest.raises(typedkv.InputError, match=message + "kv$"):
        if op == "dense":
            typedkv.materialize_kv(inp.kv, inp.k_norm_weight, 1e-6, wrong, inp.positions, num_kv_heads=2)
        else:
            typedkv.materialize_kv_into_pool(
                inp.kv, inp.k_norm_weight, 1e-6, wrong, inp.positions, torch.tensor([0, 1, 2, 3]), k_pool, v_pool,
                num_kv_heads=2,
            )  # fmt: skip
    assert bool((k_pool.float() == 7.0).all()) and bool((v_pool.float() == 7.0).all())


def test_table_of_another_rank_is_rejected() -> None:
    """Neither [P, R] nor [L, P, R]: both shapes are offered, L bound."""
    inp = make_inputs(4, 3, 2, 16, 16, torch.bfloat16, seed=2)
    with pytest.raises(
        typedkv.InputError, match=r"^cos_sin_cache: expected shape \(P, R\) or \(L=3, P, R\), got \(1, 3, 40, 16\)$"
    ):
        typedkv.materialize_kv_into_pool(
            inp.kv, inp.k_norm_weight, 1e-6, inp.cos_sin_cache.expand(1, 3, 40, 16), inp.positions,
            torch.tensor([0, 1, 2, 3]), torch.zeros(3, 6, 2, 16).bfloat16(), torch.zeros(3, 6, 2, 16).bfloat16(),
            num_kv_heads=2,
        )  # fmt: skip


@pytest.mark.parametrize("cls", ["kv", "mla"])
def test_materializer_table_for_other_layers(cls: str) -> None:
    """The materializers name cos_sin_cache and the weight's layer count (whatever else binds L)."""
    g = torch.Generator().manual_seed(0)
    wrong = tables(2, P, 16, 1)
    message = r"^cos_sin_cache: expected L=3 layers \({} has 3\), got 2$"
    if cls == "kv":
        with pytest.raises(typedkv.InputError, match=message.format("kv_weight")):
            typedkv.KVMaterializer(torch.randn(L, 2 * H * D, HIDDEN, generator=g), None, 1e-6, wrong, num_kv_heads=H)
    else:
        with pytest.raises(typedkv.InputError, match=message.format("kv_a_weight")):
            typedkv.MLAKVMaterializer(torch.randn(L, 48, HIDDEN, generator=g), None, 1e-6, wrong, rope_style="gptj")


def test_replaced_table_buffer_is_checked() -> None:
    """A table buffer replaced after construction by one for other layers is rejected at the next call."""
    g = torch.Generator().manual_seed(0)
    m = typedkv.KVMaterializer(
        torch.randn(L, 2 * H * D, HIDDEN, generator=g), None, 1e-6, tables(L, P, 16, 1), num_kv_heads=H
    )
    m.cos_sin_cache = tables(L + 1, P, 16, 2)
    with pytest.raises(typedkv.InputError, match=r"^cos_sin_cache: expected shape \(L=3, P, R\), got \(4, 64, 16\)"):
        m(torch.randn(2, HIDDEN), torch.tensor([0, 1]))


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "stacked", "list_separate", "paged_hnd"])
@pytest.mark.parametrize("num_tokens", [3, 300, 5000], ids=["T3", "T300", "T5000"])
@pytest.mark.parametrize(("rotary_dim", "rope_style"), [(128, "neox"), (64, "neox"), (64, "gptj")])
def test_cuda_kernels(rope_style: RopeStyle, rotary_dim: int, num_tokens: int, layout: str) -> None:
    """The K/V kernel on CUDA (split and one-program launches, K in pieces and as one tile): each layer the
    one-layer call with its table; pools the dense rows.

    A one-layer call has a third of the programs, and below 1024 split programs each takes 8 warps instead
    of 4 (T = 300): its float32 sums of squares then add in another order, so a layer is held to the
    one-layer call within the K tolerance, not bit for bit (another layer's table is far outside it)."""
    inp = make_inputs(num_tokens, 3, 8, 128, rotary_dim, torch.bfloat16, rope_style, num_positions=4096,
                      seed=_seed("cuda-tables", num_tokens), layer_tables=True)  # fmt: skip
    assert inp.k_norm_weight is not None
    kv, weight, cache, positions = (t.cuda() for t in (inp.kv, inp.k_norm_weight, inp.cos_sin_cache, inp.positions))
    k, _ = typedkv.materialize_kv(kv, weight, 1e-6, cache, positions, num_kv_heads=8, rope_style=rope_style)
    for layer in (0, 2):
        one, _ = typedkv.materialize_kv(
            kv[:, layer : layer + 1], weight[layer : layer + 1], 1e-6, cache[layer], positions, num_kv_heads=8,
            rope_style=rope_style,
        )  # fmt: skip
        assert_k_close(k[layer].cpu(), one[0].cpu().double(), rotary_dim, rope_style)
    ref_k, _ = materialize_kv64(inp.kv, inp.k_norm_weight, 1e-6, inp.cos_sin_cache, inp.positions, 8, rope_style)
    assert_k_close(k.cpu(), ref_k, rotary_dim, rope_style)
    if layout == "dense":
        return
    slots = torch.randperm(num_tokens + 7)[:num_tokens].cuda()
    pools = LAYOUTS[layout]
    k_pool, v_pool = pools.view([b.cuda() for b in pools.alloc(3, num_tokens + 7, 8, 128, torch.bfloat16)], 8, 128)
    typedkv.materialize_kv_into_pool(
        kv, weight, 1e-6, cache, positions, slots, k_pool, v_pool, num_kv_heads=8, rope_style=rope_style,
        kv_layout="HND" if pools.kv_layout == "HND" else "NHD",
    )  # fmt: skip
    # The pool op is a kernel of its own: a normed value's float32 sum may add in another order than the
    # dense op's (docs/concepts.md, Numerics), so the rows are held to the oracle, not to the dense bits.
    assert_k_close(pool_rows(k_pool, pools)[:, slots].cpu(), ref_k, rotary_dim, rope_style)


@pytest.mark.gpu
def test_cuda_warp_specialised_kernel_takes_one_table() -> None:
    """The warp-specialised kernel reads one table: a table per layer is not launchable there (the fused
    path's Triton kernel takes it)."""
    from typedkv.projection import warp_specialized

    hidden = torch.zeros(2048, 512, dtype=torch.bfloat16, device="cuda")
    weight = torch.zeros(2 * 2 * 2 * 128, 512, dtype=torch.bfloat16, device="cuda")
    one, per_layer = torch.zeros(64, 128, device="cuda"), torch.zeros(2, 64, 128, device="cuda")
    geometry: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 128, "neox": True}
    if not warp_specialized.launchable(hidden, weight, None, one, None, None, **geometry):
        pytest.skip("the warp-specialised kernel runs on sm_90 under Triton 3.6 only")
    assert not warp_specialized.launchable(hidden, weight, None, per_layer, None, None, **geometry)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "stacked", "sglang"])
def test_cuda_mla(layout: str) -> None:
    """The MLA kernel on CUDA (DeepSeek's C = 512, R = 64): each layer the one-layer call with its table."""
    inputs = test_mla.make_inputs(40, 3, 512, 64, torch.bfloat16, "gptj", num_positions=4096)
    inputs = test_mla.Inputs(
        inputs.ckv, inputs.kv_norm_weight, inputs.eps, tables(3, 4096, 64, 3), inputs.positions, "gptj"
    ).to("cuda")
    out = inputs.dense()
    test_mla.assert_close_to_oracle(out, inputs)
    for layer in range(3):
        one = typedkv.materialize_mla_kv(
            inputs.ckv[:, layer : layer + 1], inputs.kv_norm_weight[layer : layer + 1],  # type: ignore[index]
            inputs.eps, inputs.cos_sin_cache[layer], inputs.positions, rope_style="gptj",
        )  # fmt: skip
        assert_bitwise_equal(out[layer].cpu(), one[0].cpu(), f"layer {layer}")
    if layout != "dense":
        test_mla.run_pool(inputs, layout, test_mla._slots(40, 64, 4).cuda(), 64)


@pytest.mark.gpu
@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("num_tokens", [1, 16, 100], ids=["T1", "T16", "T100"])
@pytest.mark.parametrize(("rotary_dim", "rope_style"), [(128, "neox"), (64, "neox"), (64, "gptj")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_fused_projection(dtype: torch.dtype, rotary_dim: int, rope_style: RopeStyle, num_tokens: int) -> None:
    """The fused projection on CUDA, its weight tiles by pointer and by TMA (NeoX heads of 128): K of each layer
    from its own table, against the oracle."""
    draft = Draft(dtype, head_dim=128, rotary_dim=rotary_dim, rope_style=rope_style, hidden=256, layer_tables=True)
    draft.m.to("cuda")
    draft.m.projection_path = "fused"
    x, positions = draft.call(num_tokens)
    got = draft.m(x.cuda(), positions.cuda())
    assert_matches_oracle((got[0].cpu(), got[1].cpu()), draft.oracle(x, positions), dtype)
