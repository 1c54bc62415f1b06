"""torch.compile and the registered ops (``torch.ops.typedkv.*``), on CPU.

Code that calls ``materialize_kv``, ``materialize_kv_into_pool`` or a
``KVMaterializer`` compiles with ``fullgraph=True`` (no graph break), runs the
same op and gives the eager bits; misuse is rejected while tracing with the
eager message; ``torch.library.opcheck`` passes on every op. The file also
runs under ``TRITON_INTERPRET=1``: the compiled graph then calls the Triton
kernel under its interpreter, so shapes are tiny.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor
from torch._inductor.utils import run_and_get_code

import typedkv
from typedkv.core import torch_ops
from typedkv.kv import api as kv_api
from typedkv.kv import impl as kv_impl

# Noise from torch itself: inductor's imports, and the note that caches are off (see conftest's fresh_compile).
pytestmark = [
    pytest.mark.usefixtures("fresh_compile"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled"),
]

L, H, D, P, S = 2, 2, 16, 32, 11
TYPEDKV_OPS = {
    torch.ops.typedkv.materialize_kv_out.default,
    torch.ops.typedkv.materialize_kv_into_pool_stacked.default,
    torch.ops.typedkv.materialize_kv_into_pool_list.default,
}


@dataclass(frozen=True)
class Inputs:
    kv: Tensor
    k_norm_weight: Tensor
    eps: Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    cache_loc: Tensor


def make_inputs(num_tokens: int = 3, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    return Inputs(
        torch.randn(num_tokens, L, 2 * H * D, generator=g),
        torch.rand(L, D, generator=g) + 0.5,
        torch.tensor([1e-6, 1e-2]),
        torch.randn(P, D, generator=g),
        torch.randint(0, P, (num_tokens,), generator=g),
        torch.randperm(S, generator=g)[:num_tokens],
    )


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True)


def graph_ops(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """The call targets of the one graph ``fn`` compiles to (``fullgraph``: a break raises)."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Sequence[Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=record)(*args)
    assert len(graphs) == 1
    return [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]


def assert_no_buffers(code: Sequence[str]) -> None:
    """Inductor's code allocates no buffer: the op was handed the caller's tensors, not copies."""
    allocations = re.findall(r"\w+ = empty_strided_\w+\(.*", "\n".join(code))
    assert not allocations


# ------------------------------------------------------------- dense op


