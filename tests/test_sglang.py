"""typedkv.integrations.sglang against sglang's own DFlash helper.

sglang's ``FusedKVMaterializeHelper`` is loaded from the pinned wheel (one file,
``sglang/kernels/ops/speculative/fused_kv_materialize.py``, which imports only
torch and triton), by path: the sglang package is never imported. The wheel is
looked for in ``.whl/`` (carried to machines without network), then ``.sglang/``
(where ``nox -s sglang`` downloads it). Without it the comparisons skip, unless
``TYPEDKV_REQUIRE_SGLANG=1`` (set by ``nox -s sglang``) makes that a failure.
Without CUDA, sglang's Triton kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``
for the whole run; without it the comparisons skip).

Both helpers are fed the same sglang-shaped layers (small stand-ins carrying the
attributes sglang reads). V must be sglang's bit for bit. K may differ by the
rounding typedkv adds (see `k_tolerance`). The cases sglang's worker refuses
(GPT-J RoPE, FP8 scales) are checked against a float64 oracle of the unfused path.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from reference64 import materialize_kv64
from test_docs import check_callable, check_docstring, code_blocks, titled_blocks
from torch import Tensor

import typedkv
from typedkv.integrations import sglang as adapter
from typedkv.integrations.sglang import FusedKVMaterializeHelper
from typedkv.tools.bench_e2e import Draft, e2e_table, load_sglang, run_e2e

ROOT = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.23"
SGLANG_FILE = "sglang/kernels/ops/speculative/fused_kv_materialize.py"
WHEEL_DIRS = (ROOT / ".whl", ROOT / ".sglang")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Triton's interpreter runs sglang's kernel program by program: small shapes on CPU.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 5, 8, 128
EPS = (1e-6, 1e-5, 2.0, 1e-6, 30.0)  # one per layer; large ones so that a layer given another's eps fails


def sglang_wheel() -> Path | None:
    """The pinned sglang wheel in .whl/ or .sglang/, if one is there."""
    for folder in WHEEL_DIRS:
        found = sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if found:
            return found[0]
    return None


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """sglang's fused_kv_materialize module, loaded by path from the wheel."""
    wheel = sglang_wheel()
    if wheel is None:
        reason = f"the sglang {SGLANG_VERSION} wheel is not in .whl/ or .sglang/ (nox -s sglang downloads it)"
        if os.environ.get("TYPEDKV_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton picks its interpreter when it is imported: it must be on for the whole process.
        pytest.skip("sglang's Triton kernel needs CUDA, or TRITON_INTERPRET=1 on CPU (nox -s sglang sets it)")
    folder = tmp_path_factory.mktemp("sglang")
    with zipfile.ZipFile(wheel) as archive:
        path = folder / "fused_kv_materialize.py"
        path.write_bytes(archive.read(SGLANG_FILE))
    spec = importlib.util.spec_from_file_location("sglang_fused_kv_materialize", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- sglang-shaped layers


class Shape(NamedTuple):
    hidden: int
    num_heads: int  # query heads: q_size = num_heads * HEAD_DIM rows come first in the fused QKV weight


SMALL_SHAPE = Shape(hidden=64, num_heads=8)


class Rotary(torch.nn.Module):
    """The attributes sglang's helper reads from a rotary module, and its table growth."""

    cos_sin_cache: Tensor

    def __init__(self, rotary_dim: int, max_position: int, *, is_neox_style: bool = True, device: Any = DEVICE):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.extended_to: int | None = None
        self.register_buffer("cos_sin_cache", _table(max_position, rotary_dim, device), persistent=False)

    def _ensure_cos_sin_cache_length(self, needed_max_pos: int) -> None:
        self.extended_to = needed_max_pos
        if needed_max_pos >= self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = _table(needed_max_pos + 1, self.rotary_dim, self.cos_sin_cache.device)


def _table(num_positions: int, rotary_dim: int, device: Any) -> Tensor:
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def make_layers(
    shape: Shape,
    *,
    dtype: torch.dtype,
    rotary: Rotary,
    seed: int = 0,
    bias: bool = False,
    device: Any = DEVICE,
) -> list[SimpleNamespace]:
    """Qwen3-style DFlash layers: fused QKV weights [q_size + 2*kv_size, hidden], a K RMSNorm per layer."""
    gen = torch.Generator().manual_seed(seed)
    hidden, q_size, kv_size = shape.hidden, shape.num_heads * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    layers = []
    for i in range(NUM_LAYERS):
        # Multiples of 1/64 (and integer hidden states, `_inputs`): every product and partial sum of the
        # projection is exact in float32, so the helpers' GEMMs (torch.mm on W.T as a view, or on a
        # transposed copy) agree bit for bit whatever their accumulation order, and V can be compared so.
        weight = (torch.randint(-8, 9, (q_size + 2 * kv_size, hidden), generator=gen) / 64).to(dtype)
        qkv_bias = (torch.randint(-8, 9, (q_size + 2 * kv_size,), generator=gen) / 64).to(dtype) if bias else None
        norm = (1.0 + 0.2 * torch.randn(HEAD_DIM, generator=gen)).to(dtype)
        attn = SimpleNamespace(
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            q_size=q_size,
            kv_size=kv_size,
            qkv_proj=SimpleNamespace(weight=weight.to(device), bias=None if qkv_bias is None else qkv_bias.to(device)),
            k_norm=SimpleNamespace(weight=norm.to(device), variance_epsilon=EPS[i]),
            rotary_emb=rotary,
            attn=SimpleNamespace(layer_id=i, k_scale=None, v_scale=None),
            v_scale=None,
        )
        layers.append(SimpleNamespace(self_attn=attn))
    return layers


def make_pool(num_slots: int, dtype: torch.dtype, *, device: Any = DEVICE) -> SimpleNamespace:
    """sglang's MHATokenToKVPool buffers: per layer K and V [S, H, D] as the two halves of one allocation."""
    store = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    fused = [torch.zeros(2, num_slots, NUM_KV_HEADS, HEAD_DIM, dtype=store, device=device) for _ in range(NUM_LAYERS)]
    return SimpleNamespace(
        k_buffer=[b[0] for b in fused],
        v_buffer=[b[1] for b in fused],
        dtype=dtype,
        store_dtype=store,
        start_layer=0,
        kv_cache_layout="nhd",
        is_quantized_kv_cache=False,
    )


def set_kv_buffer(pool: SimpleNamespace, layer: SimpleNamespace, loc: Tensor, k: Tensor, v: Tensor) -> None:
    """What MHATokenToKVPool.set_kv_buffer stores for an NHD pool: scaled, cast, viewed as store_dtype, row writes."""
    radix = layer.self_attn.attn
    if k.dtype != pool.dtype:
        if radix.k_scale is not None:
            k.div_(radix.k_scale)
        if radix.v_scale is not None:
            v.div_(radix.v_scale)
        k, v = k.to(pool.dtype), v.to(pool.dtype)
    index = radix.layer_id - pool.start_layer
    pool.k_buffer[index][loc] = k.view(pool.store_dtype)
    pool.v_buffer[index][loc] = v.view(pool.store_dtype)


def collect(helper: Any, hidden: Tensor, positions: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Each layer's (K, V) as handed to ``write_layer_kv``, copied, in call order."""
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    calls: list[int] = []

    def write_layer_kv(i: int, k: Tensor, v: Tensor) -> None:
        calls.append(i)
        ks.append(k.clone())
        vs.append(v.clone())

    helper.materialize(hidden, positions, write_layer_kv)
    assert calls == list(range(NUM_LAYERS)) or (hidden.shape[0] == 0 and calls == [])
    return ks, vs


def unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]


def k_tolerance(k: Tensor, dtype: torch.dtype) -> Tensor:
    """How far typedkv's K may be from sglang's, per element: ``4 u max|K row|``.

    typedkv rounds the normed K to the storage dtype before RoPE (as the unfused
    model path stores it); sglang's kernel keeps it in float32 and rounds once,
    after RoPE. The extra rounding moves each of a rotation's two inputs by at
    most ``u |x|`` (``u`` the dtype's unit roundoff), so the rotated value by at
    most ``sqrt(2) u max|x|``; the two results may then round to neighbouring
    values of the dtype (one unit in the last place, ``<= 2 u |out|``). The sum is
    below ``4 u`` times the largest magnitude in the head's row.
    """
    row_max = k.float().abs().amax(dim=-1, keepdim=True)
    return 4 * unit_roundoff(dtype) * row_max


def assert_k_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    diff = (got.float() - want.float()).abs()
    bound = k_tolerance(want, dtype)
    worst = (diff - bound).max()
    assert worst <= 0, f"K differs beyond 4u*max|row|: max excess {float(worst):.3g}, max diff {float(diff.max()):.3g}"


# --------------------------------------------------------------------------- against sglang's helper


# CPU: hidden 256 keeps the interpreter quick; GPU: the Qwen3 draft's hidden 4096 and 32 query heads.
CPU_SHAPE = Shape(hidden=256, num_heads=16)
GPU_SHAPE = Shape(hidden=4096, num_heads=32)
# (rotary_dim, dtype): full and partial rotary.
CPU_CASES = [(128, torch.bfloat16), (64, torch.float16)]


def _helpers(sglang: ModuleType, rotary_dim: int, dtype: torch.dtype, shape: Shape) -> tuple[Any, Any, Any]:
    rotary = Rotary(rotary_dim, 4096)
    layers = make_layers(shape, dtype=dtype, rotary=rotary)
    args = (layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    theirs = sglang.FusedKVMaterializeHelper(*args, max_position_hint=4096)
    ours = FusedKVMaterializeHelper(*args, max_position_hint=4096)
    return layers, theirs, ours


def _inputs(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ctx_hidden = torch.randint(-2, 3, (num_tokens, hidden), generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    return ctx_hidden, positions


def check_materialize(sglang: ModuleType, rotary_dim: int, dtype: torch.dtype, shape: Shape, T: int) -> None:
    _, theirs, ours = _helpers(sglang, rotary_dim, dtype, shape)
    ctx_hidden, positions = _inputs(T, shape.hidden, dtype)
    want_k, want_v = collect(theirs, ctx_hidden, positions)
    got_k, got_v = collect(ours, ctx_hidden, positions)
    for i in range(NUM_LAYERS):
        assert got_v[i].shape == want_v[i].shape == (T, NUM_KV_HEADS, HEAD_DIM)
        assert torch.equal(got_v[i], want_v[i]), f"layer {i}: V differs from sglang's"
        assert_k_close(got_k[i], want_k[i], dtype)


def check_into_pool(
    sglang: ModuleType, rotary_dim: int, dtype: torch.dtype, pool_dtype: torch.dtype, shape: Shape, T: int
) -> None:
    layers, theirs, ours = _helpers(sglang, rotary_dim, dtype, shape)
    ctx_hidden, positions = _inputs(T, shape.hidden, dtype)
    num_slots = 2 * T + 8
    cache_loc = torch.randperm(num_slots, generator=torch.Generator().manual_seed(2))[:T].to(DEVICE)
    want, got = make_pool(num_slots, pool_dtype), make_pool(num_slots, pool_dtype)
    theirs.materialize(ctx_hidden, positions, lambda i, k, v: set_kv_buffer(want, layers[i], cache_loc, k, v))
    ours.materialize_into_pool(ctx_hidden, positions, cache_loc, got)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[cache_loc] = False
    for i in range(NUM_LAYERS):
        assert torch.equal(got.v_buffer[i], want.v_buffer[i]), f"layer {i}: V pool differs from sglang's"
        assert not got.k_buffer[i][untouched].any(), f"layer {i}: a slot outside cache_loc was written"
        got_k, want_k = (p.k_buffer[i][cache_loc].view(pool_dtype).float() for p in (got, want))
        if pool_dtype == dtype:
            assert_k_close(got_k, want_k, dtype)
        else:
            # FP8 (scale 1): each may also round to a neighbouring FP8 value (3 mantissa bits: 2^-3 relative).
            assert ((got_k - want_k).abs() <= 2.0**-3 * want_k.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize(("rotary_dim", "dtype"), CPU_CASES)
@pytest.mark.parametrize("T", [1, 13])
def test_materialize_matches_sglang(sglang: ModuleType, rotary_dim: int, dtype: torch.dtype, T: int) -> None:
    check_materialize(sglang, rotary_dim, dtype, CPU_SHAPE, T)


@pytest.mark.parametrize(("rotary_dim", "dtype"), CPU_CASES)
@pytest.mark.parametrize("pool", ["same", "fp8"])
def test_into_pool_matches_sglang_set_kv_buffer(
    sglang: ModuleType, rotary_dim: int, dtype: torch.dtype, pool: str
) -> None:
    check_into_pool(sglang, rotary_dim, dtype, dtype if pool == "same" else torch.float8_e4m3fn, CPU_SHAPE, 9)


def test_empty_call_is_a_no_op(sglang: ModuleType) -> None:
    _, theirs, ours = _helpers(sglang, 128, torch.bfloat16, CPU_SHAPE)
    ctx_hidden, positions = _inputs(0, CPU_SHAPE.hidden, torch.bfloat16)
    unread = torch.zeros(3, dtype=torch.int64, device=DEVICE)  # with T == 0 positions are not even looked at
    for helper in (theirs, ours):
        for pos in (positions, unread):
            helper.materialize(ctx_hidden, pos, lambda i, k, v: pytest.fail("write_layer_kv called for T == 0"))
    pool = make_pool(8, torch.bfloat16)
    ours.materialize_into_pool(ctx_hidden, positions, torch.empty(0, dtype=torch.int64, device=DEVICE), pool)
    assert not any(b.any() for b in (*pool.k_buffer, *pool.v_buffer))


def test_sglang_refuses_gptj(sglang: ModuleType) -> None:
    """The case sglang's helper turns away (its worker falls back to the per-layer path); typedkv serves it below."""
    rotary = Rotary(128, 64, is_neox_style=False)
    layers = make_layers(CPU_SHAPE, dtype=torch.bfloat16, rotary=rotary)
    with pytest.raises(NotImplementedError):
        sglang.FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)


@pytest.fixture
def exact_gemm() -> Iterator[None]:
    """cuBLAS may add bf16/fp16 partial sums in their own precision (split-K): off, so the exact GEMM stays exact."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    yield
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_gemm")
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("T", [1, 16, 257])
def test_gpu_materialize_matches_sglang(sglang: ModuleType, rotary_dim: int, T: int) -> None:
    check_materialize(sglang, rotary_dim, torch.bfloat16, GPU_SHAPE, T)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_gemm")
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_into_pool_matches_sglang_set_kv_buffer(sglang: ModuleType, pool_dtype: torch.dtype) -> None:
    check_into_pool(sglang, 64, torch.bfloat16, pool_dtype, GPU_SHAPE, 300)


@pytest.mark.gpu
@pytest.mark.production
def test_gpu_into_pool_replays_in_a_cuda_graph_without_a_sync() -> None:
    """The fast path in sglang's setting: no host sync, captured once, replayed into the pool (FP8, tensor scales)."""
    dtype, T = torch.bfloat16, 64
    rotary = Rotary(64, 4096)
    layers = make_layers(GPU_SHAPE, dtype=dtype, rotary=rotary)
    for i, layer in enumerate(layers):
        layer.self_attn.attn.k_scale = torch.tensor(0.5 + i, device=DEVICE)
        layer.self_attn.attn.v_scale = torch.tensor(2.0, device=DEVICE)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, max_position_hint=4096)
    ctx_hidden, positions = _inputs(T, GPU_SHAPE.hidden, dtype)
    cache_loc = torch.arange(T, device=DEVICE) * 3
    eager, graphed = make_pool(3 * T, torch.float8_e4m3fn), make_pool(3 * T, torch.float8_e4m3fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        helper.materialize_into_pool(ctx_hidden, positions, cache_loc, graphed)  # warm-up: checks, compiles
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        helper.materialize_into_pool(ctx_hidden, positions, cache_loc, eager)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for buffer in (*graphed.k_buffer, *graphed.v_buffer):
        buffer.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        helper.materialize_into_pool(ctx_hidden, positions, cache_loc, graphed)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((*graphed.k_buffer, *graphed.v_buffer), (*eager.k_buffer, *eager.v_buffer), strict=True):
        assert torch.equal(got, want)
    assert eager.k_buffer[0][cache_loc].any()


# --------------------------------------------------------------------------- against the float64 oracle


def oracle(
    layers: list[SimpleNamespace], rotary: Rotary, ctx_hidden: Tensor, positions: Tensor, rope_style: str
) -> tuple[Tensor, Tensor]:
    """The unfused model path: each layer's projection (with bias), K RMSNorm rounded, then RoPE, in float64."""
    attn = [layer.self_attn for layer in layers]
    rows = slice(attn[0].q_size, attn[0].q_size + 2 * attn[0].kv_size)
    kv = torch.stack(
        [
            torch.nn.functional.linear(
                ctx_hidden, a.qkv_proj.weight[rows], None if a.qkv_proj.bias is None else a.qkv_proj.bias[rows]
            )
            for a in attn
        ],
        dim=1,
    )
    norm = torch.stack([a.k_norm.weight for a in attn])
    eps = torch.tensor([a.k_norm.variance_epsilon for a in attn], dtype=torch.float64)
    return materialize_kv64(kv, norm, eps, rotary.cos_sin_cache, positions, NUM_KV_HEADS, rope_style)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("bias", [False, True])
def test_materialize_against_oracle(rope_style: str, bias: bool) -> None:
    """GPT-J RoPE (sglang refuses it) and a QKV bias (sglang refuses it) through the sglang contract."""
    dtype = torch.float16
    rotary = Rotary(64, 512, is_neox_style=rope_style == "neox")
    layers = make_layers(CPU_SHAPE, dtype=dtype, rotary=rotary, bias=bias)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, max_position_hint=512)
    ctx_hidden, positions = _inputs(11, CPU_SHAPE.hidden, dtype)
    positions %= 512
    k, v = collect(helper, ctx_hidden, positions)
    want_k, want_v = oracle(layers, rotary, ctx_hidden, positions, rope_style)
    for i in range(NUM_LAYERS):
        torch.testing.assert_close(v[i], want_v[i], rtol=2 * unit_roundoff(dtype), atol=1e-3)
        # typedkv's K is the oracle's, rounded once to the dtype (plus float32 arithmetic).
        torch.testing.assert_close(k[i].double(), want_k[i], rtol=2 * unit_roundoff(dtype), atol=1e-3)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_fp8_scales_against_oracle(rope_style: str) -> None:
    """Per-layer FP8 scales other than 1 (sglang refuses them): stored K/V = x / scale, saturated."""
    dtype = torch.bfloat16
    rotary = Rotary(128, 512, is_neox_style=rope_style == "neox")
    layers = make_layers(CPU_SHAPE, dtype=dtype, rotary=rotary)
    k_scales = [0.5, 0.25, 2.0, 1.0, None]
    v_scales = [torch.tensor(0.125), torch.tensor(1.5), None, torch.tensor(0.5), torch.tensor(3.0)]
    for layer, ks, vs in zip(layers, k_scales, v_scales, strict=True):
        layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = ks, vs
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, max_position_hint=512)
    ctx_hidden, positions = _inputs(10, CPU_SHAPE.hidden, dtype)
    positions %= 512
    cache_loc = torch.arange(3, 13, device=DEVICE)
    pool = make_pool(16, torch.float8_e4m3fn)
    helper.materialize_into_pool(ctx_hidden, positions, cache_loc, pool)
    want_k, want_v = oracle(layers, rotary, ctx_hidden, positions, rope_style)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for i in range(NUM_LAYERS):
        k_scale = 1.0 if k_scales[i] is None else float(k_scales[i])  # type: ignore[arg-type]
        v_scale = 1.0 if v_scales[i] is None else float(v_scales[i])  # type: ignore[arg-type]
        for stored, want, scale in (
            (pool.k_buffer[i], want_k[i], k_scale),
            (pool.v_buffer[i], want_v[i].double(), v_scale),
        ):
            got = stored[cache_loc].view(torch.float8_e4m3fn).double()
            expected = (want / scale).clamp(-fp8_max, fp8_max)
            # One FP8 rounding (2^-4 relative) of a value already within a bf16 rounding of the oracle's.
            assert ((got - expected).abs() <= 2.0**-4 * expected.abs() + 2.0**-9).all(), f"layer {i}"


def test_positions_and_hidden_are_taken_as_sglang_takes_them() -> None:
    """positions of any shape with T elements and any integer dtype; hidden in another dtype is cast."""
    rotary = Rotary(128, 64)
    layers = make_layers(CPU_SHAPE, dtype=torch.float16, rotary=rotary)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    ctx_hidden, positions = _inputs(6, CPU_SHAPE.hidden, torch.float16)
    positions %= 64
    want_k, want_v = collect(helper, ctx_hidden, positions)
    got_k, got_v = collect(helper, ctx_hidden.float(), positions.to(torch.int32).reshape(2, 3))
    for i in range(NUM_LAYERS):
        assert torch.equal(got_k[i], want_k[i]) and torch.equal(got_v[i], want_v[i])


@pytest.mark.gpu
def test_layers_on_several_devices_are_gathered_on_the_helpers() -> None:
    """Draft layers left on the CPU beside layers on the GPU (a model being loaded or offloaded) are copied to
    the helper's device, one layer at a time, before they are stacked: the same K and V as all on the GPU."""
    rotary = Rotary(128, 64)
    layers = make_layers(CPU_SHAPE, dtype=torch.float16, rotary=rotary, bias=True)
    ctx_hidden, positions = _inputs(6, CPU_SHAPE.hidden, torch.float16)
    want = collect(FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, "cuda"), ctx_hidden, positions)
    for layer in layers[::2]:
        attn = layer.self_attn
        attn.qkv_proj.weight, attn.qkv_proj.bias = attn.qkv_proj.weight.cpu(), attn.qkv_proj.bias.cpu()
        attn.k_norm.weight = attn.k_norm.weight.cpu()
    got = collect(FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, "cuda"), ctx_hidden, positions)
    for got_layers, want_layers in zip(got, want, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got_layers, want_layers, strict=True))


