"""Print Nsight Compute pages for reading profiles side by side (``STEPS=ncu_pools``).

Not part of the package. Usage:

- ``python benchmarks/ncu_details.py DETAILS.csv``: a details page (``ncu -i REP --page details
  --csv``) one metric a line: section, metric, value and unit.
- ``python benchmarks/ncu_details.py --raw NAME=RAW.csv ...``: raw pages (``ncu -i REP --page raw
  --csv``), one column a profile, the metrics worth comparing between them (time, DRAM and L2
  traffic, instructions by kind, the warps' stall reasons where any profile's is above 0.05).
"""

from __future__ import annotations

import csv
import sys

# Raw metric names containing one of these are printed by --raw.
_RAW_PATTERNS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sectors_op_read.sum",
    "lts__t_sectors_op_write.sum",
    "smsp__inst_executed.sum",
    "smsp__inst_executed_op_",
    "sm__inst_executed_pipe_",
    "launch__grid_size",
    "launch__registers_per_thread",
    "issue_stalled",
)


def details(path: str) -> None:
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            section, name = row.get("Section Name", ""), row.get("Metric Name", "")
            print(f"{section[:24]:<24} {name:<44} {row.get('Metric Value', ''):>14} {row.get('Metric Unit', '')}")


def _raw_page(path: str) -> dict[str, tuple[str, str]]:
    """Metric name -> (value, unit) of the first kernel on a raw page."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row and not row[0].startswith("==")]
    if len(rows) < 3:
        return {}
    header, units, values = rows[0], rows[1], rows[2]
    return {name: (value, unit) for name, unit, value in zip(header, units, values, strict=False)}


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return None


def raw(pairs: list[str]) -> None:
    names = [pair.split("=", 1)[0] for pair in pairs]
    pages = [_raw_page(pair.split("=", 1)[1]) for pair in pairs]
    metrics = sorted({m for page in pages for m in page if any(p in m for p in _RAW_PATTERNS)})
    print(f"{'metric':<72}" + "".join(f"{n:>16}" for n in names))
    for metric in metrics:
        values = [page.get(metric, ("-", ""))[0] for page in pages]
        numbers = [_number(v) for v in values]
        if "stalled" in metric and all(n is None or n < 0.05 for n in numbers):
            continue
        unit = next((page[metric][1] for page in pages if metric in page), "")
        print(f"{metric[:64] + ' ' + unit[:7]:<72}" + "".join(f"{v[:15]:>16}" for v in values))


def main() -> None:
    if sys.argv[1] == "--raw":
        raw(sys.argv[2:])
    else:
        details(sys.argv[1])


if __name__ == "__main__":
    main()
