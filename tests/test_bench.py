"""The bench's plot: which panel each case lands in, what each panel shows, every series told apart;
the paired timing of the end-to-end section: its rounds' order and how its ratios are reduced; the
real-drafts section: its cases build, each implementation writes the model's rows, its rows and skips."""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv.core import device_tables
from typedkv.tools import bench, bench_e2e, cases, draft_shapes, drafts, host, plot, timing


def _result(cases: list[str], impls: tuple[str, ...] = ("typedkv",)) -> dict[str, Any]:
    rows = []
    for case in cases:
        for tokens in (16, 256):
            us = {impl: float(tokens * (i + 1)) for i, impl in enumerate(impls)}
            rows.append({"case": case, "tokens": tokens, "us": us, "pct_of_copy": {impl: 50.0 for impl in impls}})
    return {"copy_GBps": 4000.0, "rows": rows, "title": "test"}


def test_cases_land_in_their_panels() -> None:
    names = [c.name for c in cases.GPU_CASES]
    panels = plot.plot_series(_result(names))
    labels = [[label for label, _ in panel] for panel in panels]
    assert labels[0] == [c.name for c in cases.GPU_CASES if not c.pool and not c.kv_lora_rank]
    assert labels[1] == [c.name for c in cases.GPU_CASES if c.pool and not c.kv_lora_rank]
    assert labels[2] == [c.name for c in cases.GPU_CASES if c.kv_lora_rank]
    assert labels[3] == labels[4] == []


def test_speedups_and_end_to_end_ratios() -> None:
    result = _result(["L5 H8 D128"], ("typedkv", "eager", "compile"))
    result["e2e"] = {"rows": [{"tokens": 16, "us": {"mm": 20.0, "typedkv": 22.0, "typedkv_pool": 25.0}}]}
    panels = plot.plot_series(result)
    assert panels[3] == [
        ("L5 H8 D128: eager", [(16, 2.0), (256, 2.0)]),
        ("L5 H8 D128: compile", [(16, 3.0), (256, 3.0)]),
    ]
    assert panels[4] == [("typedkv / mm", [(16, 1.1)]), ("typedkv_pool / mm", [(16, 1.25)])]


def test_end_to_end_panel_takes_the_recorded_ratio() -> None:
    """A row's recorded ratio (the median of its per-round ratios) is plotted, not its medians' ratio;
    an implementation without one falls back to the latter."""
    result = _result(["L5 H8 D128"])
    us = {"mm": 20.0, "typedkv": 22.0, "typedkv_pool": 25.0}
    result["e2e"] = {"rows": [{"tokens": 16, "us": us, "ratio": {"typedkv / mm": 1.05, "typedkv_fused / x": 9.0}}]}
    assert plot.plot_series(result)[4] == [("typedkv / mm", [(16, 1.05)]), ("typedkv_pool / mm", [(16, 1.25)])]


def test_every_panel_fits_its_distinct_styles() -> None:
    """Ten colours, two line styles: no panel of the full bench (with every baseline) repeats a style."""
    result = _result([c.name for c in cases.GPU_CASES], ("typedkv", "eager", "compile", "staging"))
    compared = {c.name for c in (cases.MAIN, cases.POOL, cases.MLA_MAIN, cases.MLA_POOL)}
    result["rows"] = [
        {**row, "us": {k: v for k, v in row["us"].items() if k == "typedkv" or row["case"] in compared}}
        for row in result["rows"]
    ]
    for panel in plot.plot_series(result):
        assert len(panel) <= 20


