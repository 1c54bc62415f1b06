"""The K/V kernel's launch configuration where it follows the materializer's GEMM (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/after_gemm_sweep.py [--check] [--ab] [T ...]``.

`typedkv._launch.KVConfig`'s defaults were measured on the kernel alone with inputs rotated so
that L2 holds none of them (`typedkv bench`, peer_cases.py). After the materializer's GEMM the
kernel reads a ``kv`` the GEMM has just written, much of it still in L2 (50 MB on the H200), a
plain launch (no programmatic dependent launch: `KernelLaunch.__call__`'s ``after_gemm``). This
times the materializer pinned to GEMM + kernel, as the bench's end-to-end section does (same
draft, weights and timer), once per configuration of a small grid (K and V split, warps, two
tokens a program, layer order, V's loads first), all beside ``torch.mm`` alone into a reused
buffer, alternated within each of 3 rounds (each round starting at another configuration);
prints each one's median over ``torch.mm``'s. ``--ab``: 7 rounds of four (`AB`), one of them the
default's configuration spelt out, a control for the noise.

``--check``: no timing; on CPU (the interpreter) unless CUDA is there, a small draft, each
configuration's K and V against the default's (they must be equal: the configuration only says
how the work is cut).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

import typedkv
from typedkv import _launch

SWEEP: list[_launch.KVConfig | None] = (
    [None]
    + [_launch.KVConfig(split_kv=split, num_warps=warps) for split in (False, True) for warps in (2, 4, 8)]
    + [_launch.KVConfig(block_t=2, split_kv=split, num_warps=warps) for split in (False, True) for warps in (4, 8)]
    + [_launch.KVConfig(layer_fast=False), _launch.KVConfig(v_first=False)]
)


_kwdefaults = _launch.launch_params.__kwdefaults__
assert _kwdefaults is not None
_DEFAULT = _kwdefaults["config"]


# ``--ab``: the default, the two that led a sweep on the H200 (T = 2048 and 16384), and the
# default's own configuration spelt out (a control: it differs from "default" by noise alone).
AB: list[_launch.KVConfig | None] = [
    None,
    _launch.KVConfig(block_t=2, split_kv=False, num_warps=4),
    _launch.KVConfig(split_kv=False, num_warps=8),
    _launch.KVConfig(split_kv=False, num_warps=4),
]


def _name(config: _launch.KVConfig | None) -> str:
    if config is None:
        return "default"
    return (
        f"split={config.split_kv} warps={config.num_warps} bt={config.block_t} "
        f"lf={config.layer_fast:d} vf={config.v_first:d}"
    )


def _materializer(
    config: _launch.KVConfig | None, weight: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor, heads: int
) -> typedkv.KVMaterializer:
    """A new materializer (no plans kept) pinned to GEMM + kernel, its kernel launched with ``config``."""
    defaults = _launch.launch_params.__kwdefaults__
    assert defaults is not None
    defaults["config"] = _DEFAULT if config is None else config
    materializer = typedkv.KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=heads)
    materializer.projection_path = "gemm"
    return materializer


def check() -> int:
    """Each configuration's K and V against the default's, on a small draft."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    L, H, D, hidden_size, T = 3, 2, 32, 64, 9
    weight = (torch.randn(L, 2 * H * D, hidden_size, device=device) / 8).to(dtype)
    norm = (torch.rand(L, D, device=device) + 0.5).to(dtype)
    cos_sin = typedkv.cos_sin_cache(64, D, device=device)
    hidden = torch.randn(T, hidden_size, device=device).to(dtype)
    positions = torch.randint(0, 64, (T,), device=device)
    want = _materializer(None, weight, norm, cos_sin, H)(hidden, positions)
    bad = 0
    for config in SWEEP:
        with_config = _materializer(config, weight, norm, cos_sin, H)
        got = with_config(hidden, positions)
        same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        bad += not same
        print(f"check {_name(config):<44} {'equal' if same else 'DIFFERENT'}", flush=True)
    _materializer(None, weight, norm, cos_sin, H)
    return 1 if bad else 0


def main() -> int:
    if "--check" in sys.argv:
        return check()
    from probe_timing import report

    from typedkv import _bench, _bench_e2e

    device = torch.device("cuda")
    draft, _, rotary, weight, norm, flat = _bench_e2e.bench_draft(device)
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    cos_sin = rotary.cos_sin_cache
    configs = AB if "--ab" in sys.argv else SWEEP
    rounds = 7 if "--ab" in sys.argv else 3
    for T in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [256, 2048, 16384]:
        sets = 4 if T <= 256 else 1
        hiddens = [torch.randn(T, draft.hidden, device=device, dtype=draft.dtype) for _ in range(sets)]
        positions = [torch.randint(0, draft.max_position, (T,), device=device) for _ in range(sets)]
        kv = torch.empty(T, L * 2 * H * D, device=device, dtype=draft.dtype)
        mm: list[Callable[[], None]] = [lambda h=h, kv=kv: torch.mm(h, flat.t(), out=kv) for h in hiddens]  # type: ignore[misc]
        times: dict[str, list[float]] = {"mm": [], **{_name(c): [] for c in configs}}
        min_calls = 4 if T >= 16384 else 20
        for r in range(rounds):
            times["mm"].append(_bench.gpu_time_us(mm, replays=15, min_calls=min_calls))
            for config in configs[r % len(configs) :] + configs[: r % len(configs)]:  # each round starts elsewhere
                m = _materializer(config, weight, norm, cos_sin, H)
                calls: list[Callable[[], None]] = [
                    lambda m=m, h=h, p=p: m(h, p)  # type: ignore[misc]
                    for h, p in zip(hiddens, positions, strict=True)
                ]
                times[_name(config)].append(_bench.gpu_time_us(calls, replays=15, min_calls=min_calls))
        _materializer(None, weight, norm, cos_sin, H)
        report(f"T={T}", {k: statistics.median(v) for k, v in times.items()})
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
