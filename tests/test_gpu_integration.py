"""GPU suite for the integration (``pytest -m gpu``): torch.compile on CUDA, CUDA graphs, no host sync.

The compiled ops must give the eager bits (the same Triton kernel runs); a
``KVMaterializer`` is compared with the eager materializer to the GEMM's
rounding (cuBLAS may pick another algorithm inside a compiled graph or a
capture), and bit for bit where nothing but the op differs. Skipped (by
conftest) where no CUDA device is present.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_gpu import assert_no_sync
from torch import Tensor
from torch._inductor.utils import run_and_get_code

import typedkv
import typedkv.core.torch_ops
from typedkv.projection.dispatch import ProjectionPath

L, H, D, HIDDEN, P, S = 4, 2, 128, 256, 4096, 512
DTYPE = torch.bfloat16


pytestmark = [
    pytest.mark.usefixtures("fresh_compile"),
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled"),
]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def make_materializer(bias: bool = True, seed: int = 0) -> typedkv.KVMaterializer:
    g = _generator(seed)
    return typedkv.KVMaterializer(
        (torch.randn(L, 2 * H * D, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(DTYPE),
        torch.rand(L, D, device="cuda", generator=g) + 0.5,
        torch.tensor([1e-6, 1e-5, 1e-4, 1e-3], device="cuda"),
        torch.randn(P, D, device="cuda", generator=g),
        num_kv_heads=H,
        kv_bias=torch.randn(L, 2 * H * D, device="cuda", generator=g).to(DTYPE) if bias else None,
    )


def make_call(num_tokens: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """hidden, positions and distinct pool slots for one call."""
    g = _generator(seed)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda", generator=g).to(DTYPE)
    positions = torch.randint(0, P, (num_tokens,), device="cuda", generator=g)
    slots = torch.randperm(S, device="cuda", generator=g)[:num_tokens]
    return hidden, positions, slots


def make_kv(num_tokens: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """kv, k_norm_weight, cos_sin_cache, positions, slots for the ops."""
    g = _generator(seed)
    return (
        torch.randn(num_tokens, L, 2 * H * D, device="cuda", generator=g).to(DTYPE),
        torch.rand(L, D, device="cuda", generator=g) + 0.5,
        torch.randn(P, D, device="cuda", generator=g),
        torch.randint(0, P, (num_tokens,), device="cuda", generator=g),
        torch.randperm(S, device="cuda", generator=g)[:num_tokens],
    )


def assert_close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("num_tokens", [1, 48])
def test_compiled_materialize_kv_cuda(num_tokens: int) -> None:
    kv, weight, cache, positions, _ = make_kv(num_tokens, 1)

    def fn(kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(kv, weight, 1e-6, cache, positions, num_kv_heads=H, rope_style="gptj")

    k, v = torch.compile(fn, fullgraph=True)(kv, positions)
    want_k, want_v = fn(kv, positions)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def _pools(layout: str) -> tuple[Any, Any]:
    """Zeroed FP8 K and V pools, every tensor an allocation of its own: stacked, or one per layer."""

    def pool() -> Tensor | list[Tensor]:
        if layout == "stacked":
            return torch.zeros(L, S, H, D, dtype=torch.float8_e4m3fn, device="cuda")
        return [torch.zeros(S, H, D, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(L)]

    return pool(), pool()


def _whole(k_pool: Any, v_pool: Any) -> Tensor:
    pools = [torch.stack(p) if isinstance(p, list) else p for p in (k_pool, v_pool)]
    return torch.stack(pools).view(torch.uint8)


@pytest.mark.parametrize("layout", ["stacked", "list"])
def test_compiled_pool_cuda(layout: str) -> None:
    """Stacked and per-layer FP8 pools (tensor and float scales): the eager bits, written in place."""
    kv, weight, cache, positions, slots = make_kv(33, 2)
    k_scale = torch.full((L,), 0.5, device="cuda")

    def fn(kv: Tensor, k_pool: Any, v_pool: Any) -> None:
        typedkv.materialize_kv_into_pool(
            kv, weight, 1e-6, cache, positions, slots, k_pool, v_pool, num_kv_heads=H, k_scale=k_scale, v_scale=2.0
        )

    k_pool, v_pool = _pools(layout)
    _, code = run_and_get_code(torch.compile(fn, fullgraph=True), kv, k_pool, v_pool)
    assert not re.findall(r"\w+ = empty_strided_\w+\(.*", "\n".join(code))  # no copies of the pools
    want_k, want_v = _pools(layout)
    fn(kv, want_k, want_v)
    assert torch.equal(_whole(k_pool, v_pool), _whole(want_k, want_v))


@pytest.mark.skipif(
    typedkv.core.torch_ops._torch_version() < (2, 13),
    reason="pytorch/pytorch#139628: before torch 2.13 inductor's copy of pools sharing an allocation reads "
    "out of bounds (typedkv warns while tracing; tests/test_compile.py checks the warning)",
)
def test_compiled_shared_allocation_cuda() -> None:
    """K and V pools as two halves of one buffer: warned about, copied by inductor, still the eager result."""
    kv, weight, cache, positions, slots = make_kv(33, 4)

    def fn(kv: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
        typedkv.materialize_kv_into_pool(kv, weight, 1e-6, cache, positions, slots, k_pool, v_pool, num_kv_heads=H)

    memory = torch.zeros(2, L, S, H, D, dtype=DTYPE, device="cuda")
    with pytest.warns(UserWarning, match="v_pool shares one allocation with k_pool"):
        torch.compile(fn, fullgraph=True)(kv, memory[0], memory[1])
    want = torch.zeros_like(memory)
    fn(kv, want[0], want[1])
    assert torch.equal(memory, want)


def test_compiled_materializer_cuda() -> None:
    m = make_materializer()
    hidden, positions, slots = make_call(48, 3)
    k, v = torch.compile(m, fullgraph=True)(hidden, positions)
    want_k, want_v = m(hidden, positions)
    assert_close(k, want_k)
    assert_close(v, want_v)

    def into_pool(hidden: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
        m.into_pool(hidden, positions, slots, k_pool, v_pool)

    k_pool = torch.zeros(L, S, H, D, dtype=DTYPE, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    torch.compile(into_pool, fullgraph=True)(hidden, k_pool, v_pool)
    assert_close(k_pool[:, slots], want_k)
    assert_close(v_pool[:, slots], want_v)


def test_compiled_reduce_overhead_cuda() -> None:
    """mode="reduce-overhead" (CUDA graphs by torch.compile): replays follow new inputs. Production mode."""
    typedkv.set_debug(False)
    m = make_materializer()
    run = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    mark_step: Callable[[], None] = torch.compiler.cudagraph_mark_step_begin  # an untyped function to mypy
    for seed in range(4):  # warm-up, record, then replays
        hidden, positions, _ = make_call(32, 10 + seed)
        mark_step()
        k, v = (t.clone() for t in run(hidden, positions))
        want_k, want_v = m(hidden, positions)
        assert_close(k, want_k)
        assert_close(v, want_v)


# ---------------------------------------------------------------- CUDA graphs


def capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm up on a side stream (plans, kernels, workspace), then capture one ``step``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.parametrize("path", ["fused", "gemm"])
@pytest.mark.parametrize("pool", [False, True], ids=["dense", "into_pool"])
def test_cuda_graph_materializer(pool: bool, path: ProjectionPath) -> None:
    """A KVMaterializer call captured at a fixed T, replayed with new hidden/positions/slots copied in.

    "fused" is the fused kernel (pinned: this draft's 16 programs are too few for "auto" to take it);
    "gemm" writes the GEMM into the eager workspace
    in the warm-up on a side stream, into rows of the graph's own in the capture, and into the same eager
    workspace again in the eager calls on the default stream."""
    typedkv.set_debug(False)
    T = 48
    m = make_materializer()
    m.projection_path = path
    hidden, positions, slots = make_call(T, 20)
    k_pool = torch.zeros(L, S, H, D, dtype=DTYPE, device="cuda")
    v_pool = torch.zeros_like(k_pool)

    def step() -> tuple[Tensor, Tensor] | None:
        if pool:
            m.into_pool(hidden, positions, slots, k_pool, v_pool)
            return None
        k, v = m(hidden, positions)
        return k, v

    graph, out = capture(step)
    workspace = m._workspace
    for seed in range(3):
        new_hidden, new_positions, new_slots = make_call(T, 30 + seed)
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        want_k, want_v = m(new_hidden, new_positions)
        k, v = (k_pool[:, new_slots], v_pool[:, new_slots]) if pool else out
        assert_close(k, want_k)
        assert_close(v, want_v)
    assert m._workspace is workspace  # the eager calls reuse the warm-up's rows; the capture never replaced them
    if path == "gemm":
        assert workspace is not None


def test_materializer_makes_no_sync() -> None:
    """Production mode: a KVMaterializer call (dense and into_pool, stacked and per-layer pools) never syncs, on
    either path."""
    typedkv.set_debug(False)
    m = make_materializer()
    fused = make_materializer()
    fused.projection_path = "fused"
    hidden, positions, slots = make_call(64, 40)
    k_pool = torch.empty(L, S, H, D, dtype=torch.float8_e4m3fn, device="cuda")
    v_pool = torch.empty_like(k_pool)
    pools = [torch.empty(S, H, D, dtype=DTYPE, device="cuda") for _ in range(2 * L)]
    scale = torch.ones(L, device="cuda")

    def calls() -> None:
        for each in (m, fused):
            each(hidden, positions)
            each.into_pool(hidden, positions, slots, k_pool, v_pool, k_scale=scale, v_scale=0.5)
            each.into_pool(hidden, positions, slots, pools[:L], pools[L:])

    assert_no_sync(calls)
