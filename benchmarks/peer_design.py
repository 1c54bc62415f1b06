"""The standalone kernel against a kernel of the peer's design, timed side by side (a developer script).

Not part of the package. Usage: ``python benchmarks/peer_design.py [--fixed] [--check] [--configs]
[--case=NAME] [rounds]``.

The peer figures (`peer_cases.PEER`) were recorded elsewhere, by a timing method not
recorded. This script writes a kernel of that peer's design, our own code, and times it beside
`typedkv.materialize_kv` in one run, the two interleaved round by round
(`typedkv.tools.bench.paired_gpu_time_us`), over the same rotating input sets as ``typedkv bench``
(``--fixed``: one input set, what L2 holds from the call before counts). The design, as
recorded with those figures: a grid of (T, L) programs, each the K and V of all heads of one token of
one layer; K normed per head, then NeoX RoPE with each dimension's partner taken from registers
by ``tl.gather``; T a compile-time constant (one compile per T). Each case runs it at 1, 2, 4
and 8 warps and keeps the fastest, so the design gets its best launch here.

Each line: the case, T, microseconds and GB/s of both, typedkv's over the design's (above 1:
typedkv faster), per round's median, with the peer's recorded figure beside. ``--check``: the
design's K and V against typedkv's on fresh random inputs first (V bit-equal; K within four bf16
ulps of its head's largest element: both round K after the norm, each in its own order), on CUDA
or, under ``TRITON_INTERPRET=1``, on CPU tensors at small T. ``--configs``: typedkv's other launch
configurations (`CONFIGS`: warps, tokens a program, K and V split, K's RoPE partners loaded again)
timed in the same rounds, each against the default. ``--case=NAME``: only the cases whose name holds NAME (``--case=D256``).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

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
    T: tl.constexpr, L: tl.constexpr, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    layer = tl.program_id(1)
    heads = tl.arange(0, H)[:, None]
    dims = tl.arange(0, D)[None, :]
    row = kv + (t * L + layer).to(tl.int64) * (2 * H * D)
    k = tl.load(row + heads * D + dims).to(tl.float32)
    v = tl.load(row + H * D + heads * D + dims)
    if NORM:
        mean_square = tl.sum(k * k, axis=1) / D
        scale = tl.rsqrt(mean_square + tl.load(eps + layer))
        k = k * scale[:, None] * tl.load(norm_weight + layer * D + dims)
        k = k.to(kv.dtype.element_ty).to(tl.float32)
    half: tl.constexpr = R // 2
    first = dims < half
    rotated = dims < R
    partner_dim = tl.where(first, dims + half, tl.where(rotated, dims - half, dims))
    partner = tl.gather(k, tl.broadcast_to(partner_dim, (H, D)), axis=1)
    angle = tl.where(first, dims, dims - half)
    at = cos_sin + tl.load(positions + t).to(tl.int64) * R
    cos = tl.load(at + angle, mask=rotated, other=1.0)
    sin = tl.load(at + half + angle, mask=rotated, other=0.0)
    k = tl.where(first, k * cos - partner * sin, tl.where(rotated, k * cos + partner * sin, k))
    out = (layer * T + t).to(tl.int64) * (H * D) + heads * D + dims
    tl.store(k_out + out, k.to(k_out.dtype.element_ty))
    tl.store(v_out + out, v)


def design_call(case: cases.Case, x: cases.Inputs, num_warps: int) -> Callable[[], None]:
    """One call of the peer's design on ``x`` (dense outputs, ``x.k_out`` and ``x.v_out``)."""
    T = x.kv.shape[0]
    L, H, D, R = case.num_layers, case.num_kv_heads, case.head_dim, case.rotary_dim
    weight = x.weight if case.norm else x.eps  # never read without the norm

    def run() -> None:
        _design_kernel[(T, L)](
            x.kv, weight, x.eps, x.cos_sin, x.positions, x.k_out, x.v_out,
            T=T, L=L, H=H, D=D, R=R, NORM=case.norm, num_warps=num_warps,
        )  # fmt: skip

    return run


