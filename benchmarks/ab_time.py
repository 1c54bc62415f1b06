"""Device time of a few bench cases with whichever typedkv is first on the path (an A/B helper).

Run it alternately with two packages on PYTHONPATH (benchmarks/device_run.sh, step ``ab``): each
line gives the case, T, microseconds and % of the copy roofline measured in the same process.
``--v-last`` launches the K/V kernel with ``KVConfig(v_first=False)`` (V's loads after K's stores:
docs/decisions/001-kv-kernel-launch-configuration.md) and adds the paged cases; ``--paged`` adds
them alone, ``--mla`` adds the MLA kernel's pages of 64 (bf16 and FP8). ``--features``: the pools whose
scales a call writes (FP8, int8) and MLA's ``fp8_ds_mla`` rows, each beside the same pool with a given
scale, at T = 2048 and 16384 only. Host time is not measured here.
"""

from __future__ import annotations

import sys

import typedkv
from typedkv.kv import launch as kv_launch
from typedkv.tools import bench
from typedkv.tools import cases as bench_cases

NAMES = ("L5 H8 D128", "L5 H8 D128 pool", "L5 H8 D128 pool fp8")


PAGED = ("L5 H8 D128 NHD B64", "L5 H8 D128 HND B16")
MLA = ("MLA L5 C512 R64 B64", "MLA L5 C512 R64 B64 fp8")
FEATURES = (
    "L5 H8 D128 pool fp8",
    "L5 H8 D128 pool fp8 scales-out",
    "L5 H8 D128 pool int8 scales-out",
    "MLA L5 C512 R64 B64 fp8",
    "MLA L5 C512 R64 B64 fp8_ds_mla",
)


def main() -> None:
    v_last = "--v-last" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--v-last"]
    names: tuple[str, ...] = NAMES + PAGED if v_last or "--paged" in args else NAMES
    names += MLA if "--mla" in args else ()
    tokens: tuple[int, ...] = (2048, 16384, 65536)
    if "--features" in args:
        names, tokens = FEATURES, (2048, 16384)
    args = [a for a in args if a not in ("--paged", "--mla", "--features")]
    if v_last:
        # Every launch the ops build from here on takes the option (they cache one per layout).
        defaults = kv_launch.launch_params.__kwdefaults__
        assert defaults is not None
        defaults["config"] = kv_launch.KVConfig(v_first=False)
    cases = [c for c in bench_cases.GPU_CASES if c.name in names]
    result = bench.run_gpu(tokens, cases, compare=False, host=False)
    tag = args[0] if args else typedkv.__file__
    for row in result["rows"]:
        print(
            f"{tag} {row['case']:>20} T={row['tokens']:<6} {row['us']['typedkv']:8.2f} us "
            f"{row['pct_of_copy']['typedkv']:5.1f}% copy={result['copy_GBps']}"
        )


if __name__ == "__main__":
    main()
