"""Developer script for a CUDA machine: the fused projection kernel's launch configuration against ``torch.mm``.

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/fused_sweep.py [--pools [--sorted | --contiguous]]
[--defaults [--pointer] | --v-stages | --early | --before-wait] [T ...]`` (``--defaults``: the default
configuration alone, for an A/B of two checkouts, with ``--pointer`` the default of weight tiles loaded by
pointer; ``--v-stages``: the default with V's pipeline 2, 3 or 4 stages deep;
``--early``: the default with the epilogue's loads before the loop or after it; ``--before-wait``: the
default, and the next kernel let launch after the weight loop and weight columns asked of L2 before the
wait, on and off; with ``--pools``, ``--sorted`` sends the tokens to their random slots in increasing order, ``--contiguous`` to
consecutive slots).
For the end-to-end bench's draft (5 layers, 8 KV heads, head dim 128, hidden 4096, bf16), at each
T every `typedkv.projection.tuning.ProjectionConfig` of a grid is timed as `typedkv bench` times its end-to-end
section (CUDA-graph replays over rotating inputs, every variant of one T interleaved in rounds
ordered by a balanced Latin square: `typedkv.tools.bench.paired_gpu_time_us`), dense outputs, beside
``torch.mm`` alone into a reused buffer and the GEMM + K/V kernel path. Each line: T, the
configuration, microseconds (the rounds' median), and the median of its per-round ratios to
``torch.mm`` (their range). The best
configuration per T range is what ``ProjectionConfig``'s defaults should be; where the fused
kernel beats GEMM + kernel is what ``typedkv.projection.tuning.TUNING`` records (``Tuning.fused_faster``).
The tables' figures and the alternatives measured against them: docs/decisions/004-projection-path-by-token-count.md
and 005-fused-kernel-launch-tables.md.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence

import torch

from typedkv import KVMaterializer
from typedkv.kv.launch import KVGeometry
from typedkv.projection import fused as fused_impl
from typedkv.projection import launch as fused_launch
from typedkv.projection import tuning
from typedkv.tools import timing
from typedkv.tools.bench_e2e import Draft, paired_ratio

TOKENS = (16, 32, 48, 64, 1, 256, 2048, 16384)


def configs(num_tokens: int) -> list[tuple[tuning.ProjectionConfig, int | None]]:
    """The grid swept at ``num_tokens``: around the defaults (docs/decisions/005-fused-kernel-launch-tables.md).

    With ``--defaults`` on the command line: the default configuration alone.

    Each with the registers a thread may take (Triton's ``maxnreg``; None: the compiler's choice).
    """
    if "--defaults" in sys.argv:
        # With --pointer: the default configuration of weight tiles loaded by pointer (a weight off 16 bytes).
        return [(tuning.ProjectionConfig(tma=False if "--pointer" in sys.argv else None), None)]
    if "--early" in sys.argv:
        # The default with K's RoPE rows, and the epilogue's other loads, before the loop or after it.
        return [
            (tuning.ProjectionConfig(early_rope=rope, early_loads=loads), None)
            for rope in (False, True)
            for loads in (False, True)
        ]
    if "--before-wait" in sys.argv:
        # The default, then neither, the next kernel let launch after the weight loop, and that with
        # the first 128 or 256 columns of each head's weight rows asked of L2 before the wait for the
        # prior kernel (docs/decisions/003-programmatic-dependent-launch.md).
        return [(tuning.ProjectionConfig(), None)] + [
            (tuning.ProjectionConfig(l2_before_wait=columns, signal_next=signal), None)
            for columns, signal in [(0, False), (0, True), (128, True), (256, True)]
        ]
    if "--v-stages" in sys.argv:
        # The default, and the same with V's programs on a shallower pipeline than K's.
        return [(tuning.ProjectionConfig(v_stages=v_stages), None) for v_stages in (None, 2, 3, 4)]
    if num_tokens <= 64:
        # The default, and K's pipeline deeper than V's (weights by TMA): a program's loads are
        # bound by their latency, so the deeper pipeline's K heads end their loop first and their
        # epilogue overlaps V's last loads (docs/decisions/005-fused-kernel-launch-tables.md).
        block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
        grid = {
            16: [(128, 6, None), (128, 6, 5), (128, 6, 4), (64, 12, 9), (64, 12, 8)],
            32: [(128, 5, None), (128, 5, 4), (128, 5, 3), (64, 11, 8), (64, 11, 7), (64, 9, 6)],
            64: [(64, 9, 7), (64, 9, 6), (64, 9, 5), (64, 9, 8), (64, 8, 6), (64, 8, 7)],
        }[block_m]
        return [(tuning.ProjectionConfig(), None)] + [
            (tuning.ProjectionConfig(block_m, block_k, 4, stages, None, None, True, v_stages=v_stages), None)
            for block_k, stages, v_stages in grid
        ]
    elif num_tokens <= 128:
        # The default (one program of 128 tokens a head, all in one wave, K 7 stages, V 6) and
        # around it, with the shallower pipelines (K 6-5 stages, V 4) that suit the H100 at T <= 64.
        return [(tuning.ProjectionConfig(), None)] + [
            (tuning.ProjectionConfig(128, 64, 8, stages, None, None, True, 1, v_stages), None)
            for stages, v_stages in [(7, 5), (7, 6), (7, 7), (6, 5), (6, 4), (5, 4)]
        ]
    else:
        # The defaults by pointer and by TMA (above T = 256: 128 tokens, 8 warps, 4 stages, bands
        # of 8; one program per SM, 131 KB of shared memory, so its epilogue overlaps no loads), and
        # configurations that let two programs share an SM: 8 warps held to 128 registers with
        # <= 98 KB of shared memory (without the cap 149 registers allow one), and 4 warps (255
        # registers, spilling).
        return [
            (tuning.ProjectionConfig(block_m, block_k, warps, stages, early_rope, early_loads, tma, group_m), maxnreg)
            for block_m, block_k, warps, stages, early_rope, early_loads, tma, group_m, maxnreg in [
                (128, 64, 8, 4, False, False, False, 8, None),
                (128, 64, 8, 4, False, False, True, 8, None),
                (128, 64, 8, 4, True, True, True, 8, None),
                (128, 64, 8, 3, False, False, True, 8, 128),
                (128, 32, 8, 6, False, False, True, 8, 128),
                (128, 64, 4, 3, False, False, True, 8, None),
                (64, 64, 4, 3, False, False, True, 8, None),
            ]
        ]
    return [
        (tuning.ProjectionConfig(block_m, block_k, 4, stages, early_rope, early_loads), None)
        for block_m, block_k, stages in grid
        for early_rope in (False, True)
        for early_loads in (False, True)
    ]


def draft_tensors(draft: Draft, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bench draft's weight ``[L, 2*H*D, hidden]``, K norm weights ``[L, D]`` and NeoX cos/sin cache, seeded."""
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    torch.manual_seed(0)
    weight = torch.randn(L, 2 * H * D, draft.hidden, device=device, dtype=draft.dtype) / draft.hidden**0.5
    norm = torch.rand(L, D, device=device, dtype=draft.dtype) + 0.5
    half = D // 2
    inv = 1.0 / 1e6 ** (torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(draft.max_position, dtype=torch.float32, device=device), inv)
    return weight, norm, torch.cat((angles.cos(), angles.sin()), dim=-1)


