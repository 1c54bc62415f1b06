"""The standalone kernel against kernels of the peer's design, timed side by side (a developer script).

Not part of the package. Usage: ``python benchmarks/peer_design.py [--fixed] [--check] [--configs]
[--case=NAME] [--tokens=T,...] [rounds]``.

The fastest peer kernel we know of is FlagGems' Triton kernel for sglang (`fused_norm_rope_stacked`).
This script writes a kernel of its published design, our own code, and times it beside
`typedkv.materialize_kv` in one run, interleaved round by round (`typedkv.tools.timing.paired_gpu_time_us`),
over the same rotating input sets as ``typedkv bench`` (``--fixed``: one input set, what L2 holds from
the call before counts). The design as published: a grid of (T, L) programs, each all heads of one
token of one layer as one ``[1, next_pow2(H), next_pow2(D)]`` tile; K normed per head in float32, NeoX
partners taken with ``tl.gather`` from the normed tile; V loaded after K's math and stored beside it;
8 warps, ``num_stages=2``, ``enable_fp_fusion=False``, the ``.cg`` cache modifier on the K and V loads;
T, L, H, D, R and the cos/sin stride compile-time constants (one compile per T). `DESIGNS` holds that
launch and each of its settings changed alone.

The pool row: five per-layer ``[S, H, D]`` pools, `typedkv.materialize_kv_into_pool` against a kernel
of the design of sglang's DSpark K/V write (a (T, L) grid, each layer's pool found in a table of pool
addresses, one eps, bf16).

Each line: the case, T, microseconds and GB/s of both, and typedkv's speed over the other's (above 1:
typedkv faster), the median of the per-round ratios and their range. ``--check``: the designs' K and
V against typedkv's on fresh random inputs first (V bit-equal; K within four bf16 ulps of its head's
largest element: both round K after the norm, each in its own order), on CUDA or, under
``TRITON_INTERPRET=1``, on CPU tensors at small T (the DSpark design on CUDA only). ``--configs``:
typedkv's other launch configurations (`CONFIGS`) timed in the same rounds. ``--case=NAME``: only the
cases whose name holds NAME; ``--tokens=256,1024``: only those T.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from peer_cases import PEER

import typedkv
from typedkv.kv import impl as kv_impl
from typedkv.kv import launch as kv_launch
from typedkv.tools import bench_e2e, cases, timing


@triton.jit
def _design_kernel(
    kv, norm_weight, eps, cos_sin, positions, k_out, v_out,
    T: tl.constexpr, L: tl.constexpr, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, COS_SIN_STRIDE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr, V_LATE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    layer = tl.program_id(1)
    # One [1, BLOCK_H, BLOCK_D] tile: all heads of one token of one layer.
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]
    ok = (heads < H) & (dims < D)
    row = kv + (t * L + layer).to(tl.int64) * (2 * H * D)
    k = tl.load(row + heads * D + dims, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if not V_LATE:
        v = tl.load(row + H * D + heads * D + dims, mask=ok, other=0.0, cache_modifier=CACHE)
    if NORM:
        mean_square = tl.sum(k * k, axis=2) / D
        scale = tl.rsqrt(mean_square + tl.load(eps + layer))
        k = k * scale[:, :, None] * tl.load(norm_weight + layer * D + dims, mask=dims < D, other=0.0)
        k = k.to(kv.dtype.element_ty).to(tl.float32)
    half: tl.constexpr = R // 2
    first = dims < half
    rotated = dims < R
    partner_dim = tl.where(first, dims + half, tl.where(rotated, dims - half, dims))
    partner = tl.gather(k, tl.broadcast_to(partner_dim, (1, BLOCK_H, BLOCK_D)), axis=2)
    angle = tl.where(first, dims, dims - half)
    at = cos_sin + tl.load(positions + t).to(tl.int64) * COS_SIN_STRIDE
    cos = tl.load(at + angle, mask=rotated, other=1.0)
    sin = tl.load(at + half + angle, mask=rotated, other=0.0)
    k = tl.where(first, k * cos - partner * sin, tl.where(rotated, k * cos + partner * sin, k))
    out = (layer * T + t).to(tl.int64) * (H * D) + heads * D + dims
    tl.store(k_out + out, k.to(k_out.dtype.element_ty), mask=ok)
    if V_LATE:
        v = tl.load(row + H * D + heads * D + dims, mask=ok, other=0.0, cache_modifier=CACHE)
    tl.store(v_out + out, v, mask=ok)


class Design(NamedTuple):
    """One launch of the design: warps, pipeline stages, FMA contraction, kv's load cache modifier, V's load
    after K's math (True) or before it."""

    num_warps: int = 8
    num_stages: int = 2
    fp_fusion: bool = False
    cache: str = ".cg"
    v_late: bool = True