def test_unknown_case_names_by_their_words() -> None:
    panels = plot.plot_series(_result(["L7 H2 D64", "L7 H2 D64 HND B32", "MLA L2 C256 R32"]))
    assert [[label for label, _ in panel] for panel in panels[:3]] == [
        ["L7 H2 D64"],
        ["L7 H2 D64 HND B32"],
        ["MLA L2 C256 R32"],
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _result(["L5 H8 D128", "L5 H8 D128 pool"], ("typedkv", "eager"))
    assert plot.plot(result, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_result_without_panels_writes_no_plot(tmp_path: Path) -> None:
    """``typedkv bench --only drafts`` has no per-case rows: no plot, and no error (its table is its result)."""
    pytest.importorskip("matplotlib")
    result = {"title": "t", "copy_GBps": 1.0, "rows": [], "drafts": {"copy_GBps": 1.0, "drafts": []}}
    assert not plot.plot(result, tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


def test_every_public_call_has_a_host_time_line() -> None:
    """The host-time section times each public function and materializer method: each call runs."""
    calls = host.public_calls(torch.device("cpu"), num_tokens=4) | host.feature_calls(torch.device("cpu"), num_tokens=4)
    assert set(calls) == {
        "materialize_kv", "into_pool_stacked", "into_pool_per_layer", "materializer_call",
        "materializer_into_pool_per_layer", "materialize_mla_kv", "mla_into_pool_paged", "mla_into_pool_per_layer",
        "mla_materializer_call", "mla_materializer_into_pool_paged", "materialize_kv_v_norm",
        "materialize_kv_layer_tables", "into_pool_stacked_fp8", "into_pool_stacked_fp8_scales_out",
        "into_pool_stacked_int8", "mla_into_pool_paged_fp8_ds_mla",
    }  # fmt: skip
    assert set(host.FEATURE_CALLS) | set(host.FEATURE_CALLS.values()) <= set(calls)
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

    monkeypatch.setattr(timing, "host_time_us", scripted)
    assert timing.paired_host_time_us(call, bare, rounds=5, calls=10) == (50.0, 40.0, 1.5)
    assert order == ["call", "bare"] * 5


def test_rounds_follow_a_balanced_latin_square() -> None:
    """Williams's rows: for three implementations three rotations, then the same backwards."""
    impls = ["mm", "typedkv", "typedkv_pool"]
    assert [timing.round_order(impls, r) for r in range(7)] == [
        ["mm", "typedkv", "typedkv_pool"],
        ["typedkv", "typedkv_pool", "mm"],
        ["typedkv_pool", "mm", "typedkv"],
        ["typedkv_pool", "typedkv", "mm"],
        ["mm", "typedkv_pool", "typedkv"],
        ["typedkv", "mm", "typedkv_pool"],
        ["mm", "typedkv", "typedkv_pool"],
    ]
    assert impls == ["mm", "typedkv", "typedkv_pool"]  # not reordered in place


@pytest.mark.parametrize("n", range(2, 12))
def test_each_implementation_follows_every_other_as_often(n: int) -> None:
    """Where the GPU is held at its power limit, what ran just before sets an implementation's clock:
    over a full square (n rounds, 2n for odd n) each runs first, and after each other one, equally often."""
    impls = [f"impl{k}" for k in range(n)]
    rows = [timing.round_order(impls, r) for r in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == sorted(impls) for row in rows)
    firsts = Counter(row[0] for row in rows)
    pairs = Counter(pair for row in rows for pair in itertools.pairwise(row))
    assert set(firsts.values()) == {len(rows) // n} and len(firsts) == n
    assert len(pairs) == n * (n - 1) and set(pairs.values()) == {len(rows) // n}


def test_paired_gpu_timer_captures_all_then_times_in_round_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every graph is captured before the first round (and kept); each round replays every one, in
    `round_order`; each implementation's times come back in round order. Capture and replay are
    scripted: they are the only parts that need a CUDA device."""
    events: list[str] = []
    scripted = {"mm": iter([10.0, 11.0, 12.0]), "a": iter([20.0, 21.0, 22.0]), "b": iter([30.0, 31.0, 32.0])}

    def captured(calls: Sequence[Callable[[], None]], min_calls: int) -> tuple[str, int]:
        assert min_calls == 8
        name = getattr(calls[0], "__name__", "")
        events.append(f"capture {name}")
        return name, 4 * len(calls)

    def replay_us(graph: str, num_calls: int, replays: int) -> float:
        assert (num_calls, replays) == (4, 3)
        events.append(f"replay {graph}")
        return next(scripted[graph])

    def mm() -> None: ...

    def a() -> None: ...

    def b() -> None: ...

    monkeypatch.setattr(timing, "_captured", captured)
    monkeypatch.setattr(timing, "_replay_us", replay_us)
    times = timing.paired_gpu_time_us({"mm": [mm], "a": [a], "b": [b]}, rounds=3, replays=3, min_calls=8)
    assert times == {"mm": [10.0, 11.0, 12.0], "a": [20.0, 21.0, 22.0], "b": [30.0, 31.0, 32.0]}
    assert events == [
        "capture mm", "capture a", "capture b",
        "replay mm", "replay a", "replay b",
        "replay a", "replay b", "replay mm",
        "replay b", "replay mm", "replay a",
    ]  # fmt: skip


def test_the_layer_table_cache_holds_every_rotating_set_of_pools() -> None:
    """Each rotating input set has its own per-layer pools: a set whose table the cache dropped would be copied
    to the device inside the captured graph at every replay, a few microseconds timed with each call."""
    assert cases.rotating_sets(1) <= device_tables._TABLES_MAX


def test_a_paired_ratio_is_the_median_of_the_rounds_ratios() -> None:
    """Rounds' ratios 1.2, 1.1 and 1.5: the median 1.2, not the ratio of the medians (22 / 20 = 1.1)."""
    assert bench_e2e.paired_ratio([12.0, 22.0, 60.0], [10.0, 20.0, 40.0]) == pytest.approx((1.2, 1.1, 1.5))
    with pytest.raises(ValueError):
        bench_e2e.paired_ratio([1.0, 2.0], [1.0])  # rounds that do not pair up


def test_end_to_end_rows_from_the_rounds() -> None:
    """`run_e2e` times one T in one paired call; a row's ``us`` are medians over the rounds, each ratio
    the median of its per-round ratios, ``ratio_range`` their extremes (scripted times, where the ratio
    of medians differs: 22 / 20 for typedkv / mm, 22 / 22 for typedkv_fused / typedkv_gemm)."""
    rounds = {"mm": [10.0, 20.0, 40.0], "typedkv_fused": [6.0, 22.0, 30.0]}
    timed: list[set[str]] = []

    def timer(calls: Any, sampling: Any = None) -> dict[str, list[float]]:
        timed.append(set(calls))
        return {impl: rounds.get(impl, [12.0, 22.0, 60.0]) for impl in calls}

    tiny = bench_e2e.Draft(num_layers=2, num_kv_heads=2, head_dim=64, hidden=64, num_heads=4, dtype=torch.float32)
    result = bench_e2e.run_e2e(timer, torch.device("cpu"), (1, 5), tiny)
    ours = {f"typedkv{pool}{path}" for pool in ("", "_pool") for path in ("", "_gemm", "_fused")}
    assert timed == [{"mm", *ours}] * 2
    row = result["rows"][0]
    assert row["us"]["mm"] == 20.0 and row["us"]["typedkv"] == 22.0
    assert row["ratio"]["typedkv / mm"] == 1.2
    assert row["ratio_range"]["typedkv / mm"] == [1.1, 1.5]
    assert row["ratio"]["typedkv_fused / mm"] == 0.75  # rounds 0.6, 1.1, 0.75
    assert row["ratio"]["typedkv_fused / typedkv_gemm"] == 0.5  # rounds 0.5, 1.0, 0.5
    assert row["ratio_range"]["typedkv_fused / typedkv_gemm"] == [0.5, 1.0]
    assert set(row["ratio_range"]) == set(row["ratio"])
    table = bench_e2e.e2e_table(result)
    assert "range over the rounds" in table and "1.100-1.500" in table


def test_only_picks_cases_on_the_cpu_too(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``typedkv bench --only TEXT`` runs the cases whose name holds TEXT on a CPU machine as well, and an
    ``--only`` that names no case is an error that lists the cases, not an empty table."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "CPU_TOKENS", (16,))
    monkeypatch.setattr(bench, "plot", lambda result, path: False)
    assert bench.main(tmp_path, quick=True, compare=False, only="pool") == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["L2 H2 D64 pool"]
    (tmp_path / "bench.json").unlink()
    assert bench.main(tmp_path, quick=True, compare=False, only="HND") == 2
    assert not (tmp_path / "bench.json").exists()


# --------------------------------------------------------------------------- the real-drafts section


def _decoded(pool: Tensor) -> Tensor:
    """A pool's values as float32: FP8 as they are, fp8_ds_mla rows' latent times its group scales, then
    the rope part."""
    if pool.dtype != torch.uint8:
        return pool.float()
    scales = pool[..., 512:528].contiguous().view(torch.float32).repeat_interleave(128, -1)
    latent = pool[..., :512].contiguous().view(torch.float8_e4m3fn).float() * scales
    return torch.cat((latent, pool[..., 528:].contiguous().view(torch.bfloat16).float()), dim=-1)


@pytest.mark.parametrize("draft", draft_shapes.DRAFTS, ids=lambda d: d.name)
def test_each_draft_builds_and_every_implementation_writes_the_models_rows(draft: draft_shapes.Draft) -> None:
    """At a few layers and narrow heads (the draft's features and pool layout kept), typedkv and one
    materializer per layer write the rows of the unfused PyTorch path,
    at the slots named and nowhere else: bit for bit on the reference path; under the Triton kernels,
    whose float32 math rounds differently, within an ulp of the storage dtype."""
    torch.manual_seed(len(draft.name))
    small = draft.shrunk()
    weights = drafts.make_weights(small, torch.device("cpu"))
    x = drafts.make_inputs(small, 5, torch.device("cpu"))
    written = {}
    for impl, make in drafts.implementations(small, weights, ("per_layer", "eager")).items():
        mine = x.cloned()
        make(mine)()
        written[impl] = mine.pools
    assert set(written) == {"typedkv", "per_layer", "eager"}
    want = written.pop("eager")
    slots = x.cache_loc.tolist()
    for name, pool in want.items():
        rows = pool.view(pool.shape[0], -1, *pool.shape[3:]) if small.kv_lora_rank else pool
        unwritten = [s for s in range(rows.shape[1]) if s not in slots]
        assert rows[:, slots].float().abs().sum() > 0 and not rows[:, unwritten].float().any(), name
        for impl, pools in written.items():
            if os.environ.get("TRITON_INTERPRET") != "1":
                assert torch.equal(pools[name].view(torch.uint8), pool.view(torch.uint8)), (impl, name)
            rtol = 0.13 if pool.dtype in (torch.uint8, torch.float8_e4m3fn) else 1e-5  # an e4m3 step is up to 1/8
            torch.testing.assert_close(
                _decoded(pools[name]), _decoded(pool), rtol=rtol, atol=1e-5, msg=f"{impl} {name}"
            )


def test_every_drafts_compiled_path_builds_at_every_t() -> None:
    """The bench's ``torch.compile`` baseline: every draft, one after another, at two T (the second one
    recompiles with dynamic shapes), as the section runs them, builds and writes the eager path's rows (up to
    rounding)."""
    for draft in draft_shapes.DRAFTS:
        small = draft.shrunk()
        weights = drafts.make_weights(small, torch.device("cpu"))
        makes = drafts.implementations(small, weights, ("eager", "compile"))
        for num_tokens in (3, 6):
            x = drafts.make_inputs(small, num_tokens, torch.device("cpu"))
            written = {}
            for impl in ("eager", "compile"):
                mine = x.cloned()
                makes[impl](mine)()
                written[impl] = mine.pools
            for name, pool in written["eager"].items():
                # Inductor fuses the norm's float32 math in its own order: an ulp of the storage dtype apart.
                rtol = 0.13 if pool.dtype in (torch.uint8, torch.float8_e4m3fn) else 1e-2
                torch.testing.assert_close(
                    _decoded(written["compile"][name]), _decoded(pool), rtol=rtol, atol=1e-5, msg=name
                )


def test_the_unfused_path_is_the_models() -> None:
    """The eager rows of a Qwen3-style draft against the layers' own ops: K is RMSNorm (rounded to the
    storage dtype), then NeoX RoPE of the position's row, V the projection's second half."""
    small = draft_shapes.QWEN3_8B.shrunk(torch.bfloat16)
    w = drafts.make_weights(small, torch.device("cpu"))
    hidden = torch.randn(3, small.hidden).to(torch.bfloat16)
    positions = torch.tensor([0, 7, 4000])
    k, v = drafts.unfused_rows(small, w, hidden, positions)
    H, D = small.num_kv_heads, small.head_dim
    for layer in range(small.num_layers):
        proj = hidden @ w.kv_weight[layer].t()
        raw_k, raw_v = proj[:, : H * D].view(3, H, D).float(), proj[:, H * D :].view(3, H, D)
        assert w.k_norm_weight is not None
        normed = raw_k * torch.rsqrt(raw_k.pow(2).mean(-1, keepdim=True) + w.eps) * w.k_norm_weight[layer]
        normed = normed.to(torch.bfloat16).float()
        cos, sin = w.cos_sin_cache[positions].chunk(2, dim=-1)
        x1, x2 = normed.chunk(2, dim=-1)
        roped = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), dim=-1)
        torch.testing.assert_close(k[layer].float(), roped.to(torch.bfloat16).float())
        assert torch.equal(v[layer], raw_v)


def test_fp8_rows_carry_their_scales() -> None:
    """The unfused FP8 rows: each row's scale is its largest magnitude over 448, and values times scales
    give the row back to FP8's precision; an fp8_ds_mla row is 512 e4m3 values, 4 scales, 64 bf16."""
    x = torch.randn(2, 3, 4, 32) * 5
    values, scales = drafts._fp8_rows(x)
    torch.testing.assert_close(scales, x.abs().amax(-1) / 448)
    torch.testing.assert_close(values.float() * scales[..., None], x, rtol=0.07, atol=1e-6)
    latent, rope = torch.randn(2, 3, 512), torch.randn(2, 3, 64)
    rows = drafts._ds_mla_rows(latent, rope)
    assert rows.shape == (2, 3, 656) and rows.dtype == torch.uint8
    group_scales = rows[..., 512:528].contiguous().view(torch.float32)
    back = rows[..., :512].contiguous().view(torch.float8_e4m3fn).float() * group_scales.repeat_interleave(128, -1)
    torch.testing.assert_close(back, latent, rtol=0.07, atol=1e-6)
    assert torch.equal(rows[..., 528:].contiguous().view(torch.bfloat16), rope.to(torch.bfloat16))


def test_real_drafts_rows_from_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_drafts` times one T in one paired call; a row's % of copy is its bytes over its median time and the
    copy roofline; an implementation whose first call fails is left out with its error, not fatal."""
    made = drafts.implementations

    def with_a_failing_compile(draft: draft_shapes.Draft, weights: drafts.Weights, names: Any) -> dict[str, Any]:
        def broken(x: drafts.Inputs) -> Callable[[], None]:
            def call() -> None:
                raise RuntimeError("cannot compile")

            return call

        return {**made(draft, weights, ("per_layer", "eager")), "compile": broken}

    monkeypatch.setattr(drafts, "implementations", with_a_failing_compile)
    timed: list[set[str]] = []

    def timer(calls: Any, sampling: Any = None) -> dict[str, list[float]]:
        timed.append(set(calls))
        return {impl: {"typedkv": [10.0, 20.0, 40.0]}.get(impl, [30.0, 40.0, 60.0]) for impl in calls}

    small = [d.shrunk() for d in draft_shapes.DRAFTS]
    result = drafts.run_drafts(timer, torch.device("cpu"), small, (1, 5), copy_gbps=1000.0)
    assert len(timed) == 2 * len(small)
    for draft, entry in zip(small, result["drafts"], strict=True):
        assert entry["failed"] == {"compile": "RuntimeError: cannot compile"}
        for row in entry["rows"]:
            assert set(row["us"]) == {"typedkv", "per_layer", "eager"}
            nbytes = drafts.bytes_moved(draft, row["tokens"])
            for impl, us in row["us"].items():
                assert row["pct_of_copy"][impl] == round(100 * nbytes / us / 1e3 / 1000.0, 1)
            assert row["us"]["typedkv"] == 20.0
            assert row["ratio"] == {"per_layer / typedkv": 2.0, "eager / typedkv": 2.0}  # rounds 3, 2, 1.5
            assert row["ratio_range"]["eager / typedkv"] == [1.5, 3.0]
    table = drafts.drafts_table(result)
    for draft in small:
        assert draft.name in table and draft.source in table


def test_the_drafts_section_takes_the_token_counts_and_the_drafts_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tokens`` reaches the real-drafts section (``typedkv bench --only drafts --tokens 16 256``); without
    it, `TOKENS` (``--quick``: its first four); ``--only`` with part of a name times that draft alone."""
    asked: list[tuple[list[str], tuple[int, ...]]] = []

    def run(timer: Any, device: Any, chosen: Any, tokens: Any, copy_gbps: float, names: Any) -> dict[str, Any]:
        asked.append(([d.name for d in chosen], tuple(tokens)))
        return {}

    monkeypatch.setattr(drafts, "run_drafts", run)
    everything = [d.name for d in draft_shapes.DRAFTS]
    drafts.section(None, torch.device("cpu"), 1.0, quick=False, only="drafts", tokens=(16, 256))  # type: ignore[arg-type]
    drafts.section(None, torch.device("cpu"), 1.0, quick=False)  # type: ignore[arg-type]
    drafts.section(None, torch.device("cpu"), 1.0, quick=True, only="Gemma")  # type: ignore[arg-type]
    assert asked == [
        (everything, (16, 256)),
        (everything, drafts.TOKENS),
        ([d.name for d in draft_shapes.DRAFTS if "Gemma" in d.name], drafts.TOKENS[:4]),
    ]
    assert len(asked[2][0]) == 1


def test_every_feature_is_timed_on_a_draft() -> None:
    """Each feature of typedkv's "drafts as they ship" has a case, and every case says where its numbers
    come from."""
    timed = {f for d in draft_shapes.DRAFTS for f in d.features}
    assert timed == set(draft_shapes.FEATURES)
    assert all(d.source for d in draft_shapes.DRAFTS)
    assert len({d.name for d in draft_shapes.DRAFTS}) == len(draft_shapes.DRAFTS)


def test_only_picks_the_drafts_section(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--only drafts`` or part of a draft's name selects the real-drafts section (a GPU section: on a CPU
    machine it names no case); other text does not."""
    assert bench._names_drafts("drafts") and bench._names_drafts("Kimi") and bench._names_drafts("")
    assert not bench._names_drafts("HND") and not bench._names_drafts("e2e")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(tmp_path, quick=True, compare=False, only="drafts") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("draft", draft_shapes.DRAFTS, ids=lambda d: d.name)
def test_each_draft_at_its_own_shape_writes_the_models_rows_on_the_gpu(draft: draft_shapes.Draft) -> None:
    """At the draft's own shape, bfloat16, on the GPU: typedkv and one materializer per layer write the unfused
    path's rows, up to the GEMM's accumulation order (a few bf16 ulps; an FP8 value, one e4m3 step)."""
    torch.manual_seed(len(draft.name))
    device = torch.device("cuda")
    weights = drafts.make_weights(draft, device)
    x = drafts.make_inputs(draft, 16, device)
    written = {}
    for impl, make in drafts.implementations(draft, weights, ("per_layer", "eager")).items():
        mine = x.cloned()
        make(mine)()
        written[impl] = mine.pools
    want = written.pop("eager")
    for impl, pools in written.items():
        for name, pool in want.items():
            rtol = 0.13 if pool.dtype in (torch.uint8, torch.float8_e4m3fn) else 2e-2
            torch.testing.assert_close(
                _decoded(pools[name]), _decoded(pool), rtol=rtol, atol=2e-2, msg=f"{impl} {name}"
            )


@pytest.mark.gpu
@pytest.mark.production
def test_the_drafts_section_times_every_implementation_on_the_gpu() -> None:
    """The section as the bench runs it (its timer, torch.compile included) at one T: every draft has a row
    with typedkv and each alternative. In production mode, as the bench: the timer captures CUDA graphs, which
    debug mode's value checks (a sync each) cannot run in."""
    result = drafts.run_drafts(timing.paired_gpu_time_us, torch.device("cuda"), draft_shapes.DRAFTS, (16,), 3000.0)
    assert [entry["name"] for entry in result["drafts"]] == [draft.name for draft in draft_shapes.DRAFTS]
    for entry in result["drafts"]:
        (row,) = entry["rows"]
        assert set(row["us"]) == {"typedkv", "per_layer", "eager", "compile"}, entry.get("failed")
        assert all(us > 0 for us in row["us"].values())


def test_feature_cases_time_their_feature() -> None:
    """Each bench case of a shipped draft's feature passes the feature: V normed, each layer's own RoPE
    table, per-(token, head) scales written, fp8_ds_mla rows written; nothing written off the slots."""
    by_name = {c.name: c for c in cases.GPU_CASES}
    cpu = torch.device("cpu")

    def run(name: str) -> cases.Inputs:
        case = by_name[name]
        x = cases.make_inputs(case, 4, cpu, num_slots=16)
        for written in (x.k_out, x.v_out, x.k_pool, x.v_pool, x.k_scale_out, x.v_scale_out):
            if written is not None:
                written.view(torch.uint8).zero_()
        cases.typedkv_call(case, x)()
        return x

    x = run("L5 H8 D128 v-norm")
    assert x.v_weight is not None
    rms = (x.v_out.float() / x.v_weight[:, None, None]).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=0, rtol=0.02)

    x = run("L5 H8 D128 layer-tables")
    assert x.cos_sin.dim() == 3
    for layer in (0, 4):
        k, _ = typedkv.materialize_kv(
            x.kv[:, layer : layer + 1], x.weight[layer : layer + 1], 1e-6, x.cos_sin[layer], x.positions, num_kv_heads=8
        )
        torch.testing.assert_close(x.k_out[layer].float(), k[0].float(), atol=2e-2, rtol=2e-2)

    for name in ("L5 H8 D128 pool fp8 scales-out", "L5 H8 D128 pool int8 scales-out"):
        x = run(name)
        assert x.k_scale_out is not None and x.v_scale_out is not None
        for scales in (x.k_scale_out, x.v_scale_out):
            written = torch.zeros(scales.shape[1], dtype=torch.bool)
            written[x.slots] = True
            assert (scales[:, written] > 0).all() and (scales[:, ~written] == 0).all()

    x = run("MLA L5 C512 R64 B64 fp8_ds_mla")
    rows = x.k_pool.view(5, -1, cases.FP8_DS_MLA_BYTES)
    written = torch.zeros(rows.shape[1], dtype=torch.bool)
    written[x.slots] = True
    assert rows[:, written].any(-1).all() and not rows[:, ~written].any()


def test_bytes_of_the_feature_cases() -> None:
    """Written scales count 4 bytes per (token, layer, head) of K and of V; a fp8_ds_mla row its 656 bytes."""
    by_name = {c.name: c for c in cases.GPU_CASES}
    T, L, H, D = 16, 5, 8, 128
    assert cases.bytes_moved(by_name["L5 H8 D128 pool int8 scales-out"], T) == T * L * 2 * H * (D * 2 + D + 4)
    assert cases.bytes_moved(by_name["L5 H8 D128 v-norm"], T) == T * L * 2 * H * D * 4
    assert cases.bytes_moved(by_name["MLA L5 C512 R64 B64 fp8_ds_mla"], T) == T * L * (576 * 2 + 656)
