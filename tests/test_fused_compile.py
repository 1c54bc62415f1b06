"""The fused projection path under torch.compile: one op per call (``torch.ops.typedkv.project_kv_*``).

With the fused path pinned, a compiled `KVMaterializer` call is one op that runs
the fused kernel (no GEMM in the graph), checked while tracing with the eager
message. Under ``TRITON_INTERPRET=1`` the op runs the kernel itself; on plain
CPU the materializer takes GEMM + kernel (no kernel to fuse into), so the
graph holds the GEMM and the K/V op, and the fused ops are exercised directly
(`test_opcheck`, whose real implementation then falls back to GEMM + reference).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_compile import graph_ops
from test_fused_projection import Draft, H, L, assert_matches_oracle
from torch import Tensor

import typedkv
from typedkv.core import launcher
from typedkv.projection import paths

INTERPRETED = launcher.INTERPRETED

pytestmark = [
    pytest.mark.usefixtures("fresh_compile"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled"),
]

FUSED_OPS = {op._opoverload for op in (*paths.FUSED_OPS.ops, *paths.FUSED_POOL_OPS.ops)}


def pinned(**kw: Any) -> Draft:
    draft = Draft(torch.float16, rotary_dim=8, bias=True, **kw)
    draft.m.projection_path = "fused"
    return draft


def test_compiled_dense() -> None:
    """A compiled call with the fused path pinned gives the oracle's K/V, as the eager call does."""
    draft = pinned()
    x, positions = draft.call(5)
    got = torch.compile(draft.m, fullgraph=True)(x, positions)
    assert_matches_oracle(got, draft.oracle(x, positions), torch.float16)
    eager = draft.m(x, positions)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])


def test_compiled_graph_is_one_op() -> None:
    """Compiled with the fused path pinned: one fused op and no GEMM (on plain CPU: the GEMM and the K/V op)."""
    draft = pinned()
    targets = graph_ops(draft.m, *draft.call(4))
    ours = [t for t in targets if t in FUSED_OPS]
    if INTERPRETED:
        assert ours == [torch.ops.typedkv.project_kv_out.default]
        assert torch.nn.functional.linear not in targets
    else:
        assert not ours and torch.nn.functional.linear in targets
    assert draft.m._workspace is None


@pytest.mark.parametrize("listed", [False, True], ids=["stacked", "list"])
def test_compiled_into_pool(listed: bool) -> None:
    """into_pool compiled with the fused path pinned, stacked or per-layer pools: the eager rows, nothing else."""
    draft = pinned(rope_style="gptj")
    x, positions = draft.call(5)
    cache_loc = torch.tensor([3, -1, 0, 7, 5])
    want_k, want_v = draft.m(x, positions)

    def into_pool(x: Tensor, k_pool: Any, v_pool: Any) -> None:
        draft.m.into_pool(x, positions, cache_loc, k_pool, v_pool)

    # Separate allocations: views of one allocation are copied around the op by inductor (typedkv.core.torch_ops).
    k_layers = [torch.zeros(8, H, 16, dtype=torch.float16) for _ in range(L)]
    v_layers = [torch.zeros(8, H, 16, dtype=torch.float16) for _ in range(L)]
    k_pool, v_pool = torch.zeros(L, 8, H, 16, dtype=torch.float16), torch.zeros(L, 8, H, 16, dtype=torch.float16)
    pools: tuple[Any, Any] = (k_layers, v_layers) if listed else (k_pool, v_pool)
    targets = graph_ops(into_pool, x, *pools)
    if INTERPRETED:
        name = "project_kv_into_pool_list" if listed else "project_kv_into_pool_stacked"
        assert [t for t in targets if t in FUSED_OPS] == [getattr(torch.ops.typedkv, name).default]
    kept = cache_loc >= 0
    for t in (k_pool, v_pool, *k_layers, *v_layers):
        t.zero_()
    torch.compile(into_pool, fullgraph=True)(x, *pools)
    if listed:
        k_pool, v_pool = torch.stack(k_layers), torch.stack(v_layers)
    assert torch.equal(k_pool[:, cache_loc[kept]], want_k[:, kept])
    assert torch.equal(v_pool[:, cache_loc[kept]], want_v[:, kept])
    assert not k_pool[:, [1, 2, 4, 6]].any() and not v_pool[:, [1, 2, 4, 6]].any()


@pytest.mark.skipif(not INTERPRETED, reason="plain CPU compiles the GEMM path (tests/test_compile.py)")
def test_misuse_rejected_while_tracing() -> None:
    """Misuse in compiled code fails while tracing, with the eager InputError message."""
    draft = pinned()
    x, positions = draft.call(5)
    fp32_pool = torch.zeros(L, 8, H, 16)

    def short_positions() -> object:
        return draft.m(x, positions[:3])

    def pool_dtype() -> None:
        draft.m.into_pool(x, positions, torch.arange(5), fp32_pool, fp32_pool.clone())

    def scale_on_fp16() -> None:
        pool = fp32_pool.half()
        draft.m.into_pool(x, positions, torch.arange(5), pool, pool.clone(), k_scale=0.5)

    for call in (short_positions, pool_dtype, scale_on_fp16):
        with pytest.raises(typedkv.InputError) as info:
            call()
        torch._dynamo.reset()
        with pytest.raises(Exception) as traced:
            torch.compile(call, fullgraph=True)()
        assert str(info.value) in str(traced.value), call.__name__