# The peer's published launch ("as published"), then each of its settings changed alone, so that a
# difference between typedkv and the design can be traced to one setting.
DESIGNS = {
    "as published": Design(),
    "4 warps": Design(num_warps=4),
    "2 warps": Design(num_warps=2),
    "no .cg": Design(cache=""),
    "fp fusion": Design(fp_fusion=True),
    "V first": Design(v_late=False),
    "3 stages": Design(num_stages=3),
}


def design_call(case: cases.Case, x: cases.Inputs, design: Design) -> Callable[[], None]:
    """One call of the peer's design on ``x`` (dense outputs, ``x.k_out`` and ``x.v_out``)."""
    T = x.kv.shape[0]
    L, H, D, R = case.num_layers, case.num_kv_heads, case.head_dim, case.rotary_dim
    weight = x.weight if case.norm else x.eps  # never read without the norm

    def run() -> None:
        _design_kernel[(T, L)](
            x.kv, weight, x.eps, x.cos_sin, x.positions, x.k_out, x.v_out,
            T=T, L=L, H=H, D=D, R=R, COS_SIN_STRIDE=x.cos_sin.stride(0),
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D), NORM=case.norm,
            CACHE=design.cache, V_LATE=design.v_late, num_warps=design.num_warps, num_stages=design.num_stages,
            enable_fp_fusion=design.fp_fusion,
        )  # fmt: skip

    return run


