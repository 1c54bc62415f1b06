"""What a call writes lies apart from what it reads, and from each other (`typedkv.core.memory`).

A written tensor sharing memory with a read one, or two written tensors sharing an
element, would race in the kernel and give a wrong answer with no error: every op
rejects such a call with `typedkv.InputError` before anything is written. K and V
as the interleaved halves of one combined cache share no element and pass.

`shares_element` is held to a brute force over the element addresses of random
views of one buffer. The ops' tests run on the reference path and, under
``TRITON_INTERPRET=1``, on the kernel itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv.core import memory

L, T, H, D, P, S = 3, 4, 2, 16, 16, 16
DTYPE = torch.float32


@pytest.fixture(autouse=True, params=["debug", "production"])
def mode(request: pytest.FixtureRequest) -> str:
    """Every test in both modes (the suite's own fixture turns debug mode on first)."""
    typedkv.set_debug(request.param == "debug")
    return str(request.param)


def _inputs() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "kv": torch.randn(T, L, 2 * H * D, dtype=DTYPE),
        "k_norm_weight": torch.rand(L, D, dtype=DTYPE) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, D),
        "positions": torch.randperm(P)[:T],
    }


def _dense(a: dict[str, Any], k_out: Tensor | None = None, v_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return typedkv.materialize_kv(
        a["kv"], a["k_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], num_kv_heads=H,
        k_out=k_out, v_out=v_out,
    )  # fmt: skip


def _pool(a: dict[str, Any], cache_loc: Tensor, k_pool: Any, v_pool: Any) -> None:
    typedkv.materialize_kv_into_pool(
        a["kv"], a["k_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], cache_loc, k_pool, v_pool,
        num_kv_heads=H,
    )  # fmt: skip


def _elements(t: Tensor) -> set[int]:
    """Every byte address an element of ``t`` covers (brute force)."""
    offsets = torch.zeros(t.shape, dtype=torch.int64)
    for dim, stride in enumerate(t.stride()):
        shape = [1] * t.dim()
        shape[dim] = t.shape[dim]
        offsets = offsets + torch.arange(t.shape[dim]).reshape(shape) * stride
    item = t.element_size()
    starts = (t.data_ptr() + offsets.flatten() * item).tolist()
    return {s + b for s in starts for b in range(item)}


def _random_view(buffer: Tensor, rng: random.Random, layout: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Tensor:
    if layout is None:
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 4) for _ in range(dims))
        # Strides of a view of its own (no element twice), in a random nesting order.
        order = list(range(dims))
        rng.shuffle(order)
        stride_of = [0] * dims
        step = 1
        for d in reversed(order):
            stride_of[d] = step * rng.choice((1, 1, 2))
            step = stride_of[d] * shape[d]
        layout = shape, tuple(stride_of)
    shape, strides = layout
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    offset = rng.randint(0, buffer.numel() - extent)
    return buffer.as_strided(shape, strides, offset)


@pytest.mark.parametrize("same_layout", [True, False])
def test_shares_element_agrees_with_the_elements_themselves(same_layout: bool) -> None:
    """Exact for two views of one layout; for others never "apart" when an element is shared."""
    rng = random.Random(7)
    buffer = torch.zeros(1024)
    exact = 0
    for _ in range(400):
        a = _random_view(buffer, rng, None)
        b = _random_view(buffer, rng, (tuple(a.shape), tuple(a.stride())) if same_layout else None)
        shared = bool(_elements(a) & _elements(b))
        got = memory.shares_element(a, b)
        if same_layout:
            assert got == shared, (a.shape, a.stride(), a.data_ptr() - b.data_ptr())
            exact += not shared and memory.span(a) == memory.span(b)
        else:
            assert got or not shared
    if same_layout:
        assert exact  # some pairs interleaved without sharing an element were told apart


def test_overlaps_itself_agrees_with_the_elements_themselves() -> None:
    """Exact on random strides (0 and strides that fold one dim onto another among them)."""
    rng = random.Random(11)
    buffer = torch.zeros(4096)
    folded = 0
    for _ in range(2000):
        dims = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 5) for _ in range(dims))
        strides = tuple(rng.choice((0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 30)) for _ in range(dims))
        view = buffer.as_strided(shape, strides)
        offsets = torch.zeros(shape, dtype=torch.int64)
        for dim, stride in enumerate(strides):
            offsets = offsets + torch.arange(shape[dim]).reshape([-1 if d == dim else 1 for d in range(dims)]) * stride
        overlap = len(set(offsets.flatten().tolist())) < offsets.numel()
        assert memory.overlaps_itself(view) == overlap, (shape, strides)
        folded += overlap and 0 not in strides
    assert folded  # overlaps without a stride of 0 were among them