def test_rope_table_grows_to_the_hint() -> None:
    """max_position_hint extends the rotary module's table through its own method, once, at construction."""
    rotary = Rotary(128, 16)
    layers = make_layers(CPU_SHAPE, dtype=torch.float16, rotary=rotary)
    FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, max_position_hint=100)
    assert rotary.extended_to == 99 and rotary.cos_sin_cache.shape[0] == 100


def test_without_a_hint_materialize_grows_the_table() -> None:
    """As sglang's helper: without a hint, each call extends the table to its largest position."""
    rotary = Rotary(128, 16)
    layers = make_layers(CPU_SHAPE, dtype=torch.float16, rotary=rotary)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    ctx_hidden, _ = _inputs(3, CPU_SHAPE.hidden, torch.float16)
    positions = torch.tensor([0, 40, 7], device=DEVICE)
    k, _ = collect(helper, ctx_hidden, positions)
    assert rotary.extended_to == 40
    assert all(torch.isfinite(layer_k).all() for layer_k in k)


def test_hnd_pool_and_layer_offsets() -> None:
    """An HND pool (SGLANG_USE_HND_KVCACHE: pages [N, H, B, D]) and layer ids offset by the pool's start_layer."""
    dtype = torch.float16
    rotary = Rotary(128, 64)
    layers = make_layers(CPU_SHAPE, dtype=dtype, rotary=rotary)
    for i, layer in enumerate(layers):
        layer.self_attn.attn.layer_id = 10 + i
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    ctx_hidden, positions = _inputs(7, CPU_SHAPE.hidden, dtype)
    positions %= 64
    cache_loc = torch.tensor([3, 17, 4, 30, 9, 0, 22], device=DEVICE)
    page = 4
    pages = [torch.zeros(2, 8, NUM_KV_HEADS, page, HEAD_DIM, dtype=dtype, device=DEVICE) for _ in range(NUM_LAYERS + 1)]
    pool = SimpleNamespace(
        k_buffer=[p[0] for p in pages], v_buffer=[p[1] for p in pages], dtype=dtype, store_dtype=dtype,
        start_layer=9, kv_cache_layout="hnd", is_quantized_kv_cache=False,
    )  # fmt: skip
    helper.materialize_into_pool(ctx_hidden, positions, cache_loc, pool)
    k, v = collect(helper, ctx_hidden, positions)
    assert not pool.k_buffer[0].any(), "layer id 9 is not a draft layer: its buffer stays untouched"
    for i in range(NUM_LAYERS):
        k_buf, v_buf = pool.k_buffer[i + 1], pool.v_buffer[i + 1]
        assert torch.equal(k_buf[cache_loc // page, :, cache_loc % page], k[i])
        assert torch.equal(v_buf[cache_loc // page, :, cache_loc % page], v[i])


# --------------------------------------------------------------------------- what typedkv refuses, by name


def _attempt(change: Any, *, pool: Any = None) -> None:
    """Build the helper from layers ``change`` edits; with a pool, write one token into it."""
    rotary = Rotary(128, 64)
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=rotary)
    change(layers)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    if pool is not None:
        hidden = torch.zeros(1, 64, dtype=torch.float16, device=DEVICE)
        index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        helper.materialize_into_pool(hidden, index, index, pool)


def _refused(change: Any, message: str, *, pool: Any = None) -> None:
    with pytest.raises(typedkv.InputError) as caught:
        _attempt(change, pool=pool)
    assert str(caught.value) == message


class UnquantizedLinearMethod:
    pass


class Fp8LinearMethod:
    pass


def _set(path: str, value: Any, layer: int = 2) -> Any:
    def change(layers: list[SimpleNamespace]) -> None:
        *parents, name = path.split(".")
        obj: Any = layers[layer]
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, name, value)

    return change


REFUSALS = {
    "quantized projection": (
        _set("self_attn.qkv_proj.quant_method", Fp8LinearMethod()),
        "layers[2].self_attn.qkv_proj.quant_method: expected None or UnquantizedLinearMethod, got Fp8LinearMethod: "
        "typedkv reads float projection weights; a quantized projection takes the per-layer path",
    ),
    "int8 weight": (
        _set("self_attn.qkv_proj.weight", torch.zeros(3072, 64, dtype=torch.int8)),
        "layers[2].self_attn.qkv_proj.weight: expected a 2-dim float16, bfloat16 or float32 tensor, got dtype "
        "torch.int8, shape (3072, 64): a quantized projection takes the per-layer path",
    ),
    "bias of the wrong length": (
        _set("self_attn.qkv_proj.bias", torch.zeros(2048, dtype=torch.float16)),
        "layers[2].self_attn.qkv_proj.bias: expected shape (3072,) and dtype torch.float16 (one per weight row), "
        "got shape (2048,), dtype torch.float16",
    ),
    "bias on layer 0 only": (
        _set("self_attn.qkv_proj.bias", torch.zeros(3072, dtype=torch.float16), layer=0),
        "layers[1].self_attn.qkv_proj.bias: expected a bias (as layer 0), got None: "
        "every draft layer has a bias or none does",
    ),
    "bias on a later layer only": (
        _set("self_attn.qkv_proj.bias", torch.zeros(3072, dtype=torch.float16), layer=3),
        "layers[3].self_attn.qkv_proj.bias: expected None (as layer 0), got a bias: "
        "every draft layer has a bias or none does",
    ),
    "other kv heads": (
        _set("self_attn.num_kv_heads", 4),
        "layers[2].self_attn.num_kv_heads: expected 8 (the helper's num_kv_heads), got 4: "
        "the fused path needs every draft layer alike",
    ),
    "other rotary": (
        _set("self_attn.rotary_emb", SimpleNamespace(rotary_dim=64, is_neox_style=True)),
        "layers[2].self_attn.rotary_emb: expected rotary_dim=128, is_neox_style=True (rotary_emb's), "
        "got rotary_dim=64, is_neox_style=True",
    ),
    "value scale": (
        _set("self_attn.v_scale", 0.5),
        "layers[2].self_attn.v_scale: expected None, got 0.5: the fused path stores V as projected; "
        "a draft with an attention value scale takes the per-layer path",
    ),
    "gemma norm": (
        _set("self_attn.k_norm", type("GemmaRMSNorm", (), {"weight": torch.ones(128), "variance_epsilon": 1e-6})()),
        "layers[2].self_attn.k_norm: expected an RMSNorm (x * weight / rms), got GemmaRMSNorm: "
        "the fused path computes a plain RMSNorm",
    ),
    "no k_norm": (
        _set("self_attn", SimpleNamespace(num_kv_heads=8, head_dim=128)),
        "layers[2].self_attn.rotary_emb: expected sglang's attribute, got SimpleNamespace without it",
    ),
    "other kv_size": (
        _set("self_attn.kv_size", 512),
        "layers[2].self_attn.kv_size: expected num_kv_heads * head_dim = 1024, got 512",
    ),
    "projection without K/V rows": (
        _set("self_attn.qkv_proj.weight", torch.zeros(2048, 64, dtype=torch.float16)),
        "layers[2].self_attn.qkv_proj.weight: expected at least q_size + 2*kv_size = 3072 rows, got shape (2048, 64)",
    ),
    "norm of another width": (
        _set("self_attn.k_norm", SimpleNamespace(weight=torch.ones(64, dtype=torch.float16), variance_epsilon=1e-6)),
        "layers[2].self_attn.k_norm.weight: expected shape (128,) (head_dim), got shape (64,)",
    ),
    "head_dim not a number": (
        _set("self_attn.head_dim", None),
        "layers[2].self_attn.head_dim: expected an integer, got None",
    ),
    "layer_id not a number": (
        _set("self_attn.attn.layer_id", "x"),
        "layers[2].self_attn.attn.layer_id: expected an integer, got 'x'",
    ),
    "eps not a number": (
        _set("self_attn.k_norm.variance_epsilon", None),
        "layers[2].self_attn.k_norm.variance_epsilon: expected a number, got None",
    ),
    **{
        f"eps {name}": (
            _set("self_attn.k_norm.variance_epsilon", value),
            "layers[2].self_attn.k_norm.variance_epsilon: expected a number >= 0 within float32's range "
            f"(at most 3.4e+38), got {got}: RMSNorm divides by sqrt(mean square + eps)",
        )
        for name, value, got in (
            ("nan", float("nan"), "nan"),
            ("negative", -1e-6, "-1e-06"),
            ("inf", float("inf"), "inf"),
            ("beyond float32", 1e39, "1e+39"),
        )
    },
    "a layer's weight without data": (
        _set("self_attn.qkv_proj.weight", torch.empty(3072, 64, dtype=torch.float16, device="meta")),
        f"layers[2].self_attn.qkv_proj.weight: expected a tensor with data, got one on the meta device: "
        f"load the draft's weights before building the helper (for {DEVICE})",
    ),
    "a layer's norm without data": (
        _set("self_attn.k_norm.weight", torch.empty(128, dtype=torch.float16, device="meta")),
        f"layers[2].self_attn.k_norm.weight: expected a tensor with data, got one on the meta device: "
        f"load the draft's weights before building the helper (for {DEVICE})",
    ),
    "a layer's weight in another dtype": (
        _set("self_attn.qkv_proj.weight", torch.zeros(3072, 64, dtype=torch.bfloat16)),
        "layers[2].self_attn.qkv_proj.weight: expected dtype torch.float16 (layer 0's), got torch.bfloat16: "
        "the fused path projects every draft layer in one GEMM",
    ),
    "a layer's norm in another dtype": (
        _set("self_attn.k_norm.weight", torch.ones(128, dtype=torch.float32)),
        "layers[2].self_attn.k_norm.weight: expected dtype torch.float16 (layer 0's), got torch.float32: "
        "the fused path stacks every draft layer's K norm",
    ),
    "a scale per channel": (
        _set("self_attn.attn.k_scale", torch.ones(2)),
        "layers[2].self_attn.attn.k_scale: expected one per-tensor scale, got shape (2,)",
    ),
    **{
        f"{attr} {name}": (
            _set(f"self_attn.attn.{attr}", value),
            f"layers[2].self_attn.attn.{attr}: expected a finite number > 0 in float32's normal range "
            f"[1.18e-38, 3.4e+38], got {got}: the FP8 pool stores {attr[0].upper()} / {attr}",
        )
        for attr, name, value, got in (
            ("k_scale", "zero", 0.0, "0.0"),
            ("v_scale", "negative", -1.0, "-1.0"),
            ("k_scale", "nan", float("nan"), "nan"),
            ("v_scale", "inf", float("inf"), "inf"),
            ("k_scale", "below float32's normals", 1e-39, "1e-39"),
            ("v_scale", "beyond float32", 1e39, "1e+39"),
            ("k_scale", "nan tensor", torch.tensor(float("nan")), "nan"),
            ("v_scale", "zero tensor of one element", torch.zeros(1), "0.0"),
            ("k_scale", "float64 tensor below float32", torch.tensor(1e-300, dtype=torch.float64), "1e-300"),
            ("v_scale", "negative integer tensor", torch.tensor([-2]), "-2.0"),
        )
    },
    "a scale that is not a number": (
        _set("self_attn.attn.k_scale", "0.5"),
        "layers[2].self_attn.attn.k_scale: expected None, a number or a one-element tensor, got str",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_typedkv_cannot_serve_is_named(case: str) -> None:
    change, message = REFUSALS[case]
    _refused(change, message)


def test_scales_at_float32s_bounds_are_served() -> None:
    """The smallest normal and the largest float32 scale, as numbers or tensors, are kept exactly."""
    rotary = Rotary(128, 64)
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=rotary)
    f32 = torch.finfo(torch.float32)
    scales = [f32.tiny, torch.tensor(f32.max), torch.tensor([f32.tiny], dtype=torch.float64), 2, None]
    for layer, scale in zip(layers, scales, strict=True):
        layer.self_attn.attn.k_scale = layer.self_attn.attn.v_scale = scale
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)
    want = torch.tensor([f32.tiny, f32.max, f32.tiny, 2.0, 1.0], dtype=torch.float32, device=DEVICE)
    for got in (helper._k_scale, helper._v_scale):
        assert got is not None and got.dtype == torch.float32 and torch.equal(got, want)


def test_unquantized_method_is_served() -> None:
    rotary = Rotary(128, 64)
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=rotary)
    for layer in layers:
        layer.self_attn.qkv_proj.quant_method = UnquantizedLinearMethod()
    FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE)