def check(device: torch.device) -> None:
    """The design's outputs against typedkv's on fresh random inputs: V bit-equal, K as the module's notes say."""
    cases = {case.name: case for case, _, _ in PEER}.values()
    for case in cases:
        for tokens in (3, 17) if device.type == "cpu" else (1, 16, 300):
            x = cases.make_inputs(case, tokens, device)
            k, v = typedkv.materialize_kv(
                x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, num_kv_heads=case.num_kv_heads,
            )  # fmt: skip
            design_call(case, x, 4)()
            # Four bf16 ulps of the head's largest element (each rounds K after the norm, before RoPE, in
            # its own order; RoPE mixes the pair, so an element's error follows its head's scale). A
            # wrong pair, angle or norm is off by a large part of the head's scale.
            diff = (x.k_out.float() - k.float()).abs()
            worst = (diff / k.float().abs().amax(dim=-1, keepdim=True)).max().item()
            assert torch.equal(x.v_out, v), (case.name, tokens, "V differs")
            assert worst <= 2**-5, (case.name, tokens, worst)
            print(
                f"check {case.name:>16} T={tokens:<4} max|dk| {diff.max().item():.4f} ({worst:.4f} of its head's max), V equal"
            )


# ``--configs``: typedkv's launch configurations timed beside its default (`typedkv.kv.launch.KVConfig`):
# warps per program, two tokens a program, K and V in separate programs, K's RoPE partners loaded again
# (the default gathers them, `KVConfig.partner_gather`).
CONFIGS = {
    "w1": kv_launch.KVConfig(num_warps=1),
    "w2": kv_launch.KVConfig(num_warps=2),
    "w8": kv_launch.KVConfig(num_warps=8),
    "bt2 w4": kv_launch.KVConfig(block_t=2, num_warps=4),
    "bt2 w8": kv_launch.KVConfig(block_t=2, num_warps=8),
    "split w2": kv_launch.KVConfig(split_kv=True, num_warps=2),
    "split w4": kv_launch.KVConfig(split_kv=True, num_warps=4),
    "loaded": kv_launch.KVConfig(partner_gather=False),
    "loaded w2": kv_launch.KVConfig(partner_gather=False, num_warps=2),
}


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


def main() -> None:
    fixed = "--fixed" in sys.argv
    sweep = "--configs" in sys.argv
    # --case=D256: only the cases whose name holds that text.
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--case=")), "")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(args[0]) if args else 5
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--check" in sys.argv:
        check(device)
    if device.type != "cuda":
        return
    for case, tokens, peer in PEER:
        if only not in case.name:
            continue
        nbytes = cases.bytes_moved(case, tokens)
        sets = 1 if fixed else cases.rotating_sets(nbytes)
        inputs = [cases.make_inputs(case, tokens, device) for _ in range(sets)]
        calls = {"typedkv": [cases.typedkv_call(case, x) for x in inputs]}
        for name, config in CONFIGS.items() if sweep else ():
            calls[f"typedkv {name}"] = [configured(cases.typedkv_call(case, x), config) for x in inputs]
        for warps in (1, 2, 4, 8):
            calls[f"design w{warps}"] = [design_call(case, x, warps) for x in inputs]
        times = timing.paired_gpu_time_us(calls, rounds=rounds)
        for name in calls if sweep else ():
            if name.startswith("typedkv "):
                variant = bench_e2e.paired_ratio(times[name], times["typedkv"])
                print(
                    f"config {case.name:>16} T={tokens:<5} {name:<16} {statistics.median(times[name]):8.2f} us, "
                    f"the default faster by {variant.median:5.3f} ({variant.low:.3f}-{variant.high:.3f})"
                )
        best = min((name for name in calls if name.startswith("design")), key=lambda n: statistics.median(times[n]))
        ours, theirs = statistics.median(times["typedkv"]), statistics.median(times[best])
        faster = bench_e2e.paired_ratio(times[best], times["typedkv"])
        print(
            f"design {case.name:>16} T={tokens:<5} typedkv {ours:8.2f} us {nbytes / ours / 1e3:7.1f} GB/s  "
            f"{best} {theirs:8.2f} us {nbytes / theirs / 1e3:7.1f} GB/s  typedkv faster by "
            f"{faster.median:5.3f} ({faster.low:.3f}-{faster.high:.3f})  peer's figure {peer:7.1f} GB/s"
        )
        del calls, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
