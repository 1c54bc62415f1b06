"""Print an Nsight Compute details page (``ncu -i REP --page details --csv``) one metric a line.

Not part of the package. Usage: ``python benchmarks/ncu_details.py DETAILS.csv``: section, metric,
value and unit, for reading two profiles side by side (``STEPS=ncu_pools``).
"""

from __future__ import annotations

import csv
import sys


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        for row in csv.DictReader(f):
            section, name = row.get("Section Name", ""), row.get("Metric Name", "")
            print(f"{section[:24]:<24} {name:<44} {row.get('Metric Value', ''):>14} {row.get('Metric Unit', '')}")


if __name__ == "__main__":
    main()
