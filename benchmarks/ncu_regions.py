"""Where a kernel's warp samples fall, from an Nsight Compute source page (a developer script).

Not part of the package. Usage: ``python benchmarks/ncu_regions.py SOURCE.csv``, where the CSV is
``ncu -i REPORT --page source --csv --print-source sass`` of a fused projection launch
(``STEPS=ncu_fused`` in benchmarks/device_run.sh writes both). The fused kernel's SASS holds K's
path, then V's; each ends its loop at a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` and its epilogue at an
``EXIT``. Prints each region's share of all warp samples and its largest stall reasons, then the
instructions with the most samples after each loop.
"""

from __future__ import annotations

import collections
import csv
import sys


def main() -> None:
    rows = list(csv.reader(open(sys.argv[1])))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header, data = rows[start], rows[start + 1 :]
    column = {name: i for i, name in enumerate(header)}
    samples, source = column["Warp Stall Sampling (All Samples)"], column["Source"]
    stalls = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]

    def count(row: list[str], at: int) -> float:
        try:
            return float(row[at] or 0)
        except ValueError:
            return 0.0

    loop_ends = [i for i, row in enumerate(data) if "DEPBAR.LE gsb0, 0x0" in row[source]]
    exits = [i for i, row in enumerate(data) if row[source].strip().endswith("EXIT")]
    total = sum(count(row, samples) for row in data) or 1.0
    if len(loop_ends) < 2 or not exits:
        sys.exit(f"expected two loops and an EXIT in {sys.argv[1]}: found {len(loop_ends)} and {len(exits)}")
    k_exit = next(i for i in exits if i > loop_ends[0])
    regions = {
        "K loop": (0, loop_ends[0]),
        "K epilogue": (loop_ends[0], k_exit + 1),
        "V loop": (k_exit + 1, loop_ends[1]),
        "V epilogue": (loop_ends[1], len(data)),
    }
    for name, (first, last) in regions.items():
        part = sum(count(data[i], samples) for i in range(first, last))
        reasons: collections.Counter[str] = collections.Counter()
        for i in range(first, last):
            for stall in stalls:
                reasons[stall[len("stall_") :]] += count(data[i], column[stall])
        top = ", ".join(f"{reason} {int(n)}" for reason, n in reasons.most_common(4) if n)
        print(f"{name:11} {part:8.0f} samples {part / total:6.1%}   {top}")
    for name in ("K epilogue", "V epilogue"):
        first, last = regions[name]
        busiest = sorted(range(first, last), key=lambda i: -count(data[i], samples))[:8]
        print(f"{name}, busiest instructions:")
        for i in sorted(busiest):
            print(f"  {i:5d} {count(data[i], samples):6.0f}  {data[i][source].strip()[:80]}")


if __name__ == "__main__":
    main()