@triton.jit
def _dspark_kernel(
    kv, norm_weight, eps, cos_sin, positions, cache_loc, k_pools, v_pools,
    L: tl.constexpr, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, COS_SIN_STRIDE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """DSpark's design: a (T, L) grid, each layer's pool found in a table of pool addresses, one eps, bf16."""
    t = tl.program_id(0)
    layer = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    ok = (heads < H) & (dims < D)
    slot = tl.load(cache_loc + t).to(tl.int64)
    row = kv + (t * L + layer).to(tl.int64) * (2 * H * D)
    k = tl.load(row + heads * D + dims, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(row + H * D + heads * D + dims, mask=ok, other=0.0)
    scale = tl.rsqrt(tl.sum(k * k, axis=1) / D + eps)
    k = k * scale[:, None] * tl.load(norm_weight + layer * D + dims, mask=dims < D, other=0.0)
    k = k.to(tl.bfloat16).to(tl.float32)
    half: tl.constexpr = R // 2
    first = dims < half
    rotated = dims < R
    partner_dim = tl.where(first, dims + half, tl.where(rotated, dims - half, dims))
    partner = tl.gather(k, tl.broadcast_to(partner_dim, (BLOCK_H, BLOCK_D)), axis=1)
    angle = tl.where(first, dims, dims - half)
    at = cos_sin + tl.load(positions + t).to(tl.int64) * COS_SIN_STRIDE
    cos = tl.load(at + angle, mask=rotated, other=1.0)
    sin = tl.load(at + half + angle, mask=rotated, other=0.0)
    k = tl.where(first, k * cos - partner * sin, tl.where(rotated, k * cos + partner * sin, k))
    k_pool = tl.load(k_pools + layer).to(tl.pointer_type(tl.bfloat16))
    v_pool = tl.load(v_pools + layer).to(tl.pointer_type(tl.bfloat16))
    out = slot * (H * D) + heads * D + dims
    tl.store(k_pool + out, k.to(tl.bfloat16), mask=ok & (slot >= 0))
    tl.store(v_pool + out, v, mask=ok & (slot >= 0))


class PoolInputs(NamedTuple):
    """One input set of the pool comparison: per-layer ``[S, H, D]`` pools, listed and as address tables."""

    x: cases.Inputs
    k_pools: list[torch.Tensor]
    v_pools: list[torch.Tensor]
    k_table: torch.Tensor
    v_table: torch.Tensor


def pool_inputs(case: cases.Case, tokens: int, device: torch.device) -> PoolInputs:
    x = cases.make_inputs(case, tokens, device)
    L, H, D = case.num_layers, case.num_kv_heads, case.head_dim
    slots = 2 * tokens
    k_pools = [torch.empty(slots, H, D, device=device, dtype=case.dtype) for _ in range(L)]
    v_pools = [torch.empty(slots, H, D, device=device, dtype=case.dtype) for _ in range(L)]
    x.slots = torch.randperm(slots, device=device)[:tokens]
    table = [
        torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=device) for pools in (k_pools, v_pools)
    ]
    return PoolInputs(x, k_pools, v_pools, *table)


def dspark_call(case: cases.Case, p: PoolInputs) -> Callable[[], None]:
    T = p.x.kv.shape[0]
    L, H, D, R = case.num_layers, case.num_kv_heads, case.head_dim, case.rotary_dim

    def run() -> None:
        _dspark_kernel[(T, L)](
            p.x.kv, p.x.weight, 1e-6, p.x.cos_sin, p.x.positions, p.x.slots, p.k_table, p.v_table,
            L=L, H=H, D=D, R=R, COS_SIN_STRIDE=p.x.cos_sin.stride(0),
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        )  # fmt: skip

    return run


def typedkv_pool_call(case: cases.Case, p: PoolInputs) -> Callable[[], None]:
    x = p.x

    def run() -> None:
        typedkv.materialize_kv_into_pool(
            x.kv, x.weight, 1e-6, x.cos_sin, x.positions, x.slots, p.k_pools, p.v_pools,
            num_kv_heads=case.num_kv_heads,
        )  # fmt: skip

    return run


def check(device: torch.device) -> None:
    """The designs' outputs against typedkv's on fresh random inputs: V bit-equal, K as the module's notes say."""
    for case in {case.name: case for case, _, _ in PEER}.values():
        for tokens in (3, 17) if device.type == "cpu" else (1, 16, 300):
            x = cases.make_inputs(case, tokens, device)
            k, v = typedkv.materialize_kv(
                x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, num_kv_heads=case.num_kv_heads,
            )  # fmt: skip
            for name, design in DESIGNS.items():
                x.k_out.normal_()
                x.v_out.normal_()
                design_call(case, x, design)()
                _compare(case.name, tokens, name, x.k_out, x.v_out, k, v)
    case = DSPARK
    # The DSpark design reads pool addresses from a table, which the CPU interpreter cannot follow.
    for tokens in () if device.type == "cpu" else (1, 16, 300):
        p = pool_inputs(case, tokens, device)
        dspark_call(case, p)()
        got = [torch.stack([pool[p.x.slots] for pool in pools]) for pools in (p.k_pools, p.v_pools)]
        k, v = typedkv.materialize_kv(
            p.x.kv, p.x.weight, 1e-6, p.x.cos_sin, p.x.positions, num_kv_heads=case.num_kv_heads
        )
        _compare(case.name, tokens, "DSpark", *got, k, v)


def _compare(case: str, tokens: int, name: str, k_design: torch.Tensor, v_design: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:  # fmt: skip
    # Four bf16 ulps of the head's largest element (each rounds K after the norm, before RoPE, in
    # its own order; RoPE mixes the pair, so an element's error follows its head's scale). A
    # wrong pair, angle or norm is off by a large part of the head's scale.
    diff = (k_design.float() - k.float()).abs()
    worst = (diff / k.float().abs().amax(dim=-1, keepdim=True)).max().item()
    assert torch.equal(v_design, v), (case, tokens, name, "V differs")
    assert worst <= 2**-5, (case, tokens, name, worst)
    print(
        f"check {case:>16} T={tokens:<4} {name:<13} max|dk| {diff.max().item():.4f} ({worst:.4f} of its head's max), V equal"
    )


# ``--configs``: typedkv's launch configurations timed beside its default (`typedkv.kv.launch.KVConfig`):
# warps per program, two tokens a program, K and V split or not, K as one tile, kv's loads through L2 only.
CONFIGS = {
    "w8": kv_launch.KVConfig(num_warps=8),
    "w2": kv_launch.KVConfig(num_warps=2),
    ".cg": kv_launch.KVConfig(load_cache=".cg"),
    ".cg w8": kv_launch.KVConfig(load_cache=".cg", num_warps=8),
    "one program": kv_launch.KVConfig(split_kv=False),
    "one program w8": kv_launch.KVConfig(split_kv=False, num_warps=8),
    "one program .cg w8": kv_launch.KVConfig(split_kv=False, load_cache=".cg", num_warps=8),
    "split": kv_launch.KVConfig(split_kv=True),
    "one tile": kv_launch.KVConfig(full_row=True),
    "one tile w8": kv_launch.KVConfig(full_row=True, num_warps=8),
    "one tile .cg w8": kv_launch.KVConfig(full_row=True, load_cache=".cg", num_warps=8),
    "V late": kv_launch.KVConfig(v_first=False),
    "bt2 w8": kv_launch.KVConfig(block_t=2, num_warps=8),
}

# The pool comparison: five per-layer [S, H, D] pools, against DSpark's design.
DSPARK = cases.Case("L5 H8 D128 pools", 5, 8, 128, 128)
DSPARK_TOKENS = (16, 256, 2048, 16384)


def configured(call: Callable[[], None], config: kv_launch.KVConfig) -> Callable[[], None]:
    """``call`` launched with ``config`` instead of the default: the configuration is set while the call
    runs (its graph is captured then; replays do not run Python) and the kept launches of both ops
    (dense and into pools) are forgotten before and after, so that the call builds its own and the
    next call the default's."""
    defaults = kv_launch.launch_params.__kwdefaults__
    assert defaults is not None

    def forget() -> None:
        for op in (kv_impl.DENSE, kv_impl.POOL):
            op.signature._plans.clear()

    def run() -> None:
        default = defaults["config"]
        defaults["config"] = config
        forget()
        try:
            call()
        finally:
            defaults["config"] = default
            forget()

    return run


def _report(
    label: str, case: str, tokens: int, nbytes: int, times: dict[str, list[float]], ours: str, theirs: str
) -> None:
    mine, other = statistics.median(times[ours]), statistics.median(times[theirs])
    faster = bench_e2e.paired_ratio(times[theirs], times[ours])
    print(
        f"{label} {case:>16} T={tokens:<5} {ours:<22} {mine:8.2f} us {nbytes / mine / 1e3:7.1f} GB/s  "
        f"{theirs:<20} {other:8.2f} us {nbytes / other / 1e3:7.1f} GB/s  faster by "
        f"{faster.median:5.3f} ({faster.low:.3f}-{faster.high:.3f})"
    )


def main() -> None:
    fixed = "--fixed" in sys.argv
    sweep = "--configs" in sys.argv
    # --case=D256: only the cases whose name holds that text; --tokens=256,1024: only those T.
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--case=")), "")
    chosen = {int(t) for a in sys.argv[1:] if a.startswith("--tokens=") for t in a.split("=", 1)[1].split(",")}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(args[0]) if args else 5
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--check" in sys.argv:
        check(device)
    if device.type != "cuda":
        return
    for case, tokens, _ in PEER:
        if only not in case.name or (chosen and tokens not in chosen):
            continue
        nbytes = cases.bytes_moved(case, tokens)
        sets = 1 if fixed else cases.rotating_sets(nbytes)
        inputs = [cases.make_inputs(case, tokens, device) for _ in range(sets)]
        calls = {"typedkv": [cases.typedkv_call(case, x) for x in inputs]}
        for name, config in CONFIGS.items() if sweep else ():
            calls[f"typedkv {name}"] = [configured(cases.typedkv_call(case, x), config) for x in inputs]
        for name, design in DESIGNS.items():
            calls[f"design {name}"] = [design_call(case, x, design) for x in inputs]
        times = timing.paired_gpu_time_us(calls, rounds=rounds)
        for name in calls:
            if name != "typedkv":
                _report("variant", case.name, tokens, nbytes, times, "typedkv", name)
        best = min((n for n in calls if n.startswith("design")), key=lambda n: statistics.median(times[n]))
        _report("design", case.name, tokens, nbytes, times, "typedkv", "design as published")
        _report("best", case.name, tokens, nbytes, times, "typedkv", best)
        del calls, inputs
        torch.cuda.empty_cache()
    if only and only not in DSPARK.name:
        return
    for tokens in DSPARK_TOKENS:
        if chosen and tokens not in chosen:
            continue
        nbytes = cases.bytes_moved(DSPARK, tokens)
        sets = 1 if fixed else cases.rotating_sets(nbytes)
        pools = [pool_inputs(DSPARK, tokens, device) for _ in range(sets)]
        calls = {
            "typedkv": [typedkv_pool_call(DSPARK, p) for p in pools],
            "DSpark": [dspark_call(DSPARK, p) for p in pools],
        }
        times = timing.paired_gpu_time_us(calls, rounds=rounds)
        _report("dspark", DSPARK.name, tokens, nbytes, times, "typedkv", "DSpark")
        del calls, pools
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