def _pool(**changes: Any) -> SimpleNamespace:
    pool = make_pool(4, torch.float16)
    for name, value in changes.items():
        if value is None:
            delattr(pool, name)
        else:
            setattr(pool, name, value)
    return pool


POOL_REFUSALS = {
    "not a token pool": (
        _pool(k_buffer=None, v_buffer=None),
        "token_to_kv_pool: expected an sglang MHATokenToKVPool (per-layer k_buffer and v_buffer lists, dtype, "
        "store_dtype, start_layer), got SimpleNamespace without k_buffer, v_buffer: "
        "use materialize() with the pool's set_kv_buffer",
    ),
    "quantized KV cache": (
        _pool(is_quantized_kv_cache=True, quant_method=Fp8LinearMethod()),
        "token_to_kv_pool.is_quantized_kv_cache: expected False (an unquantized KV cache), got True (quant_method "
        "Fp8LinearMethod): quantized KV caches store through their own recipe; use materialize() with the pool's "
        "set_kv_buffer",
    ),
    "quantized KV cache without a quant_method": (
        _pool(is_quantized_kv_cache=True),
        "token_to_kv_pool.is_quantized_kv_cache: expected False (an unquantized KV cache), got True: quantized KV "
        "caches store through their own recipe; use materialize() with the pool's set_kv_buffer",
    ),
    "vectorized_5d": (
        _pool(kv_cache_layout="vectorized_5d"),
        "token_to_kv_pool.kv_cache_layout: expected 'nhd' or 'hnd', got 'vectorized_5d': "
        "use materialize() with the pool's set_kv_buffer",
    ),
    "other dtype": (
        _pool(dtype=torch.bfloat16),
        "token_to_kv_pool.dtype: expected torch.float16 (the weights' dtype), torch.float8_e4m3fn or "
        "torch.float8_e5m2, got torch.bfloat16",
    ),
    "other V head dim": (
        _pool(v_head_dim=64),
        "token_to_kv_pool.v_head_dim: expected 128 (the draft layers'), got 64: "
        "the pool must hold the draft layers' K and V heads",
    ),
    "layer outside the pool": (
        _pool(start_layer=1),
        "layers[0].self_attn.attn.layer_id: expected a layer of token_to_kv_pool (start_layer=1, 5 layers), got 0",
    ),
}


