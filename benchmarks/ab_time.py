"""Device time of a few bench cases with whichever typedkv is first on the path (an A/B helper).

Run it alternately with two packages on PYTHONPATH (benchmarks/device_run.sh, step ``ab``): each
line gives the case, T, microseconds and % of the copy roofline measured in the same process.
"""

from __future__ import annotations

import sys

import typedkv
from typedkv import _bench

NAMES = ("L5 H8 D128", "L5 H8 D128 pool", "L5 H8 D128 pool fp8")


def main() -> None:
    cases = [c for c in _bench.GPU_CASES if c.name in NAMES]
    result = _bench.run_gpu((2048, 16384, 65536), cases, compare=False)
    tag = sys.argv[1] if len(sys.argv) > 1 else typedkv.__file__
    for row in result["rows"]:
        print(
            f"{tag} {row['case']:>20} T={row['tokens']:<6} {row['us']['typedkv']:8.2f} us "
            f"{row['pct_of_copy']['typedkv']:5.1f}% copy={result['copy_GBps']}"
        )


if __name__ == "__main__":
    main()
