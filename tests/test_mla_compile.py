"""torch.compile and the registered MLA ops (``torch.ops.typedkv.materialize_mla_*``), on CPU.

As tests/test_compile.py for the K/V ops: compiled with ``fullgraph=True`` the
MLA ops are one opaque op each, give the eager bits and write pools in place;
misuse is rejected while tracing with the eager message; ``opcheck`` passes.
Also run under ``TRITON_INTERPRET=1`` (tiny shapes).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from test_compile import compiled, graph_ops
from torch import Tensor

import typedkv
from typedkv.mla import api as mla_api
from typedkv.mla import impl as mla_impl

pytestmark = [
    pytest.mark.usefixtures("fresh_compile"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled"),
]

T, L, C, R, P, S = 3, 2, 16, 8, 32, 11
MLA_OPS = {
    torch.ops.typedkv.materialize_mla_kv_out.default,
    torch.ops.typedkv.materialize_mla_kv_into_pool_stacked.default,
    torch.ops.typedkv.materialize_mla_kv_into_pool_list.default,
}

g = torch.Generator().manual_seed(0)
CKV = torch.randn(T, L, C + R, generator=g)
WEIGHT = torch.rand(L, C, generator=g) + 0.5
EPS = torch.tensor([1e-6, 1e-2])
CACHE = torch.randn(P, R, generator=g)
POSITIONS = torch.tensor([4, 0, 31])
CACHE_LOC = torch.tensor([7, -1, 2])


def test_dense_compiled() -> None:
    def fn(ckv: Tensor, positions: Tensor) -> Tensor:
        return typedkv.materialize_mla_kv(ckv, WEIGHT, 1e-6, CACHE, positions, rope_style="gptj") * 2

    assert torch.equal(compiled(fn)(CKV, POSITIONS), fn(CKV, POSITIONS))
    assert [op for op in graph_ops(fn, CKV, POSITIONS) if op in MLA_OPS] == [
        torch.ops.typedkv.materialize_mla_kv_out.default
    ]


def test_eps_sequence_compiled() -> None:
    def fn(ckv: Tensor) -> Tensor:
        return typedkv.materialize_mla_kv(ckv, WEIGHT, [1e-6, 1e-2], CACHE, POSITIONS, rope_style="gptj")

    assert torch.equal(compiled(fn)(CKV), fn(CKV))


def test_dense_into_given_out_compiled() -> None:
    def fn(ckv: Tensor, slab: Tensor) -> Tensor:
        return typedkv.materialize_mla_kv(ckv, None, EPS, CACHE, POSITIONS, rope_style="neox", out=slab[:, :T])

    slab, want = torch.full((L, 5, C + R), 7.0), torch.full((L, 5, C + R), 7.0)
    got = compiled(fn)(CKV, slab)
    fn(CKV, want)
    assert torch.equal(slab, want) and torch.equal(got, want[:, :T])


@pytest.mark.parametrize("layout", ["stacked", "paged", "list", "sglang"])
def test_pool_compiled(layout: str) -> None:
    def make() -> Tensor | list[Tensor]:
        if layout == "stacked":
            return torch.zeros(L, S, C + R)
        if layout == "paged":
            return torch.zeros(L, 3, 4, C + R)
        if layout == "list":
            return [torch.zeros(S, C + R) for _ in range(L)]
        return [torch.zeros(S, 1, C + R) for _ in range(L)]

    def fn(ckv: Tensor, pool: Tensor | list[Tensor]) -> None:
        typedkv.materialize_mla_kv_into_pool(ckv, WEIGHT, EPS, CACHE, POSITIONS, CACHE_LOC, pool, rope_style="gptj")

    got, want = make(), make()
    compiled(fn)(CKV, got)
    fn(CKV, want)
    for a, b in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want], strict=True):
        assert torch.equal(a, b) and bool(a.any())


DS_CKV = torch.randn(T, L, 512 + 64, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["stacked", "paged", "list", "sglang"])
def test_ds_mla_pool_compiled(layout: str) -> None:
    """DeepSeek's FP8 rows (cache_format="fp8_ds_mla") through the traced op: the eager bytes, in place."""
    weight, cache = torch.rand(L, 512) + 0.5, torch.randn(P, 64)

    def make() -> Tensor | list[Tensor]:
        shape = {"stacked": (L, S, 656), "paged": (L, 3, 4, 656), "list": (S, 656), "sglang": (S, 1, 656)}[layout]
        if layout in ("stacked", "paged"):
            return torch.zeros(shape, dtype=torch.uint8)
        return [torch.zeros(shape, dtype=torch.uint8) for _ in range(L)]

    def fn(ckv: Tensor, pool: Tensor | list[Tensor]) -> None:
        typedkv.materialize_mla_kv_into_pool(
            ckv, weight, EPS, cache, POSITIONS, CACHE_LOC, pool, rope_style="gptj", cache_format="fp8_ds_mla"
        )

    got, want = make(), make()
    compiled(fn)(DS_CKV, got)
    fn(DS_CKV, want)
    for a, b in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want], strict=True):
        assert torch.equal(a, b) and bool(a.any())


