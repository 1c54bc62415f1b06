"""The bench's text table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typedkv.tools.cases import CPU_CASES, GPU_CASES


def table(result: dict[str, Any]) -> str:
    """The result as a fixed-width text table."""
    lines = [f"copy roofline: {result['copy_GBps']} GB/s (read + write)", ""]
    lines.append(f"{'case':>22} {'T':>6} {'MB':>8} {'impl':>8} {'us':>10} {'GB/s':>8} {'% copy':>7} {'speedup':>8}")
    for row in result["rows"]:
        base = row["us"].get("typedkv")
        for impl, us in row["us"].items():
            speedup = f"{us / base:.2f}x" if base and impl != "typedkv" else ""
            lines.append(
                f"{row['case']:>22} {row['tokens']:>6} {row['megabytes']:>8.1f} {impl:>8} {us:>10.2f} "
                f"{row['gbps'][impl]:>8.1f} {row['pct_of_copy'][impl]:>6.1f}% {speedup:>8}"
            )
    host = result.get("host")
    if host:
        lines += ["", "host time per call at T=16, *_t64 at T=64 (us):"]
        lines += [f"  {k:>48}: {v}" for k, v in host.items()]
    return "\n".join(lines)


# The plot's panels: which rows each draws, and what it plots of them.
_PANELS = ("K/V shapes", "K/V pool layouts", "MLA", "typedkv's speedup over the baselines", "end to end")


def _panel_of(case_name: str) -> int:
    """The panel of a case's typedkv line: by the case's kind (unknown names by their words)."""
    case = next((c for c in (*GPU_CASES, *CPU_CASES) if c.name == case_name), None)
    mla = case.kv_lora_rank > 0 if case else case_name.startswith("MLA")
    pool = bool(case.pool) if case else any(w in case_name.split() for w in ("pool", "NHD", "HND"))
    return 2 if mla else 1 if pool else 0


def plot_series(result: dict[str, Any]) -> list[list[tuple[str, list[tuple[int, float]]]]]:
    """The plot's data: per panel (`_PANELS`), its series as ``(label, [(T, y), ...])``.

    Panels 0-2: typedkv's % of the copy roofline; 3: a baseline's time over
    typedkv's (x times faster); 4: each end-to-end implementation's time over
    ``torch.mm`` alone (``result["e2e"]``, when measured): the row's recorded
    ratio (the median of the per-round ratios, `typedkv.tools.bench_e2e.run_e2e`),
    or in results recorded before it had one, the row's ``us`` over ``mm``'s.
    """
    panels: list[dict[str, list[tuple[int, float]]]] = [{} for _ in _PANELS]
    for row in result["rows"]:
        tokens = row["tokens"]
        if "typedkv" in row["pct_of_copy"]:
            panels[_panel_of(row["case"])].setdefault(row["case"], []).append((tokens, row["pct_of_copy"]["typedkv"]))
        base = row["us"].get("typedkv")
        for impl, us in row["us"].items():
            if impl != "typedkv" and base:
                panels[3].setdefault(f"{row['case']}: {impl}", []).append((tokens, us / base))
    for row in result.get("e2e", {}).get("rows", []):
        mm = row["us"].get("mm")
        recorded = row.get("ratio", {})
        for impl, us in row["us"].items():
            name = f"{impl} / mm"
            if name in recorded:
                panels[4].setdefault(name, []).append((row["tokens"], recorded[name]))
            elif impl != "mm" and mm:
                panels[4].setdefault(name, []).append((row["tokens"], us / mm))
    return [list(panel.items()) for panel in panels]


def plot(result: dict[str, Any], path: Path) -> bool:
    """The result as panels against T (see `plot_series`), every series its own colour.

    False, writing nothing, without matplotlib or where no panel has a series (a run of the real-drafts
    section alone: its results are its table).
    """
    data = plot_series(result)
    shown = [i for i, series in enumerate(data) if series]
    if not shown:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = 2 if len(shown) > 1 else 1
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.6 * rows), squeeze=False)
    # tab10 gives ten colours that all differ; markers tell apart what a longer panel adds.
    colours, markers = plt.get_cmap("tab10"), "osD^v<>ph*"
    for ax, i in zip(axes.flat, shown, strict=False):
        for n, (label, points) in enumerate(data[i]):
            xs, ys = zip(*sorted(points), strict=True)
            # Colour and line style together unique up to 20 series (panels hold at most 10).
            ax.plot(
                xs, ys, marker=markers[n % len(markers)], color=colours(n % 10), linestyle="-" if n < 10 else "--",
                linewidth=1.6, markersize=4, label=label,
            )  # fmt: skip
        if i <= 2:
            ax.axhline(100, color="black", linestyle="--", linewidth=1, label="copy roofline")
            ax.set_ylabel("% of copy roofline")
        else:
            ax.axhline(1, color="black", linestyle="--", linewidth=1)
            ax.set_ylabel("baseline time / typedkv time" if i == 3 else "time / torch.mm alone")
            if i == 3:
                ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_title(_PANELS[i])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    fig.suptitle(result.get("title", "typedkv bench"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