def test_materialize_kv_compiled() -> None:
    """Allocated outputs, float eps, gptj: the compiled result is the eager one, bit for bit."""
    x = make_inputs()

    def fn(kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        k, v = typedkv.materialize_kv(
            kv, x.k_norm_weight, 1e-6, x.cos_sin_cache, positions, num_kv_heads=H, rope_style="gptj"
        )
        return k * 2, v

    got = compiled(fn)(x.kv, x.positions)
    want = fn(x.kv, x.positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_materialize_kv_into_given_outputs_compiled() -> None:
    """k_out/v_out given as views of two slabs, tensor eps: written in place and returned, the rest untouched."""
    x = make_inputs()

    def fn(kv: Tensor, k_slab: Tensor, v_slab: Tensor) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(
            kv, x.k_norm_weight, x.eps, x.cos_sin_cache, x.positions,
            num_kv_heads=H, k_out=k_slab[:, :3], v_out=v_slab[:, :3],
        )  # fmt: skip

    slabs = torch.full((L, 5, H, D), 7.0), torch.full((L, 5, H, D), 7.0)
    (k, v), code = run_and_get_code(compiled(fn), x.kv, *slabs)
    assert_no_buffers(code)  # the op writes the slabs themselves
    want = torch.full((L, 5, H, D), 7.0), torch.full((L, 5, H, D), 7.0)
    fn(x.kv, *want)
    for got, expected in zip(slabs, want, strict=True):
        assert torch.equal(got, expected)
        assert bool((got[:, 3:] == 7.0).all())
    assert torch.equal(k, want[0][:, :3]) and torch.equal(v, want[1][:, :3])


def test_one_op_per_call() -> None:
    """The traced graph holds the registered op, once, and nothing of the eager internals."""
    x = make_inputs()

    def fn(kv: Tensor) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(kv, x.k_norm_weight, x.eps, x.cos_sin_cache, x.positions, num_kv_heads=H)

    targets = graph_ops(fn, x.kv)
    assert [t for t in targets if t in TYPEDKV_OPS] == [torch.ops.typedkv.materialize_kv_out.default]


# -------------------------------------------------------------- pool ops


def _pools(layout: str, dtype: torch.dtype) -> tuple[Tensor | list[Tensor], Tensor | list[Tensor]]:
    """Poisoned K and V pools, every tensor an allocation of its own: stacked, or one per layer."""
    if layout == "stacked":
        return torch.full((L, S, H, D), 3.0).to(dtype), torch.full((L, S, H, D), 3.0).to(dtype)
    return [torch.full((S, H, D), 3.0).to(dtype) for _ in range(L)], [
        torch.full((S, H, D), 3.0).to(dtype) for _ in range(L)
    ]


def _whole(k_pool: Tensor | list[Tensor], v_pool: Tensor | list[Tensor]) -> Tensor:
    pools = [torch.stack(p) if isinstance(p, list) else p for p in (k_pool, v_pool)]
    return torch.stack(pools).view(torch.uint8)


def _pool_fn(fp8: bool) -> Callable[[Tensor, Tensor | list[Tensor], Tensor | list[Tensor]], None]:
    x = make_inputs()
    k_scale = torch.tensor([0.5, 2.0]) if fp8 else None
    v_scale = 0.25 if fp8 else None

    def fn(kv: Tensor, k_pool: Tensor | list[Tensor], v_pool: Tensor | list[Tensor]) -> None:
        typedkv.materialize_kv_into_pool(
            kv, x.k_norm_weight, x.eps, x.cos_sin_cache, x.positions, x.cache_loc, k_pool, v_pool,
            num_kv_heads=H, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    return fn


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("stacked", torch.float32), ("list", torch.float32), ("list", torch.float8_e4m3fn)],
    ids=["stacked", "list", "list-fp8"],
)
def test_pool_compiled(layout: str, dtype: torch.dtype) -> None:
    """Stacked pools, per-layer pools, FP8 with scales: the eager bits, written in place (no copy)."""
    fn = _pool_fn(dtype.itemsize == 1)
    kv = make_inputs().kv
    k_pool, v_pool = _pools(layout, dtype)
    _, code = run_and_get_code(compiled(fn), kv, k_pool, v_pool)
    assert_no_buffers(code)
    want_k, want_v = _pools(layout, dtype)
    fn(kv, want_k, want_v)
    assert torch.equal(_whole(k_pool, v_pool), _whole(want_k, want_v))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_paged_rope_only_compiled(kv_layout: typedkv.KVLayout) -> None:
    """Paged pools (the K/V halves of one cache, sliced inside the compiled function) and no norm weight:
    one typedkv op in the graph, the eager bits, written in place."""
    x = make_inputs()
    page = (2, H) if kv_layout == "NHD" else (H, 2)  # pages of 2 slots

    def fn(kv: Tensor, cache: Tensor) -> None:
        typedkv.materialize_kv_into_pool(
            kv, None, 0.0, x.cos_sin_cache, x.positions, x.cache_loc, cache[:, :, 0], cache[:, :, 1],
            num_kv_heads=H, kv_layout=kv_layout,
        )  # fmt: skip

    cache = torch.full((L, S // 2, 2, *page, D), 3.0)
    targets = graph_ops(fn, x.kv, cache.clone())
    assert [t for t in targets if t in TYPEDKV_OPS] == [torch.ops.typedkv.materialize_kv_into_pool_stacked.default]
    _, code = run_and_get_code(compiled(fn), x.kv, cache)
    assert_no_buffers(code)
    want = torch.full((L, S // 2, 2, *page, D), 3.0)
    fn(x.kv, want)
    assert torch.equal(cache, want) and not torch.equal(want, torch.full_like(want, 3.0))


@pytest.mark.parametrize("layout", ["halves", "views"])
def test_shared_allocation_warns(layout: str) -> None:
    """Pools that share one allocation, passed in as separate tensors: a warning while tracing.

    Inductor copies such tensors around the op instead of writing them in place
    (pytorch/pytorch#139628); before torch 2.13 the copy can also corrupt them,
    so the compiled result is compared only from 2.13 on. The warning is checked
    with the aot_eager backend, which traces the same way and runs correctly.
    """
    fn = _pool_fn(False)
    kv = make_inputs().kv

    def shared() -> tuple[Tensor, Tensor | list[Tensor], Tensor | list[Tensor]]:
        memory = torch.full((2, L, S, H, D), 3.0)
        if layout == "halves":  # K and V as the two halves of one buffer
            return memory, memory[0], memory[1]
        return memory, list(memory[0].unbind(0)), list(memory[1].unbind(0))  # per-layer views of one buffer

    first = "v_pool shares one allocation with k_pool" if layout == "halves" else "k_pool[1] shares one allocation"
    _, k_pool, v_pool = shared()
    with pytest.warns(UserWarning, match=re.escape(first)):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(kv, k_pool, v_pool)
    if torch_ops._torch_version() < (2, 13):
        return
    torch._dynamo.reset()
    memory, k_pool, v_pool = shared()
    with pytest.warns(UserWarning, match=re.escape(first)):
        compiled(fn)(kv, k_pool, v_pool)
    want, want_k, want_v = shared()
    fn(kv, want_k, want_v)
    assert torch.equal(memory, want)


# ----------------------------------------------------------- materializer


def _materializer(bias: bool = True) -> typedkv.KVMaterializer:
    g = torch.Generator().manual_seed(5)
    return typedkv.KVMaterializer(
        torch.randn(L, 2 * H * D, 24, generator=g) / 5,
        torch.rand(L, D, generator=g) + 0.5,
        [1e-6, 1e-3],
        torch.randn(P, D, generator=g),
        num_kv_heads=H,
        kv_bias=torch.randn(L, 2 * H * D, generator=g) if bias else None,
    )


def test_materializer_compiled() -> None:
    """A compiled KVMaterializer (module and into_pool) gives the eager result."""
    m = _materializer()
    hidden, positions = torch.randn(3, 24), torch.tensor([0, 5, 31])
    k, v = compiled(m)(hidden, positions)
    want_k, want_v = m(hidden, positions)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, want_v, rtol=1e-6, atol=1e-6)

    def into_pool(hidden: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
        m.into_pool(hidden, positions, torch.tensor([4, -1, 0]), k_pool, v_pool)

    k_pool, v_pool = torch.zeros(L, 5, H, D), torch.zeros(L, 5, H, D)
    compiled(into_pool)(hidden, k_pool, v_pool)
    for pool, want in ((k_pool, want_k), (v_pool, want_v)):
        torch.testing.assert_close(pool[:, [4, 0]], want[:, [0, 2]], rtol=1e-6, atol=1e-6)
        assert bool((pool[:, [1, 2, 3]] == 0).all())


def test_materializer_graph() -> None:
    """Compiled, a KVMaterializer call is one GEMM and one op; its workspace is not used."""
    m = _materializer(bias=False)
    targets = graph_ops(m, torch.randn(3, 24), torch.tensor([0, 1, 2]))
    assert [t for t in targets if t in TYPEDKV_OPS] == [torch.ops.typedkv.materialize_kv_out.default]
    assert torch.nn.functional.linear in targets
    assert m._workspace is None


def test_changing_sizes_compile_dynamic() -> None:
    """A loop over T compiles once more with a dynamic T; int and float arguments may be symbols too."""
    m = _materializer()
    run = compiled(m)
    for num_tokens in (2, 3, 4):
        hidden, positions = torch.randn(num_tokens, 24), torch.randint(0, P, (num_tokens,))
        for got, want in zip(run(hidden, positions), m(hidden, positions), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    x = make_inputs()

    def fn(kv: Tensor, num_kv_heads: int, eps: float) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(kv, x.k_norm_weight, eps, x.cos_sin_cache, x.positions, num_kv_heads=num_kv_heads)

    compiled_kv = torch.compile(fn, fullgraph=True, dynamic=True)(x.kv, H, 1e-5)
    eager_kv = fn(x.kv, H, 1e-5)
    assert torch.equal(compiled_kv[0], eager_kv[0]) and torch.equal(compiled_kv[1], eager_kv[1])


# ------------------------------------------------------------------ checks


def _eager_message(call: Callable[[], object]) -> str:
    with pytest.raises(typedkv.InputError) as info:
        call()
    return str(info.value)


def test_misuse_rejected_while_tracing() -> None:
    """Misuse in compiled code fails at compile time, with the eager InputError message in the error."""
    x = make_inputs()
    m = _materializer()
    wrong_norm = torch.ones(L, 8)
    fp16_pool = torch.zeros(L, S, H, D, dtype=torch.float16)

    def dense() -> object:
        return typedkv.materialize_kv(x.kv, wrong_norm, 1e-6, x.cos_sin_cache, x.positions, num_kv_heads=H)

    def pool() -> None:
        typedkv.materialize_kv_into_pool(
            x.kv, x.k_norm_weight, 1e-6, x.cos_sin_cache, x.positions, x.cache_loc, fp16_pool, fp16_pool.clone(),
            num_kv_heads=H,
        )  # fmt: skip

    def mixed_layout() -> None:
        typedkv.materialize_kv_into_pool(
            x.kv, x.k_norm_weight, 1e-6, x.cos_sin_cache, x.positions, x.cache_loc,
            torch.zeros(L, S, H, D), list(torch.zeros(L, S, H, D)), num_kv_heads=H,
        )  # fmt: skip

    def materializer() -> object:
        return m(torch.randn(3, 24), torch.tensor([0, 1]))

    def eps_list() -> object:
        # A per-layer eps list becomes a tensor in the traced call: its numbers are checked before (NaN K before).
        eps = [1e-6] * (L - 1) + [float("nan")]
        return typedkv.materialize_kv(x.kv, x.k_norm_weight, eps, x.cos_sin_cache, x.positions, num_kv_heads=H)

    def mla_eps_list() -> object:
        ckv = torch.randn(x.positions.shape[0], L, 24)
        weight = torch.rand(L, 16)
        return typedkv.materialize_mla_kv(
            ckv, weight, [-1.0] * L, typedkv.cos_sin_cache(8, 8), x.positions, rope_style="neox"
        )

    # Compiled, the materializer's GEMM output reaches the op's check as kv, whose T the message names.
    seen_as_kv = {"T=3 comes from hidden": "T=3 comes from kv"}
    for call in (dense, pool, mixed_layout, materializer, eps_list, mla_eps_list):
        message = _eager_message(call)
        for eager, traced in seen_as_kv.items():
            message = message.replace(eager, traced)
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            compiled(call)()
        assert message in str(info.value), call.__name__


def test_debug_mode_checks_values_when_the_graph_runs() -> None:
    """Debug mode's value checks need the values: not traced, they run when the compiled graph calls the op."""
    x = make_inputs()

    def fn(positions: Tensor) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(x.kv, x.k_norm_weight, 1e-6, x.cos_sin_cache, positions, num_kv_heads=H)

    run = compiled(fn)
    run(x.positions)  # traced in debug mode (the conftest default): no check runs on fake values
    out_of_range = torch.tensor([0, P, 1])
    with pytest.raises(typedkv.InputError, match=rf"positions: expected values in \[0, P={P}\), got {P} at token 1"):
        run(out_of_range)
    typedkv.set_debug(False)
    k, _ = run(out_of_range)
    assert bool(k[:, 1].isnan().all()) and not bool(k[:, 0].isnan().any())


# ----------------------------------------------------------------- opcheck


# The schemas, as torch sees them: derived from the public signatures (typedkv.core.torch_ops), printed here.
SCHEMAS = """
typedkv::materialize_kv_out(Tensor kv, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, Tensor(a9!) k_out, Tensor(a10!) v_out) -> ()
typedkv::materialize_kv_into_pool_stacked(Tensor kv, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, Tensor cache_loc, Tensor(a7!) k_pool, Tensor(a8!) v_pool, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, float? k_scale_value, Tensor? k_scale_tensor, float? v_scale_value, Tensor? v_scale_tensor, Tensor(a14!)? k_scale_out, Tensor(a15!)? v_scale_out, str? kv_layout) -> ()
typedkv::materialize_kv_into_pool_list(Tensor kv, Tensor? k_norm_weight, float? eps_value, Tensor? eps_tensor, Tensor cos_sin_cache, Tensor positions, Tensor cache_loc, Tensor(a7!)[] k_pool, Tensor(a8!)[] v_pool, SymInt num_kv_heads, str rope_style, Tensor? v_norm_weight, float? k_scale_value, Tensor? k_scale_tensor, float? v_scale_value, Tensor? v_scale_tensor, Tensor(a14!)[]? k_scale_out, Tensor(a15!)[]? v_scale_out, str? kv_layout) -> ()
"""


def test_schemas() -> None:
    """Every torch op's schema, derived from its public signature, is the one printed above."""
    ops = [*kv_api.DENSE_OPS.ops, *kv_api.POOL_OPS.ops]
    assert "\n".join(str(op._opoverload._schema) for op in ops) == SCHEMAS.strip()


def test_call_bundles_follow_the_signatures() -> None:
    """The call bundles the public functions build by position have the signatures' parameters, in order."""
    for fn, call in ((typedkv.materialize_kv, kv_impl.DenseCall), (typedkv.materialize_kv_into_pool, kv_impl.PoolCall)):
        assert call._fields == tuple(inspect.signature(fn).parameters), fn.__name__


def test_opcheck() -> None:
    """torch.library.opcheck: schema (mutations as declared), fake tensors, autograd registration, AOT dispatch."""
    x = make_inputs()
    (dense,) = kv_api.DENSE_OPS.ops
    stacked, listed = kv_api.POOL_OPS.ops
    common = (x.kv, x.k_norm_weight)
    rest = (x.cos_sin_cache, x.positions)
    torch.library.opcheck(
        dense,
        (*common, 1e-6, None, *rest, H, "neox", None, torch.empty(L, 3, H, D), torch.empty(L, 3, H, D)),
    )
    torch.library.opcheck(
        stacked,
        (*common, None, x.eps, *rest, x.cache_loc, torch.zeros(L, S, H, D), torch.zeros(L, S, H, D), H, "gptj",
         None, None, None, None, None, None, None, "NHD"),
    )  # fmt: skip
    # FP8 pools stay out: opcheck compares results with allclose, which CPU lacks for FP8.
    pools = [torch.zeros(S, H, D) for _ in range(2 * L)]
    torch.library.opcheck(
        listed,
        (*common, 1e-5, None, *rest, x.cache_loc, pools[:L], pools[L:], H, "neox", None, None, None, None, None, None,
         None, "NHD"),
    )  # fmt: skip
    # int8 pools with their scales written per row, stacked and per layer (the latter with V normed too).
    int8 = [torch.zeros(L, S, H, D, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(L, S, H) for _ in range(2)]
    torch.library.opcheck(
        stacked,
        (*common, 1e-6, None, *rest, x.cache_loc, *int8, H, "neox", None, None, None, None, None, *scales, "NHD"),
    )
    torch.library.opcheck(
        listed,
        (*common, 1e-6, None, *rest, x.cache_loc, *(list(p.clone()) for p in int8), H, "neox", torch.randn(L, D), None,
         None, None, None, *(list(t.clone()) for t in scales), "NHD"),
    )  # fmt: skip
