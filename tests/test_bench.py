"""The bench's plot: which panel each case lands in, what each panel shows, every series told apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from typedkv import _bench


def _result(cases: list[str], impls: tuple[str, ...] = ("typedkv",)) -> dict[str, Any]:
    rows = []
    for case in cases:
        for tokens in (16, 256):
            us = {impl: float(tokens * (i + 1)) for i, impl in enumerate(impls)}
            rows.append({"case": case, "tokens": tokens, "us": us, "pct_of_copy": {impl: 50.0 for impl in impls}})
    return {"copy_GBps": 4000.0, "rows": rows, "title": "test"}


def test_cases_land_in_their_panels() -> None:
    names = [c.name for c in _bench.GPU_CASES]
    panels = _bench.plot_series(_result(names))
    labels = [[label for label, _ in panel] for panel in panels]
    assert labels[0] == [c.name for c in _bench.GPU_CASES if not c.pool and not c.kv_lora_rank]
    assert labels[1] == [c.name for c in _bench.GPU_CASES if c.pool and not c.kv_lora_rank]
    assert labels[2] == [c.name for c in _bench.GPU_CASES if c.kv_lora_rank]
    assert labels[3] == labels[4] == []


def test_speedups_and_end_to_end_ratios() -> None:
    result = _result(["L5 H8 D128"], ("typedkv", "eager", "compile"))
    result["e2e"] = {"rows": [{"tokens": 16, "us": {"mm": 20.0, "typedkv": 22.0, "typedkv_pool": 25.0}}]}
    panels = _bench.plot_series(result)
    assert panels[3] == [
        ("L5 H8 D128: eager", [(16, 2.0), (256, 2.0)]),
        ("L5 H8 D128: compile", [(16, 3.0), (256, 3.0)]),
    ]
    assert panels[4] == [("typedkv / mm", [(16, 1.1)]), ("typedkv_pool / mm", [(16, 1.25)])]


def test_every_panel_fits_its_distinct_styles() -> None:
    """Ten colours, two line styles: no panel of the full bench (with every baseline) repeats a style."""
    result = _result([c.name for c in _bench.GPU_CASES], ("typedkv", "eager", "compile", "staging"))
    compared = {c.name for c in (_bench.MAIN, _bench.POOL, _bench.MLA_MAIN, _bench.MLA_POOL)}
    result["rows"] = [
        {**row, "us": {k: v for k, v in row["us"].items() if k == "typedkv" or row["case"] in compared}}
        for row in result["rows"]
    ]
    for panel in _bench.plot_series(result):
        assert len(panel) <= 20


def test_unknown_case_names_by_their_words() -> None:
    panels = _bench.plot_series(_result(["L7 H2 D64", "L7 H2 D64 HND B32", "MLA L2 C256 R32"]))
    assert [[label for label, _ in panel] for panel in panels[:3]] == [
        ["L7 H2 D64"],
        ["L7 H2 D64 HND B32"],
        ["MLA L2 C256 R32"],
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _result(["L5 H8 D128", "L5 H8 D128 pool"], ("typedkv", "eager"))
    assert _bench.plot(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_public_call_has_a_host_time_line() -> None:
    """The host-time section times each public function and materializer method: each call runs."""
    calls = _bench.public_calls(torch.device("cpu"), num_tokens=4)
    assert set(calls) == {
        "materialize_kv", "into_pool_stacked", "into_pool_per_layer", "materializer_call",
        "materializer_into_pool_per_layer", "materialize_mla_kv", "mla_into_pool_paged", "mla_into_pool_per_layer",
        "mla_materializer_call", "mla_materializer_into_pool_paged",
    }  # fmt: skip
    for fn in calls.values():
        fn()


def test_host_ratio_pairs_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call and the bare launch alternate round by round, and the ratio is the median of each round's
    own ratio (1.5 here), not the ratio of the two medians (50 / 40)."""
    times = {"call": iter([30.0, 50.0, 60.0, 28.0, 100.0]), "bare": iter([20.0, 40.0, 40.0, 20.0, 40.0])}
    order: list[str] = []

    def scripted(fn: Any, calls: int = 3000) -> float:
        assert calls == 10
        order.append(fn.__name__)
        return next(times[fn.__name__])

    def call() -> None: ...

    def bare() -> None: ...

    monkeypatch.setattr(_bench, "host_time_us", scripted)
    assert _bench.paired_host_time_us(call, bare, rounds=5, calls=10) == (50.0, 40.0, 1.5)
    assert order == ["call", "bare"] * 5