# The fused ops' schemas: the projection's arguments in kv's place, then the public function's
# (typedkv.projection.fused.declaration reads them from materialize_kv / materialize_kv_into_pool).
SCHEMAS = """
typedkv::project_kv_out(Tensor hidden, Tensor kv_weight, Tensor? kv_bias, SymInt num_layers, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, Tensor(a12!) k_out, Tensor(a13!) v_out) -> ()
typedkv::project_kv_into_pool_stacked(Tensor hidden, Tensor kv_weight, Tensor? kv_bias, SymInt num_layers, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, Tensor cache_loc, Tensor(a10!) k_pool, Tensor(a11!) v_pool, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, float? k_scale_value, Tensor? k_scale_tensor, float? v_scale_value, Tensor? v_scale_tensor, Tensor(a17!)? k_scale_out, Tensor(a18!)? v_scale_out, str? kv_layout) -> ()
typedkv::project_kv_into_pool_list(Tensor hidden, Tensor kv_weight, Tensor? kv_bias, SymInt num_layers, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, Tensor cache_loc, Tensor(a10!)[] k_pool, Tensor(a11!)[] v_pool, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, float? k_scale_value, Tensor? k_scale_tensor, float? v_scale_value, Tensor? v_scale_tensor, Tensor(a17!)[]? k_scale_out, Tensor(a18!)[]? v_scale_out, str? kv_layout) -> ()
"""


def test_schemas() -> None:
    ops = [*paths.FUSED_OPS.ops, *paths.FUSED_POOL_OPS.ops]
    assert "\n".join(str(op._opoverload._schema) for op in ops) == SCHEMAS.strip()


def test_op_signatures_follow_the_public_functions() -> None:
    """A fused op's parameters: the projection's (the bundle's first part), then the public function's after kv.

    The ops rebuild the call by position: the projection bundle and the public function's bundle.
    """
    import inspect

    from typedkv.kv import api as kv_api
    from typedkv.kv import impl as kv_impl
    from typedkv.projection.fused import FUSED, FUSED_POOL, Projection

    for fused, public, op, call in (
        (FUSED, kv_api.materialize_kv, kv_impl.DENSE, kv_impl.DenseCall),
        (FUSED_POOL, kv_api.materialize_kv_into_pool, kv_impl.POOL, kv_impl.PoolCall),
    ):
        params = list(inspect.signature(public).parameters)
        assert op.call is call and call._fields == tuple(params)
        assert fused.signature.parameters == [*Projection._fields, *params[1:]]
        # Each of the public function's parameters keeps its annotation (read anew: compared as written).
        assert all(repr(fused.signature.hints[name]) == repr(op.signature.hints[name]) for name in params[1:])


def test_opcheck() -> None:
    """torch.library.opcheck on the fused ops: schema (mutations as declared), fake tensors, AOT dispatch."""
    draft = pinned()
    m = draft.m
    x, positions = draft.call(3)
    (dense,) = paths.FUSED_OPS.ops
    stacked, listed = paths.FUSED_POOL_OPS.ops
    head = (x, m.kv_weight, m.kv_bias, L, m.k_norm_weight, 1e-6, None, m.cos_sin_cache, positions)
    out = torch.empty(L, 3, H, 16, dtype=torch.float16)
    torch.library.opcheck(dense, (*head, H, "neox", None, out, out.clone()))
    cache_loc = torch.tensor([4, -1, 0])
    pool = torch.zeros(L, 8, H, 16, dtype=torch.float16)
    # v_norm_weight, K's and V's scales, the scales written per row, kv_layout.
    tail = (None, None, None, None, None, None, None, "NHD")
    torch.library.opcheck(stacked, (*head, cache_loc, pool, pool.clone(), H, "gptj", *tail))
    torch.library.opcheck(listed, (*head, cache_loc, list(pool.clone()), list(pool.clone()), H, "neox", *tail))
    # int8 pools with their scales written per row, V normed too.
    int8 = torch.zeros(L, 8, H, 16, dtype=torch.int8)
    scales = torch.zeros(L, 8, H)
    written = (torch.randn(L, 16), None, None, None, None, scales, scales.clone(), "NHD")
    torch.library.opcheck(stacked, (*head, cache_loc, int8, int8.clone(), H, "neox", *written))


def test_changing_sizes_compile_dynamic() -> None:
    """A loop over T (a dynamic T after the first recompile): every size gives the eager bits."""
    draft = pinned()
    run = torch.compile(draft.m, fullgraph=True)
    for num_tokens in (2, 3, 4, 17):
        x, positions = draft.call(num_tokens, seed=num_tokens)
        for got, want in zip(run(x, positions), draft.m(x, positions), strict=True):
            assert torch.equal(got, want)