def test_misuse_rejected_while_tracing() -> None:
    wrong_norm = torch.ones(L, C + 2)
    fp16_pool = torch.zeros(L, S, C + R, dtype=torch.float16)
    ds_pool = torch.zeros(L, S, 656, dtype=torch.uint8)

    def dense() -> object:
        return typedkv.materialize_mla_kv(CKV, wrong_norm, 1e-6, CACHE, POSITIONS, rope_style="gptj")

    def pool() -> None:
        typedkv.materialize_mla_kv_into_pool(
            CKV, WEIGHT, 1e-6, CACHE, POSITIONS, CACHE_LOC, fp16_pool, rope_style="gptj"
        )

    def ds_geometry() -> None:  # C = 16, R = 8: not DeepSeek's rows
        typedkv.materialize_mla_kv_into_pool(
            CKV, WEIGHT, 1e-6, CACHE, POSITIONS, CACHE_LOC, ds_pool, rope_style="gptj", cache_format="fp8_ds_mla"
        )

    for call in (dense, pool, ds_geometry):
        with pytest.raises(typedkv.InputError) as eager:
            call()
        torch._dynamo.reset()
        with pytest.raises(Exception) as traced:
            compiled(call)()
        assert str(eager.value) in str(traced.value), call.__name__


def test_schemas() -> None:
    """The ops' schemas, derived from the annotations: what torch.compile and CUDA graphs see."""
    schemas = {str(op._opoverload._schema) for ops in (mla_api.DENSE_OPS, mla_api.POOL_OPS) for op in ops.ops}
    common = "Tensor ckv, Tensor? kv_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions"
    assert schemas == {
        f"typedkv::materialize_mla_kv_out({common}, str rope_style, Tensor(a7!) out) -> ()",
        f"typedkv::materialize_mla_kv_into_pool_stacked({common}, Tensor cache_loc, Tensor(a7!) kv_pool, "
        "str rope_style, float? kv_scale_value, Tensor? kv_scale_tensor, str cache_format) -> ()",
        f"typedkv::materialize_mla_kv_into_pool_list({common}, Tensor cache_loc, Tensor(a7!)[] kv_pool, "
        "str rope_style, float? kv_scale_value, Tensor? kv_scale_tensor, str cache_format) -> ()",
    }


def test_call_bundles_follow_the_signatures() -> None:
    """The call bundles the public functions build by position have the signatures' parameters, in order."""
    for fn, call in (
        (typedkv.materialize_mla_kv, mla_impl.DenseCall),
        (typedkv.materialize_mla_kv_into_pool, mla_impl.PoolCall),
    ):
        assert call._fields == tuple(inspect.signature(fn).parameters), fn.__name__


def test_opcheck() -> None:
    (dense,) = mla_api.DENSE_OPS.ops
    stacked, listed = mla_api.POOL_OPS.ops
    torch.library.opcheck(dense, (CKV, WEIGHT, 1e-6, None, CACHE, POSITIONS, "neox", torch.empty(L, T, C + R)))
    torch.library.opcheck(
        stacked,
        (CKV, None, None, EPS, CACHE, POSITIONS, CACHE_LOC, torch.zeros(L, S, C + R), "gptj", None, None, "plain"),
    )
    pools = [torch.zeros(S, C + R) for _ in range(L)]
    torch.library.opcheck(
        listed, (CKV, WEIGHT, None, EPS, CACHE, POSITIONS, CACHE_LOC, pools, "neox", None, None, "plain")
    )
    ckv, weight, cache = DS_CKV, torch.rand(L, 512, generator=g) + 0.5, torch.randn(P, 64, generator=g)
    ds_pools = [torch.zeros(S, 1, 656, dtype=torch.uint8) for _ in range(L)]
    torch.library.opcheck(
        listed, (ckv, weight, None, EPS, cache, POSITIONS, CACHE_LOC, ds_pools, "gptj", None, None, "fp8_ds_mla")
    )