def main() -> None:
    device = torch.device("cuda")
    draft = Draft()
    H = draft.num_kv_heads
    weight, norm, cos_sin = draft_tensors(draft, device)
    gemm = KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=H)
    gemm.projection_path = "gemm"
    pools = "--pools" in sys.argv
    for num_tokens in [int(t) for t in sys.argv[1:] if not t.startswith("--")] or TOKENS:
        if pools:
            _sweep_pools(num_tokens, draft, weight, norm, cos_sin)
        else:
            _sweep(num_tokens, draft, weight, norm, cos_sin, gemm)
        torch.cuda.empty_cache()


def _sweep_pools(
    num_tokens: int, draft: Draft, weight: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """``--pools``: each configuration through `KVMaterializer.into_pool` into per-layer pools, as sglang keeps them.

    The op builds its own launches: each configuration gets a fresh materializer, with
    the launcher's default replaced and the fused launches it kept dropped. GEMM + kernel
    (the same pools) and torch.mm alone are timed beside each.
    """
    device = weight.device
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    flat = weight.reshape(L * 2 * H * D, draft.hidden)
    slots = 4 * max(num_tokens, 1024)
    k_layers = [torch.empty(slots, H, D, device=device, dtype=draft.dtype) for _ in range(L)]
    v_layers = [torch.empty(slots, H, D, device=device, dtype=draft.dtype) for _ in range(L)]
    hidden = [torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype) for _ in range(4)]
    positions = [torch.randint(0, draft.max_position, (num_tokens,), device=device) for _ in range(4)]
    cache_loc = [torch.randperm(slots, device=device)[:num_tokens] for _ in range(4)]
    if "--sorted" in sys.argv:
        # The same slots in increasing order: what the random order costs the pool rows' stores.
        cache_loc = [c.sort().values for c in cache_loc]
    if "--contiguous" in sys.argv:
        # Each set's tokens to consecutive slots (set i from slot i * T): the pool rows as dense rows.
        cache_loc = [torch.arange(i * num_tokens, (i + 1) * num_tokens, device=device) for i in range(4)]
    gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
    mm = [lambda h=h: _discard(torch.mm(h, flat.t(), out=gemm_out)) for h in hidden]
    gemm = KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=H)
    gemm.projection_path = "gemm"
    two = [
        lambda h=h, p=p, c=c: gemm.into_pool(h, p, c, k_layers, v_layers)
        for h, p, c in zip(hidden, positions, cache_loc, strict=True)
    ]
    defaults = fused_launch.projection_launch.__kwdefaults__
    assert defaults is not None
    default = defaults["config"]
    fused: dict[str, Sequence[Callable[[], None]]] = {}
    for config, maxnreg in configs(num_tokens):
        if maxnreg is not None:
            continue  # the op builds its own launches: no register cap there
        defaults["config"] = config
        fused_impl._LAUNCHES.clear()
        m = KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=H)
        m.projection_path = "fused"
        calls = [
            lambda h=h, p=p, c=c, m=m: m.into_pool(h, p, c, k_layers, v_layers)
            for h, p, c in zip(hidden, positions, cache_loc, strict=True)
        ]
        calls[0]()  # the materializer keeps the launch built now, with this configuration
        fused[f"pools T={num_tokens:<6} {_config_text(config)}"] = calls
    defaults["config"] = default
    fused_impl._LAUNCHES.clear()
    torch.cuda.synchronize()
    _timed(mm, fused, two)