@pytest.mark.parametrize("case", list(POOL_REFUSALS))
def test_pools_typedkv_cannot_write_are_named(case: str) -> None:
    pool, message = POOL_REFUSALS[case]
    _refused(lambda layers: None, message, pool=pool)


def _helper(rotary: Any = None, **kwargs: Any) -> FusedKVMaterializeHelper:
    rotary = Rotary(128, 64) if rotary is None else rotary
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=rotary)
    return FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, **kwargs)


def _positions_of_another_count() -> None:
    hidden = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    _helper().materialize(hidden, torch.zeros(2, dtype=torch.int64, device=DEVICE), lambda i, k, v: None)


def _slots_of_another_count() -> None:
    hidden = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    three, two = (torch.zeros(n, dtype=torch.int64, device=DEVICE) for n in (3, 2))
    _helper().materialize_into_pool(hidden, three, two, make_pool(4, torch.float16))


def _slots_not_a_tensor() -> None:
    hidden = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    slots: Any = [0, 1, 2]
    _helper().materialize_into_pool(hidden, torch.arange(3, device=DEVICE), slots, make_pool(4, torch.float16))


def _no_layers() -> None:
    FusedKVMaterializeHelper([], Rotary(128, 64), NUM_KV_HEADS, HEAD_DIM, DEVICE)


