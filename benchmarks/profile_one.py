"""Run one benchmark case a few times (for ncu) and print the compiled kernel's resources.

Usage: python benchmarks/profile_one.py CASE_INDEX TOKENS
"""

from __future__ import annotations

import sys

import torch

from typedkv import _bench


def main() -> None:
    case = _bench.GPU_CASES[int(sys.argv[1])]
    tokens = int(sys.argv[2])
    x = _bench.make_inputs(case, tokens, torch.device("cuda"))
    call = _bench.typedkv_call(case, x)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    from typedkv import _impl

    for plan in [p for impl in (_impl.DENSE, _impl.POOL) for p in impl.signature._plans.values()]:
        compiled = plan.launch.compiled if plan.launch is not None else None
        if compiled is not None:
            md = compiled.metadata
            print(
                case.name,
                "regs",
                getattr(compiled, "n_regs", None),
                "spills",
                getattr(compiled, "n_spills", None),
                "shared",
                getattr(md, "shared", None),
                "warps",
                getattr(md, "num_warps", None),
                flush=True,
            )


if __name__ == "__main__":
    main()