def _sweep(
    num_tokens: int,
    draft: Draft,
    weight: torch.Tensor,
    norm: torch.Tensor,
    cos_sin: torch.Tensor,
    gemm: KVMaterializer,
) -> None:
    """Every configuration of the grid at ``num_tokens``, one line each."""
    device = weight.device
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    flat = weight.reshape(L * 2 * H * D, draft.hidden)
    sets = 4 if num_tokens <= 256 else 1
    hidden = [torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype) for _ in range(sets)]
    positions = [torch.randint(0, draft.max_position, (num_tokens,), device=device) for _ in range(sets)]
    k_out, v_out = torch.empty(2, L, num_tokens, H, D, device=device, dtype=draft.dtype)
    gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
    mm = [lambda h=h: _discard(torch.mm(h, flat.t(), out=gemm_out)) for h in hidden]
    two = [
        lambda h=h, p=p: _discard(gemm(h, p, k_out=k_out, v_out=v_out)) for h, p in zip(hidden, positions, strict=True)
    ]
    # The fused result of each configuration against the GEMM path's (the tests hold them to one ulp).
    ref_k, ref_v = (t.clone() for t in gemm(hidden[0], positions[0]))
    fused: dict[str, Sequence[Callable[[], None]]] = {}
    for config, maxnreg in configs(num_tokens):
        calls = [
            _fused(h, p, weight, norm, cos_sin, k_out, v_out, config, maxnreg)
            for h, p in zip(hidden, positions, strict=True)
        ]
        calls[0]()
        torch.cuda.synchronize()
        compiled = calls[0].launch.compiled  # type: ignore[attr-defined]
        regs = f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared}" if compiled else ""
        err_k = (k_out.float() - ref_k.float()).abs().max().item()
        err_v = (v_out.float() - ref_v.float()).abs().max().item()
        label = f"T={num_tokens:<6} {_config_text(config)} maxnreg={maxnreg}"
        print(f"{label}  max|dk| {err_k:.3g} max|dv| {err_v:.3g} {regs}", flush=True)
        fused[label] = calls
    _timed(mm, fused, two)