def _rotary_without_a_table() -> None:
    _helper(SimpleNamespace(rotary_dim=128, is_neox_style=True, cos_sin_cache=None))


def _table_that_cannot_grow() -> None:
    # A rotary module without sglang's `_ensure_cos_sin_cache_length`, asked for more positions than it has.
    fixed = SimpleNamespace(rotary_dim=128, is_neox_style=True, cos_sin_cache=_table(64, 128, DEVICE))
    _helper(fixed, max_position_hint=100)


def _bogus_device() -> None:
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=Rotary(128, 64))
    FusedKVMaterializeHelper(layers, layers[0].self_attn.rotary_emb, NUM_KV_HEADS, HEAD_DIM, "bogus")


def _heads_not_a_number() -> None:
    layers = make_layers(SMALL_SHAPE, dtype=torch.float16, rotary=Rotary(128, 64))
    heads: Any = "eight"
    FusedKVMaterializeHelper(layers, layers[0].self_attn.rotary_emb, heads, HEAD_DIM, DEVICE)


def _float_positions() -> None:
    hidden = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    _helper().materialize(hidden, torch.tensor([0.0, 1.5, 2.9], device=DEVICE), lambda i, k, v: None)


def _materialize_hidden(ctx_hidden: Any) -> Callable[[], None]:
    return lambda: _helper().materialize(ctx_hidden, torch.arange(3, device=DEVICE), lambda i, k, v: None)