def _folded(shape: tuple[int, ...], dtype: torch.dtype = DTYPE) -> Tensor:
    """A view of ``shape`` whose heads overlap: head 1 of slot ``s`` is head 0 of slot ``s + 1`` (slot stride D)."""
    d = shape[-1]
    strides = [0] * len(shape)
    strides[-1], strides[-2], strides[-3] = 1, d, d
    for i in range(len(shape) - 4, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1] + d
    buffer = torch.randn(strides[0] * shape[0] + shape[-3] * d + d, dtype=dtype)
    return buffer.as_strided(shape, strides)


def test_outputs_whose_elements_overlap_are_rejected_before_anything_is_written() -> None:
    a = _inputs()
    k_out, v_out = _folded((L, T, H, D)), torch.randn(L, T, H, D)
    assert memory.overlaps_itself(k_out) and 0 not in k_out.stride()
    before = k_out.clone(), v_out.clone()
    with pytest.raises(
        typedkv.InputError,
        match=r"^k_out: expected memory of its own for every element, got strides \(\d+, 16, 16, 1\) "
        r"\(two elements at one address\): writes to it would collide$",
    ):
        _dense(a, k_out, v_out)
    assert torch.equal(k_out, before[0]) and torch.equal(v_out, before[1])


def test_pools_whose_elements_overlap_are_rejected_before_anything_is_written() -> None:
    a = _inputs()
    cache_loc = torch.randperm(S)[:T]
    k_pool, v_pool = _folded((L, S, H, D)), torch.randn(L, S, H, D)
    before = k_pool.clone(), v_pool.clone()
    with pytest.raises(
        typedkv.InputError, match=r"^k_pool: .*\(two elements at one address\): writes to it would collide$"
    ):
        _pool(a, cache_loc, k_pool, v_pool)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])
    k_layers, v_layers = [torch.randn(S, H, D) for _ in range(L)], [torch.randn(S, H, D) for _ in range(L)]
    v_layers[1] = _folded((S, H, D))
    before_layers = [t.clone() for t in k_layers + v_layers]
    with pytest.raises(typedkv.InputError, match=r"^v_pool\[1\]: .*\(two elements at one address\)"):
        _pool(a, cache_loc, k_layers, v_layers)
    assert all(torch.equal(t, b) for t, b in zip(k_layers + v_layers, before_layers, strict=True))


def test_interleaved_halves_of_a_combined_cache_share_no_element() -> None:
    cache = torch.zeros(4, 2, 8, H, D)  # [N, 2, B, H, D]: K and V interleaved page by page
    assert not memory.shares_element(cache[:, 0], cache[:, 1])
    assert memory.shares_element(cache[:, 0], cache[:, 0])
    shifted = cache.flatten()[1:].as_strided(cache[:, 1].shape, cache[:, 1].stride())
    assert memory.shares_element(cache[:, 0], shifted)


def test_dense_outputs_over_kv_are_rejected_before_anything_is_written() -> None:
    a = _inputs()
    k_ref, v_ref = _dense(a)
    # kv, then room for the outputs: this k_out starts one head before kv's end.
    buffer = torch.randn(a["kv"].numel() + 2 * L * T * H * D, dtype=DTYPE)
    kv = buffer[: a["kv"].numel()].view(T, L, 2 * H * D)
    kv.copy_(a["kv"])
    before = buffer.clone()
    k_out = buffer[a["kv"].numel() - H * D :][: L * T * H * D].view(L, T, H, D)
    with pytest.raises(typedkv.InputError, match=r"^k_out: expected memory apart from kv, got memory shared with it"):
        _dense({**a, "kv": kv}, k_out=k_out)
    assert torch.equal(buffer, before)
    # Outputs that start right after kv's last element lie apart: accepted, and right.
    k_out = buffer[a["kv"].numel() :][: L * T * H * D].view(L, T, H, D)
    k, v = _dense({**a, "kv": kv}, k_out=k_out)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_an_output_in_place_of_kv_s_own_columns_is_rejected() -> None:
    """K written over kv's K columns (an in-place call) reads and writes one memory: rejected."""
    a = _inputs()
    kv = a["kv"].clone()
    halves = kv.view(T, L, 2, H, D)
    with pytest.raises(typedkv.InputError, match=r"^v_out: expected memory apart from kv"):
        _dense({**a, "kv": kv}, v_out=halves[:, :, 1].transpose(0, 1))
    assert torch.equal(kv, a["kv"])


