"""``typedkv bench``: typedkv against the copy roofline, PyTorch eager and torch.compile.

Device time is measured by replaying a CUDA graph of many calls (launch gaps
vanish, as in a captured decode step) over enough rotating input sets that the
working set exceeds the L2 cache, so every call streams from HBM. Host time per
call is measured separately at T = 16 with a wall clock over thousands of calls.
Bytes counted: kv read once, K and V written once (MLA: ckv read once, its rows written once).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _launch, _reference
from ._api import materialize_kv, materialize_kv_into_pool
from ._config import set_debug
from ._materializer import KVMaterializer
from ._mla import materialize_mla_kv, materialize_mla_kv_into_pool
from ._mla_materializer import MLAKVMaterializer

_L2_SPAN = 256 << 20  # bytes the rotating input sets must span, several times the H200's 60 MB L2


def rotating_sets(nbytes: int) -> int:
    """How many input sets of ``nbytes`` a timing rotates through so that L2 holds none of them (1 to 64)."""
    return max(1, min(64, math.ceil(_L2_SPAN / nbytes)))


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype = torch.bfloat16
    rope_style: str = "neox"
    pool: str = ""  # "", "bf16" (pool of kv's dtype) or "fp8"
    norm: bool = True  # False: a RoPE-only draft (k_norm_weight=None)
    # Paged pools (page_size > 0): the K and V halves of one combined cache
    # [L, N, 2, B, H, D] (NHD) or [L, N, 2, H, B, D] (HND), passed as views.
    page_size: int = 0
    kv_layout: str = "NHD"
    # MLA (kv_lora_rank > 0): rows of C + R per token and layer (heads and head_dim unused);
    # a paged MLA pool is [L, N, B, C+R].
    kv_lora_rank: int = 0


MAIN = Case("L5 H8 D128", 5, 8, 128, 128)
POOL = Case("L5 H8 D128 pool", 5, 8, 128, 128, pool="bf16")
# DeepSeek-V3's MLA geometry (kv_lora_rank 512, qk_rope_head_dim 64), GPT-J RoPE as vLLM and sglang run it.
MLA_MAIN = Case("MLA L5 C512 R64", 5, 1, 0, 64, rope_style="gptj", kv_lora_rank=512)
MLA_POOL = Case("MLA L5 C512 R64 B64", 5, 1, 0, 64, rope_style="gptj", pool="bf16", page_size=64, kv_lora_rank=512)
GPU_CASES = (
    MAIN,
    Case("L1 H8 D128", 1, 8, 128, 128),
    Case("L3 H4 D128", 3, 4, 128, 128),
    Case("L2 H8 D256 R64", 2, 8, 256, 64),
    Case("L5 H8 D128 fp16", 5, 8, 128, 128, torch.float16),
    Case("L5 H8 D128 gptj", 5, 8, 128, 128, rope_style="gptj"),
    POOL,
    Case("L5 H8 D128 pool fp8", 5, 8, 128, 128, pool="fp8"),
    Case("L5 H8 D128 rope-only", 5, 8, 128, 128, norm=False),
    Case("L5 H8 D128 NHD B16", 5, 8, 128, 128, pool="bf16", page_size=16),
    Case("L5 H8 D128 NHD B64", 5, 8, 128, 128, pool="bf16", page_size=64),
    Case("L5 H8 D128 HND B16", 5, 8, 128, 128, pool="bf16", page_size=16, kv_layout="HND"),
    Case("L5 H8 D128 HND B64", 5, 8, 128, 128, pool="bf16", page_size=64, kv_layout="HND"),
    Case("L5 H8 D128 NHD B16 fp8", 5, 8, 128, 128, pool="fp8", page_size=16),
    MLA_MAIN,
    Case("MLA L5 C512 R64 no-norm", 5, 1, 0, 64, rope_style="gptj", norm=False, kv_lora_rank=512),
    Case("MLA L5 C512 R64 pool", 5, 1, 0, 64, rope_style="gptj", pool="bf16", kv_lora_rank=512),
    MLA_POOL,
    Case("MLA L5 C512 R64 B64 fp8", 5, 1, 0, 64, rope_style="gptj", pool="fp8", page_size=64, kv_lora_rank=512),
)
GPU_TOKENS = (16, 256, 2048, 16384, 65536)
CPU_CASES = (
    Case("L2 H2 D64", 2, 2, 64, 64, torch.float32),
    Case("L2 H2 D64 pool", 2, 2, 64, 64, torch.float32, pool="bf16"),
)
CPU_TOKENS = (16, 256, 1024)


@dataclass
class Row:
    """One measured (case, T): microseconds and GB/s per implementation."""

    case: str
    tokens: int
    megabytes: float
    us: dict[str, float] = field(default_factory=dict)
    gbps: dict[str, float] = field(default_factory=dict)
    pct_of_copy: dict[str, float] = field(default_factory=dict)


@dataclass
class Inputs:
    kv: torch.Tensor
    weight: torch.Tensor
    eps: torch.Tensor
    cos_sin: torch.Tensor
    positions: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor
    slots: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor

    @property
    def norm_weight(self) -> torch.Tensor | None:
        return self.weight if self.weight.numel() else None


def make_inputs(case: Case, num_tokens: int, device: torch.device, num_slots: int = 0) -> Inputs:
    """Fresh random inputs for one call (never zeros: they hide unwritten outputs)."""
    if case.kv_lora_rank:
        return _mla_inputs(case, num_tokens, device, num_slots)
    L, H, D, R = case.num_layers, case.num_kv_heads, case.head_dim, case.rotary_dim
    positions_max = 131072
    kv = torch.randn(num_tokens, L, 2 * H * D, device=device, dtype=case.dtype)
    weight = torch.rand(L, D, device=device) + 0.5 if case.norm else torch.empty(0, device=device)
    eps = torch.full((L,), 1e-6, device=device)
    angles = torch.rand(positions_max, R // 2, device=device) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(0, positions_max, (num_tokens,), device=device)
    k_out = torch.empty(L, num_tokens, H, D, device=device, dtype=case.dtype)
    v_out = torch.empty_like(k_out)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    k_pool = v_pool = torch.empty(0, device=device)
    if case.pool:
        num_slots = num_slots or 2 * num_tokens
        pool_dtype = torch.float8_e4m3fn if case.pool == "fp8" else case.dtype
        if case.page_size:
            pages = -(-num_slots // case.page_size)
            num_slots = pages * case.page_size
            page = (case.page_size, H) if case.kv_layout == "NHD" else (H, case.page_size)
            cache = torch.empty(L, pages, 2, *page, D, device=device, dtype=pool_dtype)
            k_pool, v_pool = cache[:, :, 0], cache[:, :, 1]
        else:
            k_pool = torch.empty(L, num_slots, H, D, device=device, dtype=pool_dtype)
            v_pool = torch.empty_like(k_pool)
        slots = torch.randperm(num_slots, device=device)[:num_tokens]
    return Inputs(kv, weight, eps, cos_sin, positions, k_out, v_out, slots, k_pool, v_pool)


def _mla_inputs(case: Case, num_tokens: int, device: torch.device, num_slots: int) -> Inputs:
    """An MLA case's inputs: ``kv`` is ckv ``[T, L, C+R]``, ``k_out`` the output, ``k_pool`` the MLA pool."""
    L, C, R = case.num_layers, case.kv_lora_rank, case.rotary_dim
    positions_max = 131072
    ckv = torch.randn(num_tokens, L, C + R, device=device, dtype=case.dtype)
    weight = torch.rand(L, C, device=device) + 0.5 if case.norm else torch.empty(0, device=device)
    angles = torch.rand(positions_max, R // 2, device=device) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(0, positions_max, (num_tokens,), device=device)
    out = torch.empty(L, num_tokens, C + R, device=device, dtype=case.dtype)
    unused = torch.empty(0, device=device)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    pool = unused
    if case.pool:
        num_slots = num_slots or 2 * num_tokens
        pool_dtype = torch.float8_e4m3fn if case.pool == "fp8" else case.dtype
        if case.page_size:
            pages = -(-num_slots // case.page_size)
            num_slots = pages * case.page_size
            pool = torch.empty(L, pages, case.page_size, C + R, device=device, dtype=pool_dtype)
        else:
            pool = torch.empty(L, num_slots, C + R, device=device, dtype=pool_dtype)
        slots = torch.randperm(num_slots, device=device)[:num_tokens]
    eps = torch.full((L,), 1e-6, device=device)
    return Inputs(ckv, weight, eps, cos_sin, positions, out, unused, slots, pool, unused)


def bytes_moved(case: Case, num_tokens: int) -> int:
    """kv read once plus K and V (or the pool rows) written once."""
    written = 1 if case.pool == "fp8" else case.dtype.itemsize
    if case.kv_lora_rank:
        elems = num_tokens * case.num_layers * (case.kv_lora_rank + case.rotary_dim)
        return elems * case.dtype.itemsize + elems * written
    elems = num_tokens * case.num_layers * 2 * case.num_kv_heads * case.head_dim
    return elems * case.dtype.itemsize + elems * written


def typedkv_call(case: Case, x: Inputs) -> Callable[[], None]:
    style: Any = case.rope_style
    if case.kv_lora_rank:
        return _mla_call(case, x)
    H = case.num_kv_heads
    if case.pool:
        scale = 0.5 if case.pool == "fp8" else None
        layout: Any = case.kv_layout
        return lambda: materialize_kv_into_pool(
            x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, x.v_pool,
            num_kv_heads=H, rope_style=style, k_scale=scale, v_scale=scale, kv_layout=layout,
        )  # fmt: skip
    return lambda: _discard(
        materialize_kv(
            x.kv,
            x.norm_weight,
            x.eps,
            x.cos_sin,
            x.positions,
            num_kv_heads=H,
            rope_style=style,
            k_out=x.k_out,
            v_out=x.v_out,
        )
    )


def _mla_call(case: Case, x: Inputs) -> Callable[[], None]:
    style: Any = case.rope_style
    if case.pool:
        scale = 0.5 if case.pool == "fp8" else None
        return lambda: materialize_mla_kv_into_pool(
            x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, rope_style=style, kv_scale=scale
        )
    return lambda: _discard(
        materialize_mla_kv(x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, rope_style=style, out=x.k_out)
    )


def eager_call(case: Case, x: Inputs, compiled: bool = False) -> Callable[[], None]:
    """The plain PyTorch path a model would run (the reference), optionally compiled."""
    neox = case.rope_style == "neox"
    if case.kv_lora_rank:
        return _mla_eager_call(case, x, compiled)

    def run(
        kv: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = _reference.rmsnorm_rope(kv, w, eps, cs, pos, case.num_kv_heads, neox)
        return k.to(kv.dtype), v

    fn = torch.compile(run, fullgraph=True) if compiled else run
    if case.pool:

        def pool_path() -> None:
            k, v = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
            for layer in range(case.num_layers):
                x.k_pool[layer].index_copy_(0, x.slots, k[layer].to(x.k_pool.dtype))
                x.v_pool[layer].index_copy_(0, x.slots, v[layer].to(x.v_pool.dtype))

        return pool_path

    def dense() -> None:
        k, v = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
        x.k_out.copy_(k)
        x.v_out.copy_(v)

    return dense


def _mla_eager_call(case: Case, x: Inputs, compiled: bool) -> Callable[[], None]:
    """MLA's plain PyTorch path: the reference rows in ckv's dtype, then a copy or one indexed copy per layer."""
    neox = case.rope_style == "neox"

    def run(ckv: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return _reference.mla_rows(ckv, w if w.numel() else None, eps, cs, pos, neox).to(ckv.dtype)

    fn = torch.compile(run, fullgraph=True) if compiled else run
    if case.pool:
        rows = x.k_pool.view(case.num_layers, -1, x.k_pool.shape[-1])  # pages flattened: slot s is row s

        def pool_path() -> None:
            out = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
            for layer in range(case.num_layers):
                rows[layer].index_copy_(0, x.slots, out[layer].to(rows.dtype))

        return pool_path
    return lambda: _discard(x.k_out.copy_(fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)))


def staging_call(case: Case, x: Inputs) -> Callable[[], None]:
    """materialize_kv into a staging buffer, then one indexed copy per layer (the path of sglang's fused_kv_materialize helper)."""

    def run() -> None:
        k, v = materialize_kv(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=case.num_kv_heads, k_out=x.k_out, v_out=x.v_out
        )
        for layer in range(case.num_layers):
            x.k_pool[layer].index_copy_(0, x.slots, k[layer])
            x.v_pool[layer].index_copy_(0, x.slots, v[layer])

    return run


def _discard(_: object) -> None:
    return None


def gpu_time_us(calls: Sequence[Callable[[], None]], replays: int = 25, min_calls: int = 20) -> float:
    """Median device time of one call, from CUDA-graph replays over rotating inputs.

    One replay holds at least ``min_calls`` calls: a graph of one large call
    would add the replay's own start-up (a few microseconds) to every call.
    """
    graph, num_calls = _captured(calls, min_calls)
    return _replay_us(graph, num_calls, replays)


def paired_gpu_time_us(
    calls: Mapping[str, Sequence[Callable[[], None]]],
    rounds: int = 7,
    replays: int = 5,
    min_calls: int = 20,
    *,
    sampling: AbstractContextManager[object] | None = None,
) -> dict[str, list[float]]:
    """Each implementation's device time of one call, round by round, the implementations interleaved.

    The host drifts (clocks, temperature) over the minutes a section takes, so a
    ratio of two implementations timed one after the other compares two states
    of the host, and the one always timed first is always timed in the earlier
    state. Here every implementation's graph is captured first, as `gpu_time_us`
    captures it, and all are kept; then each round times every graph, in the
    order `round_order` gives (a balanced Latin square's rows, so none always
    runs first or always after the same one). Two times of one round were
    taken moments apart: their ratio compares one state, and a ratio's median
    over the rounds is that of ``rounds`` such comparisons.

    Parameters
    ----------
    calls : Mapping[str, Sequence[Callable[[], None]]]
        Each implementation's calls by its name, one call per rotating input
        set (what `gpu_time_us` takes).
    rounds : int
        Rounds; each times every implementation once.
    replays : int
        Timed replays of an implementation's graph in a round; the round's time
        is their median.
    min_calls : int
        Calls per graph at least (the rotation repeated), as `gpu_time_us`.
    sampling : AbstractContextManager, optional
        Entered while the rounds run, after every graph is captured (a
        `typedkv._gpu_state.Window`: the GPU's clock and power while timed).

    Returns
    -------
    dict[str, list[float]]
        Each implementation's microseconds per call in each round, round 0 first.

    Notes
    -----
    Every implementation's graph, with what its calls allocate, is alive until
    this returns; its memory then stays with torch's caching allocator, for the
    caller to hand back (``torch.cuda.empty_cache()``) before larger calls.
    """
    graphs = {impl: _captured(fns, min_calls) for impl, fns in calls.items()}
    times: dict[str, list[float]] = {impl: [] for impl in graphs}
    with sampling if sampling is not None else nullcontext():
        for round_index in range(rounds):
            for impl in round_order(list(graphs), round_index):
                graph, num_calls = graphs[impl]
                times[impl].append(_replay_us(graph, num_calls, replays))
    return times


def round_order(impls: Sequence[str], round_index: int) -> list[str]:
    """The order round ``round_index`` of `paired_gpu_time_us` times ``impls`` in: a balanced Latin square's row.

    What ran just before an implementation sets the clock it starts at where
    the GPU is held at its power limit, so every implementation must follow
    each other one as often. A plain rotation does not: there ``impls[i]``
    always follows ``impls[i - 1]`` unless it runs first. With ``torch.mm``
    and "auto" each timed twice, a copy read 1.05-1.15x its original at T =
    1024-2048 under a rotation, 0.98-1.02x in these rows (an H200 and an H100;
    benchmarks/order_probe.py). The rows are Williams's design: the first is
    ``0, 1, n-1, 2, n-2, ...``, round ``r`` adds ``r`` to each index (mod
    ``n``), and where ``n`` is odd the second ``n`` rounds run those rows
    backwards. Over ``n`` rounds (``2n`` where ``n`` is odd) each
    implementation runs first equally often and follows each other one
    equally often within a round.
    """
    n = len(impls)
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [impls[(i + round_index) % n] for i in first]
    return row[::-1] if n % 2 and (round_index // n) % 2 else row


def _captured(calls: Sequence[Callable[[], None]], min_calls: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """``calls`` captured in one CUDA graph, replayed once: the graph and the number of calls it holds."""
    sequence = list(calls) * max(1, math.ceil(min_calls / len(calls)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # Repeat the rotation so one replay lasts long enough to time well.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in sequence:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, len(sequence)


def _replay_us(graph: torch.cuda.CUDAGraph, num_calls: int, replays: int) -> float:
    """Median over ``replays`` timed replays of ``graph`` of its time per call (it holds ``num_calls``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    return statistics.median(times)


def copy_roofline_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written) over a 1 GiB buffer.

    The faster of ``copy_`` (cudaMemcpy) and an elementwise kernel, timed with
    events outside any graph: in a graph a copy becomes a memcpy node, which can
    run on the slower copy engines.
    """
    import triton.testing

    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    best = 0.0
    for fn in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst)):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        best = max(best, 2 * src.numel() * src.element_size() / (ms * 1e3) / 1e3)
    return best


def host_time_us(fn: Callable[[], None], calls: int = 3000) -> float:
    """Wall-clock host time per call, the device kept busy asynchronously."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def paired_host_time_us(
    fn: Callable[[], None], bare: Callable[[], None], rounds: int = 7, calls: int = 500
) -> tuple[float, float, float]:
    """``fn``'s and ``bare``'s host time per call, alternated in ``rounds`` of ``calls`` each.

    This host's call times are bimodal, and a mode outlasts a round: a ratio of two
    measurements taken apart can compare two modes. Returns the median of each one's
    rounds and the median of the per-round ratios (``fn`` over ``bare``).
    """
    pairs = [(host_time_us(fn, calls), host_time_us(bare, calls)) for _ in range(rounds)]
    return (
        statistics.median(us for us, _ in pairs),
        statistics.median(us for _, us in pairs),
        statistics.median(us / bare_us for us, bare_us in pairs),
    )


def sglang_style_wrapper(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
) -> None:
    """A wrapper written like sglang's fused_kv_materialize one: hand-written if-checks, then ``kernel[grid](...)``."""
    if kv.dim() != 3:
        raise ValueError(f"kv must be 3-D, got {tuple(kv.shape)}")
    total_ctx, n_layers, width = kv.shape
    head_dim = k_norm_weight.shape[-1]
    if width != 2 * num_kv_heads * head_dim:
        raise ValueError(f"kv last dim {width} != 2*{num_kv_heads}*{head_dim}")
    if k_norm_weight.shape != (n_layers, head_dim):
        raise ValueError(f"bad k_norm_weight shape {tuple(k_norm_weight.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"bad rotary dim {rotary_dim}")
    if eps.shape != (n_layers,):
        raise ValueError(f"bad eps shape {tuple(eps.shape)}")
    if positions.shape != (total_ctx,):
        raise ValueError(f"bad positions shape {tuple(positions.shape)}")
    if positions.device != kv.device:
        positions = positions.to(device=kv.device, dtype=torch.int64)
    elif positions.dtype != torch.int64:
        positions = positions.to(torch.int64)
    expected = (n_layers, total_ctx, num_kv_heads, head_dim)
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        if out.shape != expected:
            raise ValueError(f"Invalid {name} shape: got {tuple(out.shape)}, expected {expected}")
        if out.device != kv.device or out.dtype != kv.dtype:
            raise ValueError(f"Invalid {name} device/dtype")
    grid, params, num_warps = _launch.launch_params(
        kv, k_norm_weight, eps, cos_sin_cache, positions, None,
        k_out, (k_out.stride(0), k_out.stride(1), 0, k_out.stride(2)),
        v_out, (v_out.stride(0), v_out.stride(1), 0, v_out.stride(2)),
        None, num_kv_heads=num_kv_heads, head_dim=k_norm_weight.shape[1], page_size=1, num_rows=total_ctx, neox=True,
    )  # fmt: skip
    kernel: Any = _launch.materialize_kv_kernel
    kernel[grid](*params, num_warps=num_warps)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_gpu(tokens: Sequence[int], cases: Sequence[Case], compare: bool) -> dict[str, Any]:
    """Measure every case on the current CUDA device."""
    device = torch.device("cuda")
    _log("measuring the copy roofline ...")
    roof = copy_roofline_gbps(device)
    _log(f"  copy: {roof:.0f} GB/s")
    rows: list[Row] = []
    for case in cases:
        for num_tokens in tokens:
            nbytes = bytes_moved(case, num_tokens)
            sets = rotating_sets(nbytes)
            inputs = [make_inputs(case, num_tokens, device) for _ in range(sets)]
            row = Row(case.name, num_tokens, nbytes / 1e6)
            impls: dict[str, Callable[[Case, Inputs], Callable[[], None]]] = {"typedkv": typedkv_call}
            if compare and case in (MAIN, POOL, MLA_MAIN, MLA_POOL):  # the baselines on a dense and a pool case
                impls["eager"] = eager_call
                impls["compile"] = lambda c, x: eager_call(c, x, compiled=True)
                if case.pool and not case.kv_lora_rank:
                    impls["staging"] = staging_call
            for impl, make in impls.items():
                _log(f"{case.name:>22}  T={num_tokens:<6} {impl} ...")
                try:
                    us = gpu_time_us([make(case, x) for x in inputs])
                except Exception as err:  # a baseline that cannot be captured is reported, not fatal
                    _log(f"    {impl} failed: {type(err).__name__}: {err}")
                    continue
                row.us[impl] = round(us, 2)
                row.gbps[impl] = round(nbytes / us / 1e3, 1)
                row.pct_of_copy[impl] = round(100 * nbytes / us / 1e3 / roof, 1)
            rows.append(row)
            del inputs
            torch.cuda.empty_cache()
    return {"copy_GBps": round(roof, 1), "rows": [asdict(r) for r in rows], "host": host_overhead(device)}


def host_overhead(device: torch.device) -> dict[str, float]:
    """Host microseconds per call at T = 16 (decode; the materializer's at 64 too): typedkv vs an sglang-style
    wrapper and a bare launch."""
    x = make_inputs(MAIN, 16, device)
    H = MAIN.num_kv_heads

    def production() -> None:
        materialize_kv(x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out)

    def sglang_style() -> None:
        sglang_style_wrapper(x.kv, x.weight, x.eps, x.cos_sin, x.positions, H, x.k_out, x.v_out)

    grid, params, num_warps = _launch.launch_params(
        x.kv, x.weight, x.eps, x.cos_sin, x.positions, None,
        x.k_out, (x.k_out.stride(0), x.k_out.stride(1), 0, x.k_out.stride(2)),
        x.v_out, (x.v_out.stride(0), x.v_out.stride(1), 0, x.v_out.stride(2)),
        None, num_kv_heads=H, head_dim=x.weight.shape[1], page_size=1, num_rows=16, neox=True,
    )  # fmt: skip
    kernel: Any = _launch.materialize_kv_kernel

    def bare() -> None:
        kernel[grid](*params, num_warps=num_warps)

    out = {"bare_launch_us": host_time_us(bare), "sglang_style_wrapper_us": host_time_us(sglang_style)}
    out["typedkv_production_us"] = host_time_us(production)
    set_debug(True)
    try:
        out["typedkv_debug_us"] = host_time_us(production, calls=1000)
    finally:
        set_debug(False)
    # Every public call in production mode, alternated with the bare launch in rounds (the host is
    # bimodal: `paired_host_time_us`); the materializer's calls at T = 64 too, where its fused
    # kernel loads the weight by TMA (on Hopper and later).
    calls = public_calls(device)
    wider = public_calls(device, 64)
    calls |= {f"{name}_t64": wider[name] for name in MATERIALIZER_CALLS}
    ratios = {}
    for name, fn in calls.items():
        out[f"{name}_us"], out[f"{name}_bare_launch_us"], ratios[name] = paired_host_time_us(fn, bare)
    out = {k: round(v, 2) for k, v in out.items()}
    out["production_vs_sglang_style"] = round(out["typedkv_production_us"] / out["sglang_style_wrapper_us"], 3)
    out["debug_vs_bare"] = round(out["typedkv_debug_us"] / out["bare_launch_us"], 3)
    for name, ratio in ratios.items():
        out[f"{name}_vs_bare"] = round(ratio, 3)
    return out


MATERIALIZER_CALLS = ("materializer_call", "materializer_into_pool_per_layer")
"""`public_calls`' names of `KVMaterializer`'s calls (dense outputs; per-layer pools)."""


def public_calls(device: torch.device, num_tokens: int = 16) -> dict[str, Callable[[], None]]:
    """Every public call at decode size (the main K/V and MLA shapes), inputs made once."""
    x = make_inputs(POOL, num_tokens, device, num_slots=4096)
    H, L, D = POOL.num_kv_heads, POOL.num_layers, POOL.head_dim
    k_layers, v_layers = list(x.k_pool.unbind(0)), list(x.v_pool.unbind(0))
    hidden_size = 1024
    weights = torch.randn(L, 2 * H * D, hidden_size, device=device, dtype=POOL.dtype) / 32
    m = KVMaterializer(weights, x.weight, 1e-6, x.cos_sin, num_kv_heads=H)
    hidden = torch.randn(num_tokens, hidden_size, device=device, dtype=POOL.dtype)
    y = make_inputs(MLA_POOL, num_tokens, device, num_slots=4096)
    C, R = MLA_POOL.kv_lora_rank, MLA_POOL.rotary_dim
    mla = MLAKVMaterializer(
        torch.randn(L, C + R, hidden_size, device=device, dtype=MLA_POOL.dtype) / 32, y.weight, 1e-6, y.cos_sin,
        rope_style="gptj",
    )  # fmt: skip
    mla_layers = list(y.k_pool.unbind(0))
    return {
        "materialize_kv": lambda: _discard(
            materialize_kv(x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out)
        ),
        "into_pool_stacked": lambda: materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, x.v_pool, num_kv_heads=H
        ),
        "into_pool_per_layer": lambda: materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, x.slots, k_layers, v_layers, num_kv_heads=H
        ),
        "materializer_call": lambda: _discard(m(hidden, x.positions)),
        "materializer_into_pool_per_layer": lambda: m.into_pool(hidden, x.positions, x.slots, k_layers, v_layers),
        "materialize_mla_kv": lambda: _discard(
            materialize_mla_kv(y.kv, y.weight, y.eps, y.cos_sin, y.positions, rope_style="gptj", out=y.k_out)
        ),
        "mla_into_pool_paged": lambda: materialize_mla_kv_into_pool(
            y.kv, y.weight, y.eps, y.cos_sin, y.positions, y.slots, y.k_pool, rope_style="gptj"
        ),
        "mla_into_pool_per_layer": lambda: materialize_mla_kv_into_pool(
            y.kv, y.weight, y.eps, y.cos_sin, y.positions, y.slots, mla_layers, rope_style="gptj"
        ),
        "mla_materializer_call": lambda: _discard(mla(hidden, y.positions)),
        "mla_materializer_into_pool_paged": lambda: mla.into_pool(hidden, y.positions, y.slots, y.k_pool),
    }


def run_cpu(tokens: Sequence[int], cases: Sequence[Case]) -> dict[str, Any]:
    """Small CPU sizes: typedkv's CPU path against a plain copy of the same bytes."""
    device = torch.device("cpu")
    rows: list[Row] = []
    src = torch.randn(1 << 24)
    dst = torch.empty_like(src)
    roof = 2 * src.numel() * 4 / _cpu_time_us(lambda: _discard(dst.copy_(src))) / 1e3
    for case in cases:
        for num_tokens in tokens:
            _log(f"{case.name:>22}  T={num_tokens:<6} typedkv (cpu) ...")
            nbytes = bytes_moved(case, num_tokens)
            x = make_inputs(case, num_tokens, device, num_slots=4 * num_tokens)
            us = _cpu_time_us(typedkv_call(case, x))
            row = Row(case.name, num_tokens, nbytes / 1e6)
            row.us["typedkv"] = round(us, 2)
            row.gbps["typedkv"] = round(nbytes / us / 1e3, 2)
            row.pct_of_copy["typedkv"] = round(100 * nbytes / us / 1e3 / roof, 1)
            rows.append(row)
    return {"copy_GBps": round(roof, 1), "rows": [asdict(r) for r in rows]}


def _cpu_time_us(fn: Callable[[], None], repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def table(result: dict[str, Any]) -> str:
    """The result as a fixed-width text table."""
    lines = [f"copy roofline: {result['copy_GBps']} GB/s (read + write)", ""]
    lines.append(f"{'case':>22} {'T':>6} {'MB':>8} {'impl':>8} {'us':>10} {'GB/s':>8} {'% copy':>7} {'speedup':>8}")
    for row in result["rows"]:
        base = row["us"].get("typedkv")
        for impl, us in row["us"].items():
            speedup = f"{us / base:.2f}x" if base and impl != "typedkv" else ""
            lines.append(
                f"{row['case']:>22} {row['tokens']:>6} {row['megabytes']:>8.1f} {impl:>8} {us:>10.2f} "
                f"{row['gbps'][impl]:>8.1f} {row['pct_of_copy'][impl]:>6.1f}% {speedup:>8}"
            )
    host = result.get("host")
    if host:
        lines += ["", "host time per call at T=16, *_t64 at T=64 (us):"]
        lines += [f"  {k:>48}: {v}" for k, v in host.items()]
    return "\n".join(lines)


# The plot's panels: which rows each draws, and what it plots of them.
_PANELS = ("K/V shapes", "K/V pool layouts", "MLA", "typedkv's speedup over the baselines", "end to end")


def _panel_of(case_name: str) -> int:
    """The panel of a case's typedkv line: by the case's kind (unknown names by their words)."""
    case = next((c for c in (*GPU_CASES, *CPU_CASES) if c.name == case_name), None)
    mla = case.kv_lora_rank > 0 if case else case_name.startswith("MLA")
    pool = bool(case.pool) if case else any(w in case_name.split() for w in ("pool", "NHD", "HND"))
    return 2 if mla else 1 if pool else 0


def plot_series(result: dict[str, Any]) -> list[list[tuple[str, list[tuple[int, float]]]]]:
    """The plot's data: per panel (`_PANELS`), its series as ``(label, [(T, y), ...])``.

    Panels 0-2: typedkv's % of the copy roofline; 3: a baseline's time over
    typedkv's (x times faster); 4: each end-to-end implementation's time over
    ``torch.mm`` alone (``result["e2e"]``, when measured): the row's recorded
    ratio (the median of the per-round ratios, `typedkv._bench_e2e.run_e2e`),
    or in results recorded before it had one, the row's ``us`` over ``mm``'s.
    """
    panels: list[dict[str, list[tuple[int, float]]]] = [{} for _ in _PANELS]
    for row in result["rows"]:
        tokens = row["tokens"]
        if "typedkv" in row["pct_of_copy"]:
            panels[_panel_of(row["case"])].setdefault(row["case"], []).append((tokens, row["pct_of_copy"]["typedkv"]))
        base = row["us"].get("typedkv")
        for impl, us in row["us"].items():
            if impl != "typedkv" and base:
                panels[3].setdefault(f"{row['case']}: {impl}", []).append((tokens, us / base))
    for row in result.get("e2e", {}).get("rows", []):
        mm = row["us"].get("mm")
        recorded = row.get("ratio", {})
        for impl, us in row["us"].items():
            name = f"{impl} / mm"
            if name in recorded:
                panels[4].setdefault(name, []).append((row["tokens"], recorded[name]))
            elif impl != "mm" and mm:
                panels[4].setdefault(name, []).append((row["tokens"], us / mm))
    return [list(panel.items()) for panel in panels]


def plot(result: dict[str, Any], path: Path) -> bool:
    """The result as panels against T (see `plot_series`), every series its own colour. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = plot_series(result)
    shown = [i for i, series in enumerate(data) if series]
    cols = 2 if len(shown) > 1 else 1
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.6 * rows), squeeze=False)
    # tab10 gives ten colours that all differ; markers tell apart what a longer panel adds.
    colours, markers = plt.get_cmap("tab10"), "osD^v<>ph*"
    for ax, i in zip(axes.flat, shown, strict=False):
        for n, (label, points) in enumerate(data[i]):
            xs, ys = zip(*sorted(points), strict=True)
            # Colour and line style together unique up to 20 series (panels hold at most 10).
            ax.plot(
                xs, ys, marker=markers[n % len(markers)], color=colours(n % 10), linestyle="-" if n < 10 else "--",
                linewidth=1.6, markersize=4, label=label,
            )  # fmt: skip
        if i <= 2:
            ax.axhline(100, color="black", linestyle="--", linewidth=1, label="copy roofline")
            ax.set_ylabel("% of copy roofline")
        else:
            ax.axhline(1, color="black", linestyle="--", linewidth=1)
            ax.set_ylabel("baseline time / typedkv time" if i == 3 else "time / torch.mm alone")
            if i == 3:
                ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_title(_PANELS[i])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.suptitle(result.get("title", "typedkv bench"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(out_dir: Path, quick: bool, compare: bool, only: str = "") -> int:
    """Run the benchmark for the best available device; print the table, write JSON and PNG.

    ``only``: run the cases whose name contains this text (all when empty); on a GPU, the
    end-to-end section (`typedkv._bench_e2e`) runs when it is empty or ``"e2e"``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": _triton_version()}
    gpu = torch.cuda.is_available()
    cases = [c for c in (GPU_CASES if gpu else CPU_CASES) if only in c.name]
    if not cases and not (gpu and only == "e2e"):
        names = ", ".join(c.name for c in (GPU_CASES if gpu else CPU_CASES))
        print(f"--only {only!r} names no case on this machine; its cases: {names}", file=sys.stderr)
        return 2
    if gpu:
        meta["device"] = torch.cuda.get_device_name()
        tokens = GPU_TOKENS[:3] if quick else GPU_TOKENS
        result = run_gpu(tokens, cases, compare)
    else:
        meta["device"] = "cpu (no CUDA device: small sizes, PyTorch reference path)"
        result = run_cpu(CPU_TOKENS, cases)
    if torch.cuda.is_available() and only in ("", "e2e"):
        from ._bench_e2e import e2e_table, section

        _log("end to end: hidden states to K/V ...")
        result["e2e"] = section(paired_gpu_time_us, torch.device("cuda"), quick)
    result = {**meta, "title": f"typedkv on {meta['device']}, {meta['date']}", **result}
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    if "e2e" in result:
        print("\n" + e2e_table(result["e2e"]))
    if plot(result, out_dir / "bench.png"):
        print(f"\nwrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    else:
        print(f"\nwrote {out_dir / 'bench.json'} (install matplotlib for the plot)")
    return 0


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return "not installed"