CALL_REFUSALS: dict[str, tuple[Callable[[], None], str]] = {
    "ctx_hidden of another width": (
        _materialize_hidden(torch.zeros(3, 65, dtype=torch.float16, device=DEVICE)),
        "ctx_hidden: expected shape (T, hidden=64) (qkv_proj.weight's columns), got (3, 65)",
    ),
    "3-dim ctx_hidden": (
        _materialize_hidden(torch.zeros(1, 3, 64, dtype=torch.float16, device=DEVICE)),
        "ctx_hidden: expected a 2-dim tensor [T, hidden], got shape (1, 3, 64)",
    ),
    "ctx_hidden not a tensor": (
        _materialize_hidden([[0.0] * 64] * 3),
        "ctx_hidden: expected a 2-dim tensor [T, hidden], got list",
    ),
    "bogus device": (_bogus_device, "device: expected a torch.device or a device string ('cuda:0'), got 'bogus'"),
    "num_kv_heads not a number": (_heads_not_a_number, "num_kv_heads: expected an integer, got 'eight'"),
    "float positions": (
        _float_positions,
        "positions: expected an integer tensor, got dtype torch.float32: positions index the RoPE table; "
        "a cast would truncate them",
    ),
    "positions of another count": (
        _positions_of_another_count,
        "positions: expected T=3 positions (one per token of ctx_hidden), got 2",
    ),
    "slots of another count": (
        _slots_of_another_count,
        "cache_loc: expected T=3 slots (one per token of ctx_hidden), got 2",
    ),
    "slots not a tensor": (_slots_not_a_tensor, "cache_loc: expected an int32 or int64 tensor of T=3 slots, got list"),
    "no layers": (_no_layers, "layers: expected at least one draft layer, got none"),
    "rotary without a table": (
        _rotary_without_a_table,
        "rotary_emb.cos_sin_cache: expected a tensor [P, rotary_dim], got NoneType",
    ),
    "table that cannot grow": (
        _table_that_cannot_grow,
        "rotary_emb.cos_sin_cache: expected at least 100 positions (max_position_hint or the largest position), "
        "got 64: extend the rotary table",
    ),
}


