"""The standalone kernel at the cases where a peer kernel was measured (a developer script for a CUDA machine).

Not part of the package. Usage: ``python benchmarks/peer_cases.py [--sweep] [--no-pdl] [--fixed] [--tokens=T,...]
[rounds]``. Each
line: the case, T, microseconds and GB/s of `typedkv.materialize_kv` timed as `typedkv bench`
times it (CUDA-graph replays over rotating inputs), beside the fastest peer kernel's GB/s recorded
below (a FlagGems-sglang Triton kernel, recorded on an H200 by a timing method not recorded) and
the ratio of the two. The peer figures are not measured here (docs/decisions/012-peer-comparison.md).
``--sweep``: each case below T = 2048 once per `typedkv.kv.launch.KVConfig` of a small grid (K and V
split, warps per program, two tokens per program, layer order), the configurations alternated within
each round.
``--tokens=1024,128``: only the cases at those T. ``--no-pdl``: launches without programmatic
dependent launch (`typedkv.core.launcher.PROGRAMMATIC_LAUNCH`), for an A/B in separate processes.
``--fixed``: one input set, every call on the same tensors (what L2 holds from the call before counts,
as in a benchmark that replays one call; `typedkv bench` rotates sets so that L2 holds none).
"""

from __future__ import annotations

import itertools
import sys

import torch

from typedkv.core import launcher
from typedkv.kv import impl as kv_impl
from typedkv.kv import launch as kv_launch
from typedkv.tools import cases, timing

# (case, T, the peer's GB/s), as recorded on an H200.
PEER = (
    (cases.Case("L5 H8 D128", 5, 8, 128, 128), 16, 386.0),
    (cases.Case("L5 H8 D128", 5, 8, 128, 128), 64, 953.0),
    (cases.Case("L5 H8 D128", 5, 8, 128, 128), 256, 2146.0),
    (cases.Case("L5 H8 D128", 5, 8, 128, 128), 1024, 3371.0),
    (cases.Case("L5 H8 D128", 5, 8, 128, 128), 2048, 3499.0),
    (cases.Case("L1 H8 D128", 1, 8, 128, 128), 256, 823.0),
    (cases.Case("L8 H8 D128", 8, 8, 128, 128), 128, 2101.0),
    (cases.Case("L2 H8 D256 R64", 2, 8, 256, 64), 2048, 3180.0),
)


SWEEP = (
    [None]
    + [kv_launch.KVConfig(split_kv=split, num_warps=warps) for split in (False, True) for warps in (2, 4, 8)]
    + [kv_launch.KVConfig(block_t=2, split_kv=split, num_warps=warps) for split in (False, True) for warps in (4, 8)]
    + [kv_launch.KVConfig(layer_fast=False)]
)


def main() -> None:
    sweep = "--sweep" in sys.argv
    if "--no-pdl" in sys.argv:
        launcher.PROGRAMMATIC_LAUNCH = False
    # --tokens=1024,128: only the cases at those T.
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--tokens=")), "")
    chosen = {int(t) for t in only.split(",") if t}
    fixed = "--fixed" in sys.argv
    args = [a for a in sys.argv[1:] if a not in ("--sweep", "--no-pdl", "--fixed") and not a.startswith("--tokens=")]
    rounds = int(args[0]) if args else 2
    device = torch.device("cuda")
    defaults = kv_launch.launch_params.__kwdefaults__
    assert defaults is not None
    default = defaults["config"]
    for _ in range(rounds):
        for (case, tokens, peer), config in itertools.product(PEER, SWEEP if sweep else [None]):
            if (sweep and tokens >= 2048) or (chosen and tokens not in chosen):
                continue
            # A launch is kept with its layout's plan: forget them, so that this configuration is built.
            defaults["config"] = default if config is None else config
            kv_impl.DENSE.signature._plans.clear()
            # As typedkv bench: input sets rotated so that L2 holds none of them.
            nbytes = cases.bytes_moved(case, tokens)
            sets = 1 if fixed else cases.rotating_sets(nbytes)
            calls = [cases.typedkv_call(case, cases.make_inputs(case, tokens, device)) for _ in range(sets)]
            us = timing.gpu_time_us(calls)
            gbps = nbytes / us / 1e3
            shown = (
                ("fixed" if fixed else "default")
                if config is None
                else f"split={config.split_kv} warps={config.num_warps} bt={config.block_t} lf={config.layer_fast:d}"
            )
            print(
                f"peer {case.name:>16} T={tokens:<5} {shown:<28} {us:8.2f} us {gbps:7.1f} GB/s peer {peer:7.1f}  "
                f"ratio {gbps / peer:5.3f}"
            )


if __name__ == "__main__":
    main()