def _config_text(config: tuning.ProjectionConfig) -> str:
    return (
        f"m={config.block_m} k={config.block_k} w={config.num_warps} s={config.num_stages} "
        f"early_rope={config.early_rope} early_loads={config.early_loads} tma={config.tma} group_m={config.group_m} v_stages={config.v_stages}"
        + (
            f" l2_before_wait={config.l2_before_wait} signal_next={config.signal_next}"
            if "--before-wait" in sys.argv
            else ""
        )
    )


def _timed(
    mm: Sequence[Callable[[], None]],
    fused: dict[str, Sequence[Callable[[], None]]],
    two: Sequence[Callable[[], None]],
) -> None:
    """torch.mm alone, each configuration's fused calls and GEMM + kernel timed interleaved in rounds
    (`typedkv.tools.bench.paired_gpu_time_us`); one line a configuration: its µs, torch.mm's and GEMM +
    kernel's (medians of the rounds), and the medians of the per-round ratios to torch.mm (their range)."""
    rounds = timing.paired_gpu_time_us({"mm": mm, "two": two, **fused})
    us_mm, us_two = statistics.median(rounds["mm"]), statistics.median(rounds["two"])
    two_ratio = _paired_ratio(rounds["two"], rounds["mm"])
    for label in fused:
        print(
            f"{label}  fused {statistics.median(rounds[label]):9.2f} us  mm {us_mm:9.2f}  gemm+kernel {us_two:9.2f}  "
            f"fused/mm {_paired_ratio(rounds[label], rounds['mm'])}  gemm+kernel/mm {two_ratio}",
            flush=True,
        )


def _paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> str:
    ratio = paired_ratio(numerator, denominator)
    return f"{ratio.median:5.3f} ({ratio.low:.3f}-{ratio.high:.3f})"


def _discard(_: object) -> None:
    return None


def _fused(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    norm: torch.Tensor,
    cos_sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    config: tuning.ProjectionConfig,
    maxnreg: int | None = None,
) -> Callable[[], None]:
    """One fused launch with ``config`` into dense ``[L, T, H, D]`` outputs (built here, as the ops cache theirs).

    ``maxnreg``: compiled with at most that many registers a thread (Triton's option; the
    launch then runs that compiled kernel).
    """
    L, T, H, D = k_out.shape
    flat = weight.reshape(-1, weight.shape[-1])
    strides = (k_out.stride(0), k_out.stride(1), 0, k_out.stride(2))
    values = fused_launch.call_values(hidden, flat, None, (norm, 1e-6, cos_sin, positions), None, (k_out, v_out, None))
    geometry = KVGeometry(H, D, True, strides, strides, T)
    launch = fused_launch.projection_launch(values, geometry, num_layers=L, config=config)

    if maxnreg is not None:
        # The first launch compiles; later calls run what it compiled (`KernelLaunch._cuda`).
        options = {"launch_pdl": True} if launch.programmatic else {}
        kernel = launch.kernel[launch.grid]
        launch._compiled[launch.programmatic] = kernel(
            *launch.arguments(values), num_warps=launch.num_warps, maxnreg=maxnreg, **options
        )

    def call() -> None:
        launch(values)

    call.launch = launch  # type: ignore[attr-defined]
    return call


if __name__ == "__main__":
    main()