@pytest.mark.parametrize("case", list(CALL_REFUSALS))
def test_calls_and_rotary_tables_it_cannot_serve_are_named(case: str) -> None:
    call, message = CALL_REFUSALS[case]
    with pytest.raises(typedkv.InputError) as caught:
        call()
    assert str(caught.value) == message


# A misuse of materialize_into_pool's tensors: (ctx_hidden, positions) -> the misused pair, and the message's start.
POOL_CALL_MISUSES: dict[str, tuple[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], str]] = {
    "float positions": (lambda h, p: (h, p.float()), "positions: expected an integer tensor, got dtype torch.float32"),
    "ctx_hidden of another width": (lambda h, p: (h[:, :-1], p), "ctx_hidden: expected shape (T, hidden=64)"),
    "3-dim ctx_hidden": (lambda h, p: (h[None], p), "ctx_hidden: expected a 2-dim tensor [T, hidden]"),
}


@pytest.mark.parametrize("case", list(POOL_CALL_MISUSES))
def test_a_refused_call_writes_nothing_into_the_pool(case: str) -> None:
    misuse, message = POOL_CALL_MISUSES[case]
    hidden = torch.ones(3, 64, dtype=torch.float16, device=DEVICE)
    positions, cache_loc = torch.arange(3, device=DEVICE), torch.arange(3, device=DEVICE)
    pool = make_pool(4, torch.float16)
    with pytest.raises(typedkv.InputError) as caught:
        _helper().materialize_into_pool(*misuse(hidden, positions), cache_loc, pool)
    assert str(caught.value).startswith(message)
    assert not any(buffer.any() for buffer in (*pool.k_buffer, *pool.v_buffer))


def test_every_refusal_of_the_adapter_is_tested() -> None:
    """Each ``raise typedkv.InputError`` in the adapter is reached by one of this file's refusal cases (its
    messages name sglang's attributes, so they are listed here rather than in docs/errors.md)."""
    path = adapter.__file__
    sites = {
        node.lineno
        for node in ast.walk(ast.parse(Path(path).read_text()))
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and "InputError" in ast.unparse(node.exc.func)
    }
    assert sites, "found no `raise typedkv.InputError(` in the adapter"
    attempts: list[Callable[[], None]] = [
        *(functools.partial(_attempt, change) for change, _ in REFUSALS.values()),
        *(functools.partial(_attempt, lambda layers: None, pool=pool) for pool, _ in POOL_REFUSALS.values()),
        *(call for call, _ in CALL_REFUSALS.values()),
    ]
    reached = set()
    for attempt in attempts:
        with pytest.raises(typedkv.InputError) as caught:
            attempt()
        lines = [
            line for frame, line in traceback.walk_tb(caught.value.__traceback__) if frame.f_code.co_filename == path
        ]
        reached.add(lines[-1])
    missing = sorted(sites - reached)
    assert not missing, f"adapter refusals no case here reaches: lines {missing} of {path}"


