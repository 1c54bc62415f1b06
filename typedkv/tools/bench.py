"""``typedkv bench``: typedkv against the copy roofline, PyTorch eager and torch.compile.

Device time is measured by replaying a CUDA graph of many calls (launch gaps
vanish, as in a captured decode step) over enough rotating input sets that the
working set exceeds the L2 cache, so every call streams from HBM. Host time per
call is measured separately at T = 16 with a wall clock over thousands of calls.
Bytes counted: kv read once, K and V written once (MLA: ckv read once, its rows written once).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from typedkv.tools.cases import (
    CPU_CASES,
    CPU_TOKENS,
    GPU_CASES,
    GPU_TOKENS,
    MAIN,
    MLA_MAIN,
    MLA_POOL,
    POOL,
    Case,
    Inputs,
    Row,
    bytes_moved,
    eager_call,
    make_inputs,
    rotating_sets,
    staging_call,
    typedkv_call,
)
from typedkv.tools.host import host_overhead
from typedkv.tools.plot import plot, table
from typedkv.tools.timing import _discard, copy_roofline_gbps, gpu_time_us, paired_gpu_time_us


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_gpu(tokens: Sequence[int], cases: Sequence[Case], compare: bool, host: bool = True) -> dict[str, Any]:
    """Measure every case on the current CUDA device (and, with ``host``, every call's host time)."""
    device = torch.device("cuda")
    _log("measuring the copy roofline ...")
    roof = copy_roofline_gbps(device)
    _log(f"  copy: {roof:.0f} GB/s")
    rows: list[Row] = []
    for case in cases:
        for num_tokens in tokens:
            nbytes = bytes_moved(case, num_tokens)
            sets = rotating_sets(nbytes)
            inputs = [make_inputs(case, num_tokens, device) for _ in range(sets)]
            row = Row(case.name, num_tokens, nbytes / 1e6)
            impls: dict[str, Callable[[Case, Inputs], Callable[[], None]]] = {"typedkv": typedkv_call}
            if compare and case in (MAIN, POOL, MLA_MAIN, MLA_POOL):  # the baselines on a dense and a pool case
                impls["eager"] = eager_call
                impls["compile"] = lambda c, x: eager_call(c, x, compiled=True)
                if case.pool and not case.kv_lora_rank:
                    impls["staging"] = staging_call
            for impl, make in impls.items():
                _log(f"{case.name:>22}  T={num_tokens:<6} {impl} ...")
                try:
                    us = gpu_time_us([make(case, x) for x in inputs])
                except Exception as err:  # a baseline that cannot be captured is reported, not fatal
                    _log(f"    {impl} failed: {type(err).__name__}: {err}")
                    continue
                row.us[impl] = round(us, 2)
                row.gbps[impl] = round(nbytes / us / 1e3, 1)
                row.pct_of_copy[impl] = round(100 * nbytes / us / 1e3 / roof, 1)
            rows.append(row)
            del inputs
            torch.cuda.empty_cache()
    result: dict[str, Any] = {"copy_GBps": round(roof, 1), "rows": [asdict(r) for r in rows]}
    if host:
        result["host"] = host_overhead(device)
    return result


def run_cpu(tokens: Sequence[int], cases: Sequence[Case]) -> dict[str, Any]:
    """Small CPU sizes: typedkv's CPU path against a plain copy of the same bytes."""
    device = torch.device("cpu")
    rows: list[Row] = []
    src = torch.randn(1 << 24)
    dst = torch.empty_like(src)
    roof = 2 * src.numel() * 4 / _cpu_time_us(lambda: _discard(dst.copy_(src))) / 1e3
    for case in cases:
        for num_tokens in tokens:
            _log(f"{case.name:>22}  T={num_tokens:<6} typedkv (cpu) ...")
            nbytes = bytes_moved(case, num_tokens)
            x = make_inputs(case, num_tokens, device, num_slots=4 * num_tokens)
            us = _cpu_time_us(typedkv_call(case, x))
            row = Row(case.name, num_tokens, nbytes / 1e6)
            row.us["typedkv"] = round(us, 2)
            row.gbps["typedkv"] = round(nbytes / us / 1e3, 2)
            row.pct_of_copy["typedkv"] = round(100 * nbytes / us / 1e3 / roof, 1)
            rows.append(row)
    return {"copy_GBps": round(roof, 1), "rows": [asdict(r) for r in rows]}


def _cpu_time_us(fn: Callable[[], None], repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main(out_dir: Path, quick: bool, compare: bool, only: str = "", tokens: Sequence[int] | None = None) -> int:
    """Run the benchmark for the best available device; print the table, write JSON and PNG.

    ``only``: run the cases whose name contains this text (all when empty). On a GPU, the
    end-to-end section (`typedkv.tools.bench_e2e`) runs when it is empty or ``"e2e"``, and the
    real-drafts section (`typedkv.tools.drafts`) when it is empty, ``"drafts"``, or in a draft's name.
    ``tokens``: the token counts of the per-case sweep and the real-drafts section on a GPU (default:
    `GPU_TOKENS` and `typedkv.tools.drafts.TOKENS`, or their first few with ``quick``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "triton": _triton_version()}
    gpu = torch.cuda.is_available()
    cases = [c for c in (GPU_CASES if gpu else CPU_CASES) if only in c.name]
    drafts = gpu and _names_drafts(only)
    if not cases and not (gpu and only == "e2e") and not drafts:
        names = ", ".join(c.name for c in (GPU_CASES if gpu else CPU_CASES))
        print(f"--only {only!r} names no case on this machine; its cases: {names}", file=sys.stderr)
        return 2
    if gpu:
        meta["device"] = torch.cuda.get_device_name()
        result = run_gpu(tokens or (GPU_TOKENS[:3] if quick else GPU_TOKENS), cases, compare)
    else:
        meta["device"] = "cpu (no CUDA device: small sizes, PyTorch reference path)"
        result = run_cpu(CPU_TOKENS, cases)
    if torch.cuda.is_available() and only in ("", "e2e"):
        from typedkv.tools.bench_e2e import e2e_table, section

        _log("end to end: hidden states to K/V ...")
        result["e2e"] = section(paired_gpu_time_us, torch.device("cuda"), quick)
    if drafts:
        from typedkv.tools.drafts import IMPLEMENTATIONS
        from typedkv.tools.drafts import section as drafts_section

        _log("real drafts: hidden states to the cache ...")
        result["drafts"] = drafts_section(
            paired_gpu_time_us,
            torch.device("cuda"),
            result["copy_GBps"],
            quick,
            only,
            IMPLEMENTATIONS if compare else (),
            tokens,
        )
    result = {**meta, "title": f"typedkv on {meta['device']}, {meta['date']}", **result}
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    if "e2e" in result:
        print("\n" + e2e_table(result["e2e"]))
    if "drafts" in result:
        from typedkv.tools.drafts import drafts_table

        print("\n" + drafts_table(result["drafts"]))
    if plot(result, out_dir / "bench.png"):
        print(f"\nwrote {out_dir / 'bench.json'} and {out_dir / 'bench.png'}")
    else:
        print(f"\nwrote {out_dir / 'bench.json'} (no plot: nothing to plot, or matplotlib not installed)")
    return 0


def _names_drafts(only: str) -> bool:
    """Whether ``--only`` selects the real-drafts section: empty, ``"drafts"``, or part of a draft's name."""
    from typedkv.tools.draft_shapes import DRAFTS

    return only in ("", "drafts") or any(only in d.name for d in DRAFTS)


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return "not installed"