@pytest.mark.parametrize("read", ["k_norm_weight", "cos_sin_cache", "positions"])
def test_dense_outputs_over_any_read_tensor_are_rejected(read: str) -> None:
    a = _inputs()
    out = torch.empty(L, T, H, D, dtype=DTYPE)
    memory = out.view(torch.int64) if read == "positions" else out
    flat = memory.flatten()
    a[read] = flat[: a[read].numel()].view(a[read].shape).copy_(a[read])
    kept = a[read].clone()
    with pytest.raises(typedkv.InputError, match=rf"^v_out: expected memory apart from {read}"):
        _dense(a, v_out=out)
    assert torch.equal(a[read], kept)


def test_outputs_that_overlap_each_other_are_rejected() -> None:
    a = _inputs()
    buffer = torch.zeros(2 * L * T * H * D)
    k_out = buffer[: L * T * H * D].view(L, T, H, D)
    v_out = buffer[D : D + L * T * H * D].view(L, T, H, D)  # one head further: overlapping
    with pytest.raises(typedkv.InputError, match=r"^v_out: expected memory apart from k_out, got views that overlap"):
        _dense(a, k_out=k_out, v_out=v_out)
    assert not buffer.any()
    # K and V interleaved token by token share no element: accepted.
    slab = torch.empty(L, T, 2, H, D)
    k, v = _dense(a, k_out=slab[:, :, 0], v_out=slab[:, :, 1])
    k_ref, v_ref = _dense(a)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_a_verdict_kept_for_some_addresses_does_not_pass_others() -> None:
    """Outputs found apart once are not taken as apart at other addresses of the same layout."""
    a = _inputs()
    buffer = torch.zeros(3 * L * T * H * D)
    n = L * T * H * D
    for _ in range(2):
        _dense(a, k_out=buffer[:n].view(L, T, H, D), v_out=buffer[2 * n :].view(L, T, H, D))
    with pytest.raises(typedkv.InputError, match=r"^v_out: expected memory apart from k_out"):
        _dense(a, k_out=buffer[:n].view(L, T, H, D), v_out=buffer[n // 2 : n // 2 + n].view(L, T, H, D))


def _per_layer(count: int) -> list[Tensor]:
    return [torch.zeros(S, H, D) for _ in range(count)]


@pytest.mark.parametrize("layer", [0, 2])
def test_a_pool_layer_over_kv_is_rejected(layer: int) -> None:
    a = _inputs()
    k_layers, v_layers = _per_layer(L), _per_layer(L)
    memory = torch.zeros(a["kv"].numel() + S * H * D)
    a["kv"] = memory[: a["kv"].numel()].view(T, L, 2 * H * D).copy_(a["kv"])
    k_layers[layer] = memory[a["kv"].numel() - 1 :][: S * H * D].view(S, H, D)  # from kv's last element on
    with pytest.raises(typedkv.InputError, match=rf"^k_pool\[{layer}\]: expected memory apart from kv"):
        _pool(a, torch.arange(T), k_layers, v_layers)
    assert not any(t.any() for t in v_layers)


def test_a_stacked_pool_over_cache_loc_is_rejected() -> None:
    a = _inputs()
    k_pool, v_pool = torch.zeros(L, S, H, D), torch.zeros(L, S, H, D)
    cache_loc = v_pool.view(torch.int32).flatten()[-T:]
    cache_loc.copy_(torch.arange(T, dtype=torch.int32))
    with pytest.raises(typedkv.InputError, match=r"^v_pool: expected memory apart from cache_loc"):
        _pool(a, cache_loc, k_pool, v_pool)
    assert not k_pool.any()


def test_per_layer_pools_that_overlap_are_rejected_and_interleaved_ones_pass() -> None:
    a = _inputs()
    memory = torch.zeros((L + 1) * S * H * D)
    k_layers = [memory[i * (S * H * D) // 2 :][: S * H * D].view(S, H, D) for i in range(L)]  # half a pool apart
    with pytest.raises(typedkv.InputError, match=r"^k_pool\[1\]: expected memory apart from k_pool\[0\], got views"):
        _pool(a, torch.arange(T), k_layers, _per_layer(L))
    assert not memory.any()
    # Per-layer combined caches [N, 2, B, H, D], K and V interleaved page by page (FlashInfer's layout).
    caches = [torch.zeros(S // 4, 2, 4, H, D) for _ in range(L)]
    cache_loc = torch.randperm(S)[:T]
    _pool(a, cache_loc, [c[:, 0] for c in caches], [c[:, 1] for c in caches])
    k_ref, v_ref = _dense(a)
    for layer, cache in enumerate(caches):
        rows = cache.transpose(1, 2).reshape(S, 2, H, D)[cache_loc]
        assert torch.equal(rows[:, 0], k_ref[layer]) and torch.equal(rows[:, 1], v_ref[layer])


def test_the_same_layer_twice_keeps_its_message() -> None:
    a = _inputs()
    layer = torch.zeros(S, H, D)
    with pytest.raises(typedkv.InputError, match=r"^k_pool\[1\]: expected memory of its own, got the same memory as"):
        _pool(a, torch.arange(T), [layer] * L, _per_layer(L))


MLA_C, MLA_R = 32, 16


def _mla_inputs() -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "ckv": torch.randn(T, L, MLA_C + MLA_R, dtype=DTYPE),
        "kv_norm_weight": torch.rand(L, MLA_C, dtype=DTYPE) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": typedkv.cos_sin_cache(P, MLA_R),
        "positions": torch.randperm(P)[:T],
    }


def _mla_dense(a: dict[str, Any], out: Tensor) -> None:
    typedkv.materialize_mla_kv(
        a["ckv"], a["kv_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], rope_style="gptj", out=out
    )


def _mla_pool(a: dict[str, Any], out: Tensor) -> None:
    typedkv.materialize_mla_kv_into_pool(
        a["ckv"], a["kv_norm_weight"], a["eps"], a["cos_sin_cache"], a["positions"], torch.arange(T),
        list(out.unbind()), rope_style="gptj",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_mla_dense, r"^out: expected memory apart from ckv"),
        (_mla_pool, r"^kv_pool\[0\]: expected memory apart from ckv"),
    ],
    ids=["dense", "per-layer pool"],
)
def test_mla_outputs_over_ckv_are_rejected(call: Callable[[dict[str, Any], Tensor], None], message: str) -> None:
    a = _mla_inputs()
    width = MLA_C + MLA_R
    memory = torch.zeros(a["ckv"].numel() + L * T * width)
    a["ckv"] = memory[: a["ckv"].numel()].view(T, L, width).copy_(a["ckv"])
    out = memory[width:][: L * T * width].view(L, T, width)
    before = memory.clone()
    with pytest.raises(typedkv.InputError, match=message):
        call(a, out)
    assert torch.equal(memory, before)


HIDDEN = 32


def _materializer(path: str) -> typedkv.KVMaterializer:
    torch.manual_seed(2)
    m = typedkv.KVMaterializer(
        torch.randn(L, 2 * H * D, HIDDEN) / HIDDEN**0.5,
        torch.rand(L, D) + 0.5,
        1e-6,
        typedkv.cos_sin_cache(P, D),
        num_kv_heads=H,
    )
    m.projection_path = path  # type: ignore[assignment]
    return m


@pytest.mark.parametrize("path", ["fused", "gemm"])
def test_materializer_outputs_over_hidden(path: str) -> None:
    """Where one kernel reads hidden while it writes (the fused path, on a device with the kernel), outputs over
    hidden are rejected before anything is written; GEMM + kernel has read hidden before the outputs are written,
    and gets the answer computed from hidden's values."""
    m = _materializer(path)
    n = L * T * H * D
    memory = torch.randn(n + T * HIDDEN)
    hidden = memory[n - HIDDEN :][: T * HIDDEN].view(T, HIDDEN)  # its first row is k_out's last
    positions = torch.randperm(P)[:T]
    k_ref, _ = m(hidden.clone(), positions)
    k_out = memory[:n].view(L, T, H, D)
    before = memory.clone()
    takes_fused = path == "fused" and typedkv.core.launcher.use_kernel(hidden.device)
    if takes_fused:
        with pytest.raises(typedkv.InputError, match=r"^k_out: expected memory apart from hidden"):
            m(hidden, positions, k_out=k_out)
        assert torch.equal(memory, before)
        k_out = torch.empty(L, T, H, D)
    k, _ = m(hidden, positions, k_out=k_out)
    assert torch.equal(k, k_ref)
    # An eager layout seen before is checked again at its new addresses.
    if takes_fused:
        m(hidden.clone(), positions, k_out=torch.empty(L, T, H, D))
        with pytest.raises(typedkv.InputError, match=r"^k_out: expected memory apart from hidden"):
            m(hidden, positions, k_out=memory[:n].view(L, T, H, D))


@pytest.mark.parametrize("path", ["fused", "gemm"])
@pytest.mark.parametrize("buffer", ["kv_weight", "kv_bias"])
def test_materializer_outputs_over_its_weights(path: str, buffer: str) -> None:
    """Outputs or pools over the materializer's own weight or bias would overwrite what this call's projection
    reads, and every later call's: rejected on every path, before anything is written."""
    torch.manual_seed(3)
    # The buffer lies at the start of memory large enough for an output or a pool laid over it.
    memory = torch.randn(L * max(T, S) * H * D + L * 2 * H * D * HIDDEN)
    weight = torch.randn(L, 2 * H * D, HIDDEN) / HIDDEN**0.5
    bias = torch.randn(L, 2 * H * D)
    if buffer == "kv_weight":
        weight = memory[: weight.numel()].view_as(weight).copy_(weight)
    else:
        bias = memory[: bias.numel()].view_as(bias).copy_(bias)
    m = typedkv.KVMaterializer(
        weight, torch.rand(L, D) + 0.5, 1e-6, typedkv.cos_sin_cache(P, D), num_kv_heads=H, kv_bias=bias
    )
    assert getattr(m, buffer).data_ptr() == memory.data_ptr()  # kept as given, not copied
    m.projection_path = path  # type: ignore[assignment]
    hidden, positions = torch.randn(T, HIDDEN), torch.randperm(P)[:T]
    k_ref, v_ref = m(hidden, positions)
    weights = m.kv_weight.clone(), cast(Tensor, m.kv_bias).clone()
    k_out, v_out = memory[: L * T * H * D].view(L, T, H, D), torch.empty(L, T, H, D)
    with pytest.raises(typedkv.InputError, match=rf"^k_out: expected memory apart from {buffer}, got memory shared"):
        m(hidden, positions, k_out=k_out, v_out=v_out)
    k_pool, v_pool = torch.zeros(L, S, H, D), memory[: L * S * H * D].view(L, S, H, D)
    with pytest.raises(typedkv.InputError, match=rf"^v_pool: expected memory apart from {buffer}, got memory shared"):
        m.into_pool(hidden, positions, torch.randperm(S)[:T], k_pool, v_pool)
    assert torch.equal(m.kv_weight, weights[0]) and torch.equal(cast(Tensor, m.kv_bias), weights[1])
    assert not k_pool.any()
    k, v = m(hidden, positions)  # the weights are intact: the same answer as before
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_mla_materializer_output_over_its_weight() -> None:
    torch.manual_seed(4)
    latent, rope = 16, 8
    m = typedkv.MLAKVMaterializer(
        torch.randn(L, latent + rope, HIDDEN) / HIDDEN**0.5, torch.rand(L, latent) + 0.5, 1e-6,
        typedkv.cos_sin_cache(P, rope), rope_style="neox",
    )  # fmt: skip
    hidden, positions = torch.randn(T, HIDDEN), torch.randperm(P)[:T]
    weight = m.kv_a_weight.clone()
    out = m.kv_a_weight.view(-1)[: L * T * (latent + rope)].view(L, T, latent + rope)
    with pytest.raises(typedkv.InputError, match=r"^out: expected memory apart from kv_a_weight, got memory shared"):
        m(hidden, positions, out=out)
    assert torch.equal(m.kv_a_weight, weight)
    m(hidden, positions, out=torch.empty(L, T, latent + rope))