def test_importing_the_adapter_needs_no_sglang() -> None:
    """Importing and building the adapter with every import of sglang refused."""
    script = """
import sys

class NoSglang:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang":
            raise ImportError("sglang must not be imported")

sys.meta_path.insert(0, NoSglang())
from typedkv.integrations import sglang as adapter
from typedkv.integrations.sglang import FusedKVMaterializeHelper
print(FusedKVMaterializeHelper.__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "FusedKVMaterializeHelper"


# --------------------------------------------------------------------------- the docs page


def test_the_swap_in_the_docs_imports_the_helper() -> None:
    (swap,) = [b for b in code_blocks("sglang.md") if b.startswith("from typedkv")]
    namespace: dict[str, Any] = {}
    exec(compile(swap, str(ROOT / "docs" / "sglang.md"), "exec"), namespace)
    assert namespace["FusedKVMaterializeHelper"] is FusedKVMaterializeHelper


def test_the_fast_path_in_the_docs() -> None:
    """docs/sglang.md's worker method: the plain append goes straight into the pool, writing what
    materialize() + set_kv_buffer write; the prefix-valid append hands each layer to set_kv_buffer_prefix_valid."""
    block = titled_blocks("sglang.md")["dflash_worker_v2.py: _append_target_hidden_fused"]
    namespace: dict[str, Any] = {}
    exec(compile(block, str(ROOT / "docs" / "sglang.md"), "exec"), namespace)
    append = namespace["_append_target_hidden_fused"]
    dtype = torch.float16
    rotary = Rotary(64, 256)
    layers = make_layers(SMALL_SHAPE, dtype=dtype, rotary=rotary)
    helper = FusedKVMaterializeHelper(layers, rotary, NUM_KV_HEADS, HEAD_DIM, DEVICE, max_position_hint=256)
    ctx_hidden, positions = _inputs(5, SMALL_SHAPE.hidden, dtype)
    positions %= 256
    cache_loc = torch.tensor([7, 2, 9, 0, 4], device=DEVICE)
    pool, want = make_pool(12, dtype), make_pool(12, dtype)
    prefix_calls: list[tuple[int, tuple[int, ...]]] = []
    pool.set_kv_buffer_prefix_valid = lambda attn, loc_2d, lens, k, v, ks, vs: prefix_calls.append(
        (attn.layer_id, tuple(k.shape))
    )
    worker = SimpleNamespace(
        draft_model_runner=SimpleNamespace(token_to_kv_pool=pool),
        draft_model=SimpleNamespace(layers=layers),
        _fused_kv_helper=helper,
    )
    append(worker, ctx_hidden, positions, cache_loc)
    helper.materialize(ctx_hidden, positions, lambda i, k, v: set_kv_buffer(want, layers[i], cache_loc, k, v))
    for got_buffer, want_buffer in zip((*pool.k_buffer, *pool.v_buffer), (*want.k_buffer, *want.v_buffer), strict=True):
        assert torch.equal(got_buffer, want_buffer)
    append(worker, ctx_hidden, positions, cache_loc, cache_loc.reshape(1, 5), torch.tensor([5], device=DEVICE))
    assert prefix_calls == [(i, (5, NUM_KV_HEADS, HEAD_DIM)) for i in range(NUM_LAYERS)]


def test_the_helper_has_numpy_docstrings() -> None:
    cls = FusedKVMaterializeHelper
    problems = check_docstring(f"{cls.__name__}.__init__", inspect.getdoc(cls) or "", inspect.signature(cls.__init__))
    for method in ("materialize", "materialize_into_pool"):
        problems += check_callable(f"{cls.__name__}.{method}", getattr(cls, method))
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the bench's end-to-end section


def _once_us(
    calls: Mapping[str, Sequence[Callable[[], None]]],
    rounds: int = 3,
    *,
    sampling: AbstractContextManager[object] | None = None,
) -> dict[str, list[float]]:
    """A stand-in for the bench's paired CUDA-graph timer on CPU: each implementation's calls once a round, wall clock."""
    times: dict[str, list[float]] = {impl: [] for impl in calls}
    with sampling if sampling is not None else nullcontext():
        for _ in range(rounds):
            for impl, fns in calls.items():
                start = time.perf_counter()
                for call in fns:
                    call()
                times[impl].append((time.perf_counter() - start) * 1e6 / len(fns))
    return times


TINY = Draft(num_layers=2, num_kv_heads=2, head_dim=64, hidden=64, num_heads=4, dtype=torch.float32, max_position=64)


def test_e2e_bench_without_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TYPEDKV_SGLANG_WHEEL", raising=False)
    module, reason = load_sglang((tmp_path,))
    assert module is None and reason.startswith("no sglang 0.5.23 wheel")
    result = run_e2e(_once_us, DEVICE, (1, 5), TINY)
    assert [row["tokens"] for row in result["rows"]] == [1, 5]
    ours = {f"typedkv{pool}{path}" for pool in ("", "_pool") for path in ("", "_gemm", "_fused")}
    assert all(set(row["us"]) == {"mm", *ours} for row in result["rows"])
    for row in result["rows"]:
        assert set(row["ratio_range"]) == set(row["ratio"])
        assert all(low <= row["ratio"][name] <= high for name, (low, high) in row["ratio_range"].items())
    assert "typedkv_pool / mm" in e2e_table(result)
    assert "typedkv_fused / typedkv_gemm" in e2e_table(result)


def test_e2e_bench_with_sglang(sglang: ModuleType) -> None:
    result = run_e2e(_once_us, DEVICE, (3,), TINY, sglang=sglang)
    (row,) = result["rows"]
    ours = {f"typedkv{pool}{path}" for pool in ("", "_pool") for path in ("", "_gemm", "_fused")}
    assert set(row["us"]) == {"mm", *ours, "sglang", "sglang_pool"}
    assert set(row["ratio"]) == {
        "typedkv / mm", "typedkv_gemm / mm", "typedkv_fused / mm",
        "typedkv_pool / mm", "typedkv_pool_gemm / mm", "typedkv_pool_fused / mm", "typedkv_fused / typedkv_gemm",
        "sglang / mm", "sglang_pool / mm", "sglang / typedkv", "sglang_pool / typedkv_pool",
    }  # fmt: skip
    assert all(us > 0 for us in row["us"].values())
