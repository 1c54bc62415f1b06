"""GPU: nothing a captured CUDA graph uses is freed while the graph can replay (``pytest -m gpu``).

The engine's pattern from the issue: capture a decode step at a small ``T``, run
a long prefill eagerly at a large ``T`` (or with many other pool sets), let other
code allocate and fill tensors, then replay the graph with new inputs. Before
the fix, the eager call replaced and freed the buffer the graph writes its GEMM
into (the materializer's workspace) or the per-layer offset table the graph
reads (per-layer pools): the freed memory went to the new tensors, and each
replay wrote into them. Here the new tensors must be untouched and the graph's
results must equal an eager call's with the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_gpu_integration import DTYPE, HIDDEN, D, H, L, P, S, make_call, make_materializer
from torch import Tensor

import typedkv

pytestmark = pytest.mark.gpu

SMALL, LARGE = 32, 8192


def _capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """As an engine does (docs/integration.md): one eager call on its own stream, then the capture.

    The eager call runs on the current stream, so what it allocates and what is
    freed later goes back to that stream's blocks, which the tensors allocated
    after it are handed.
    """
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _fill_freed_memory(nbytes: int, count: int, value: float | None = None) -> list[tuple[Tensor, Tensor]]:
    """``count`` new tensors of ``nbytes`` (what a freed buffer of that size is handed to), filled.

    Filled with ``value``, or with 1, 2, ... Returns each tensor with a host copy
    of what it must keep holding.
    """
    filled = []
    for i in range(count):
        t = torch.full((nbytes // 4,), float(i + 1) if value is None else value, dtype=torch.float32, device="cuda")
        filled.append((t, t.cpu()))
    return filled


def _untouched(filled: list[tuple[Tensor, Tensor]]) -> int:
    """How many of the filled tensors changed."""
    return sum(not torch.equal(t.cpu(), want) for t, want in filled)


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "into_pool"])
def test_graph_survives_eager_growth(pool: bool) -> None:
    """Capture at T=32, eager call at T=8192 (the workspace grows), fill new tensors, replay."""
    typedkv.set_debug(False)
    m = make_materializer()
    hidden, positions, slots = make_call(SMALL, 1)
    k_pool = torch.zeros(L, S, H, D, dtype=DTYPE, device="cuda")
    v_pool = torch.zeros_like(k_pool)

    def step() -> tuple[Tensor, Tensor] | None:
        if pool:
            m.into_pool(hidden, positions, slots, k_pool, v_pool)
            return None
        return m(hidden, positions)

    graph, out = _capture(step)
    big_hidden = torch.randn(LARGE, HIDDEN, device="cuda").to(DTYPE)
    big_positions = torch.randint(0, P, (LARGE,), device="cuda")
    m(big_hidden, big_positions)  # a long prefill between decode steps
    del big_hidden, big_positions
    torch.cuda.synchronize()
    workspace_bytes = SMALL * L * 2 * H * D * DTYPE.itemsize
    filled = _fill_freed_memory(workspace_bytes, 64)
    for seed in range(3):
        new_hidden, new_positions, new_slots = make_call(SMALL, 10 + seed)
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        assert _untouched(filled) == 0, "graph replay wrote into tensors allocated after the capture"
        want_k, want_v = m(new_hidden, new_positions)
        k, v = (k_pool[:, new_slots], v_pool[:, new_slots]) if pool else out
        torch.testing.assert_close(k, want_k)
        torch.testing.assert_close(v, want_v)


def _layer_pools(reversed_layers: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer K and V pools; ``reversed_layers``: views of one buffer, layer l below layer 0.

    Pools allocated one by one sit at the same offsets from their layer 0 in every
    set, so another set's offset table would still write the right rows; the
    reversed layout's offsets are negative, unlike any other set's.
    """
    if reversed_layers:
        base = torch.zeros(2, L, S, H, D, dtype=DTYPE, device="cuda")
        return list(base[0].unbind(0))[::-1], list(base[1].unbind(0))[::-1]
    return (
        [torch.zeros(S, H, D, dtype=DTYPE, device="cuda") for _ in range(L)],
        [torch.zeros(S, H, D, dtype=DTYPE, device="cuda") for _ in range(L)],
    )


@pytest.mark.parametrize("op", ["function", "materializer"])
def test_graph_survives_other_pool_sets(op: str) -> None:
    """Per-layer pools: capture, then eager calls with 40 other pool sets (the offset tables churn), replay."""
    typedkv.set_debug(False)
    m = make_materializer()
    hidden, positions, slots = make_call(SMALL, 2)
    weight = m.k_norm_weight
    k_layers, v_layers = _layer_pools(reversed_layers=True)
    kv = torch.randn(SMALL, L, 2 * H * D, device="cuda").to(DTYPE)

    def call(kv_in: Tensor, hidden_in: Tensor, pos: Tensor, loc: Tensor, k_pool: Any, v_pool: Any) -> None:
        if op == "function":
            typedkv.materialize_kv_into_pool(
                kv_in, weight, 1e-6, m.cos_sin_cache, pos, loc, k_pool, v_pool, num_kv_heads=H
            )
        else:
            m.into_pool(hidden_in, pos, loc, k_pool, v_pool)

    step: Callable[[], None] = lambda: call(kv, hidden, positions, slots, k_layers, v_layers)  # noqa: E731
    graph, _ = _capture(step)
    others = [_layer_pools() for _ in range(40)]  # all alive: 40 distinct sets of addresses
    for seed, (other_k, other_v) in enumerate(others):
        other_hidden, other_positions, other_slots = make_call(SMALL, 100 + seed)
        call(kv, other_hidden, other_positions, other_slots, other_k, other_v)
    del others
    torch.cuda.synchronize()
    # A [2, L] int64 offset table's size; zeros, so that a replay reading them as
    # offsets writes inside layer 0's pool (a wrong row) rather than anywhere.
    filled = _fill_freed_memory(2 * L * 8, 256, value=0.0)
    for seed in range(3):
        new_hidden, new_positions, new_slots = make_call(SMALL, 10 + seed)
        new_kv = torch.randn(SMALL, L, 2 * H * D, device="cuda").to(DTYPE)
        kv.copy_(new_kv)
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        for layer in (*k_layers, *v_layers):
            layer.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _untouched(filled) == 0, "graph replay wrote into tensors allocated after the capture"
        want_k, want_v = _layer_pools(reversed_layers=True)
        call(new_kv, new_hidden, new_positions, new_slots, want_k, want_v)
        for got, want in zip((*k_layers, *v_layers), (*want_k, *want_v), strict=True):
            assert torch.equal(got, want), "graph replay wrote other pool rows than an eager call"


@pytest.mark.parametrize("op", ["materialize_kv", "into_pool", "mla_into_pool", "materializer"])
def test_debug_mode_in_a_capture_says_so(op: str) -> None:
    """Debug mode on while a graph is captured: a RuntimeError naming debug mode and the fix, raised before
    its value checks' copy to the host (torch's own error at that copy names neither)."""
    m = make_materializer()
    hidden, positions, slots = make_call(SMALL, 3)
    kv = torch.randn(SMALL, L, 2 * H * D, device="cuda").to(DTYPE)
    k_pool = torch.zeros(L, S, H, D, dtype=DTYPE, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    C, R = 512, 64
    ckv = torch.randn(SMALL, L, C + R, device="cuda").to(DTYPE)
    mla_pool = torch.zeros(L, S, C + R, dtype=DTYPE, device="cuda")
    mla_weight = torch.rand(L, C, device="cuda") + 0.5
    mla_table = typedkv.cos_sin_cache(P, R, device="cuda")

    def step() -> None:
        if op == "materialize_kv":
            typedkv.materialize_kv(kv, m.k_norm_weight, 1e-6, m.cos_sin_cache, positions, num_kv_heads=H)
        elif op == "into_pool":
            typedkv.materialize_kv_into_pool(
                kv, m.k_norm_weight, 1e-6, m.cos_sin_cache, positions, slots, k_pool, v_pool, num_kv_heads=H
            )
        elif op == "mla_into_pool":
            typedkv.materialize_mla_kv_into_pool(
                ckv, mla_weight, 1e-6, mla_table, positions, slots, mla_pool, rope_style="gptj"
            )
        else:
            m.into_pool(hidden, positions, slots, k_pool, v_pool)

    typedkv.set_debug(True)
    try:
        step()  # the warm-up, checked in debug mode
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="typedkv debug mode is on during a CUDA graph capture"):
            with torch.cuda.graph(graph):
                step()
    finally:
        typedkv.set_debug(False)
