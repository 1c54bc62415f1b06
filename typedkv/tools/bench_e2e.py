"""``typedkv bench``'s end-to-end section: a draft's whole K/V path, from hidden states to the cache.

A Qwen3-style DFlash draft (5 layers, 8 KV heads, head dim 128, hidden 4096,
32 query heads, bfloat16), timed per call at each T:

- ``mm``: the projection GEMM alone (``torch.mm`` into a reused buffer), the floor;
- ``typedkv``: a `KVMaterializer` call, ``[L, T, H, D]`` K and V;
- ``typedkv_pool``: `KVMaterializer.into_pool` into sglang-style per-layer pools
  (K and V of a layer the two halves of one allocation);
- both again with each projection path pinned (``_gemm``: the GEMM, then the
  K/V kernel; ``_fused``: one kernel, GEMM and epilogue), beside the path
  ``"auto"`` chose (the unsuffixed rows), so one run says which is faster at
  each T -- what ``typedkv.projection.tuning.TUNING`` is to record;
- ``sglang``: sglang's ``FusedKVMaterializeHelper.materialize`` with a no-op
  callback (GEMM plus its kernel into dense buffers), and ``sglang_pool`` with
  the per-layer index writes its DFlash worker does through ``set_kv_buffer`` --
  when sglang's ``fused_kv_materialize.py`` can be loaded (from the pinned wheel
  in ``.whl/`` or ``.sglang/``, or ``TYPEDKV_SGLANG_WHEEL``).

The timer is the caller's (`typedkv.tools.bench.paired_gpu_time_us`: CUDA-graph
replay, every implementation of one T timed in each of several rounds, in the
rows of a balanced Latin square), so this module needs nothing of the rest of
the bench. A row's ``us`` are the medians over the rounds; each ratio is the
median of its per-round ratios (`paired_ratio`), with its lowest and highest
round in ``ratio_range``.
Where NVML can be read, a row also holds the SM clock and power sampled while
it was timed (``gpu``; `typedkv.tools.gpu_state`): on the H200 the GEMM runs at the
board's power limit, whose clock differs between machines and moves the ratios.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple, Protocol

import torch

from typedkv.projection.materializer import KVMaterializer
from typedkv.tools.gpu_state import GpuState, Window

TOKENS = (1, 16, 64, 256, 1024, 2048, 16384, 65536)
SGLANG_FILE = "sglang/kernels/ops/speculative/fused_kv_materialize.py"
SGLANG_WHEEL = "sglang-0.5.23-*.whl"


@dataclass(frozen=True)
class Draft:
    """The benchmarked draft's shape."""

    num_layers: int = 5
    num_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    num_heads: int = 32  # query heads: their rows come first in the fused QKV weight
    dtype: torch.dtype = torch.bfloat16
    max_position: int = 32768


class Timer(Protocol):
    """The paired timer (`typedkv.tools.bench.paired_gpu_time_us`): each implementation's calls by name in, each one's
    microseconds per call in each round out; ``sampling``, where given, entered around the timed rounds only."""

    def __call__(
        self, calls: Mapping[str, Sequence[Callable[[], None]]], *, sampling: Window | None = None
    ) -> Mapping[str, Sequence[float]]: ...


class PairedRatio(NamedTuple):
    """A ratio of two implementations' times over the rounds of one paired timing (`paired_ratio`)."""

    median: float  # the median of the per-round ratios
    low: float  # the lowest round's
    high: float  # the highest round's


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> PairedRatio:
    """``numerator / denominator`` round by round: the median of the per-round ratios, and their range.

    Not the ratio of the two medians: each round's two times were taken moments
    apart, in one state of the host, and the ratio of two medians can pair
    rounds the host spent in different states.
    """
    ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
    return PairedRatio(statistics.median(ratios), min(ratios), max(ratios))


def load_sglang(search: Sequence[Path] = (Path(".whl"), Path(".sglang"))) -> tuple[ModuleType | None, str]:
    """sglang's fused_kv_materialize module, loaded by path from the wheel; None and the reason when it cannot be."""
    named = os.environ.get("TYPEDKV_SGLANG_WHEEL")
    wheels = [Path(named)] if named else [w for folder in search for w in sorted(folder.glob(SGLANG_WHEEL))]
    if not wheels or not wheels[0].is_file():
        return None, "no sglang 0.5.23 wheel in .whl/ or .sglang/ (or TYPEDKV_SGLANG_WHEEL)"
    path = Path(tempfile.mkdtemp(prefix="typedkv-sglang-")) / "fused_kv_materialize.py"
    with zipfile.ZipFile(wheels[0]) as archive:
        path.write_bytes(archive.read(SGLANG_FILE))
    spec = importlib.util.spec_from_file_location("sglang_fused_kv_materialize", path)
    if spec is None or spec.loader is None:
        return None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(wheels[0])


def _layers(draft: Draft, device: torch.device) -> tuple[list[SimpleNamespace], SimpleNamespace]:
    """sglang-shaped draft layers (the attributes its helper reads) and their rotary module."""
    half = draft.head_dim // 2
    inv_freq = 1.0 / 1e6 ** (torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(draft.max_position, dtype=torch.float32, device=device), inv_freq)
    rotary = SimpleNamespace(
        rotary_dim=draft.head_dim, is_neox_style=True, cos_sin_cache=torch.cat((angles.cos(), angles.sin()), dim=-1)
    )
    q_size, kv_size = draft.num_heads * draft.head_dim, draft.num_kv_heads * draft.head_dim
    layers = []
    for i in range(draft.num_layers):
        weight = torch.randn(q_size + 2 * kv_size, draft.hidden, device=device, dtype=draft.dtype) / draft.hidden**0.5
        attn = SimpleNamespace(
            num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim, q_size=q_size, kv_size=kv_size,
            qkv_proj=SimpleNamespace(weight=weight), rotary_emb=rotary,
            k_norm=SimpleNamespace(weight=torch.rand(draft.head_dim, device=device, dtype=draft.dtype) + 0.5,
                                   variance_epsilon=1e-6),
            attn=SimpleNamespace(layer_id=i),
        )  # fmt: skip
        layers.append(SimpleNamespace(self_attn=attn))
    return layers, rotary


class BenchDraft(NamedTuple):
    """The bench's draft built on a device: its layers and weights as each implementation takes them."""

    draft: Draft
    layers: list[SimpleNamespace]  # sglang-shaped (`_layers`)
    rotary: SimpleNamespace
    weight: torch.Tensor  # [L, 2*H*D, hidden]: each layer's K and V rows of its QKV projection, as KVMaterializer
    norm: torch.Tensor  # [L, D]: each layer's K norm weight
    flat: torch.Tensor  # [L*2*H*D, hidden]: ``weight`` as one torch.mm takes it (a view)


def bench_draft(device: torch.device, draft: Draft | None = None) -> BenchDraft:
    """``draft`` (the bench's by default) built on ``device`` (`BenchDraft`)."""
    draft = draft or Draft()
    layers, rotary = _layers(draft, device)
    rows = slice(draft.num_heads * draft.head_dim, (draft.num_heads + 2 * draft.num_kv_heads) * draft.head_dim)
    weight = torch.stack([layer.self_attn.qkv_proj.weight[rows] for layer in layers]).contiguous()
    norm = torch.stack([layer.self_attn.k_norm.weight for layer in layers])
    return BenchDraft(draft, layers, rotary, weight, norm, weight.flatten(0, 1))


def path_materializers(bench: BenchDraft) -> dict[str, KVMaterializer]:
    """``bench``'s materializer once per ``projection_path`` ("auto" and each path pinned), by path.

    The stacked weight is shared, not copied.
    """
    materializers = {}
    for path in ("auto", "gemm", "fused"):
        m = KVMaterializer(
            bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=bench.draft.num_kv_heads
        )
        m.projection_path = path
        materializers[path] = m
    return materializers


def section(timer: Timer, device: torch.device, quick: bool) -> dict[str, Any]:
    """The bench's end-to-end section: sglang's helper included when its file can be loaded."""
    sglang, where = load_sglang()
    state = GpuState.open(device)
    try:
        result = run_e2e(timer, device, TOKENS[:4] if quick else TOKENS, sglang=sglang, gpu_state=state)
        limits = {"gpu": state.limits()} if state is not None else {}
    finally:
        if state is not None:
            state.close()
    return {"sglang": where if sglang is not None else f"without sglang: {where}", **limits, **result}


# Up to this T, four input sets in turn, so a replay does not serve them from L2 (the weights, 84 MB,
# never fit); above it one set, which L2 may still hold from the call before (benchmarks/ws_sweep.py
# --rotation times both).
ROTATE_UP_TO = 256


def run_e2e(
    timer: Timer,
    device: torch.device,
    tokens: Sequence[int] = TOKENS,
    draft: Draft | None = None,
    sglang: ModuleType | None = None,
    gpu_state: GpuState | None = None,
) -> dict[str, Any]:
    """Time every implementation at each T; per row microseconds and ratios between them.

    ``timer`` times every implementation of one T in one paired call
    (`typedkv.tools.bench.paired_gpu_time_us`); a row's ``us`` are each one's median
    over the rounds, its ``ratio`` the median of each ratio's per-round values,
    and ``ratio_range`` their lowest and highest (`paired_ratio`). With
    ``gpu_state``, a row's ``gpu`` is what it sampled while the row's rounds were
    timed (`typedkv.tools.gpu_state.summary`; not while its graphs were captured).
    """
    bench = bench_draft(device, draft)
    draft, layers, rotary, _, _, flat = bench
    H, D = draft.num_kv_heads, draft.head_dim
    materializers = path_materializers(bench)
    theirs = None
    if sglang is not None:
        theirs = sglang.FusedKVMaterializeHelper(layers, rotary, H, D, device, max_position_hint=draft.max_position)
    # (numerator, denominator) of each ratio a row records.
    pairs = [(f"typedkv{pool}{path}", "mm") for pool in ("", "_pool") for path in ("", "_gemm", "_fused")]
    pairs.append(("typedkv_fused", "typedkv_gemm"))
    if theirs is not None:
        pairs += [("sglang", "mm"), ("sglang_pool", "mm"), ("sglang", "typedkv"), ("sglang_pool", "typedkv_pool")]
    out: list[dict[str, Any]] = []
    for num_tokens in tokens:
        inputs = [_inputs(draft, num_tokens, device) for _ in range(4 if num_tokens <= ROTATE_UP_TO else 1)]
        gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
        # Every graph of this T is alive in the timer at once; they are gone when it returns.
        window = gpu_state.window() if gpu_state is not None else None
        rounds = timer(_calls(inputs, flat, gemm_out, materializers, theirs), sampling=window)
        del inputs, gemm_out
        if device.type == "cuda":
            torch.cuda.empty_cache()  # their memory back before the next T's graphs are captured
        us = {impl: round(statistics.median(times), 2) for impl, times in rounds.items()}
        paired = {f"{a} / {b}": paired_ratio(rounds[a], rounds[b]) for a, b in pairs}
        row = {
            "tokens": num_tokens,
            "us": us,
            "ratio": {name: round(r.median, 3) for name, r in paired.items()},
            "ratio_range": {name: [round(r.low, 3), round(r.high, 3)] for name, r in paired.items()},
        }
        if window is not None:
            row["gpu"] = window.summary
        out.append(row)
    return {"draft": {k: str(v) for k, v in vars(draft).items()}, "rows": out}


def _calls(
    inputs: Sequence[_Inputs],
    flat: torch.Tensor,
    gemm_out: torch.Tensor,
    materializers: dict[str, KVMaterializer],
    theirs: Any,
) -> dict[str, list[Callable[[], None]]]:
    """Each implementation's call on each input set (``materializers`` by projection path)."""

    def each(make: Callable[[_Inputs], Callable[[], None]]) -> list[Callable[[], None]]:
        return [make(x) for x in inputs]

    def dense(m: KVMaterializer) -> list[Callable[[], None]]:
        return each(lambda x: lambda: _discard(m(x.hidden, x.positions)))

    def pool(m: KVMaterializer) -> list[Callable[[], None]]:
        return each(lambda x: lambda: m.into_pool(x.hidden, x.positions, x.cache_loc, x.k_pool, x.v_pool))

    calls = {"mm": each(lambda x: lambda: _discard(torch.mm(x.hidden, flat.t(), out=gemm_out)))}
    for path, m in materializers.items():
        suffix = "" if path == "auto" else f"_{path}"
        calls[f"typedkv{suffix}"] = dense(m)
        calls[f"typedkv_pool{suffix}"] = pool(m)
    if theirs is not None:
        calls["sglang"] = each(lambda x: lambda: theirs.materialize(x.hidden, x.positions, _no_write))
        calls["sglang_pool"] = each(lambda x: lambda: theirs.materialize(x.hidden, x.positions, _index_writes(x)))
    return calls


@dataclass
class _Inputs:
    hidden: torch.Tensor
    positions: torch.Tensor
    cache_loc: torch.Tensor
    k_pool: list[torch.Tensor]
    v_pool: list[torch.Tensor]


def _inputs(draft: Draft, num_tokens: int, device: torch.device) -> _Inputs:
    hidden = torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype)
    positions = torch.randint(0, draft.max_position, (num_tokens,), device=device)
    num_slots = 2 * num_tokens
    cache_loc = torch.randperm(num_slots, device=device)[:num_tokens]
    # sglang's MHATokenToKVPool: per layer, K and V [S, H, D] as the two halves of one allocation.
    fused = [
        torch.zeros(2, num_slots, draft.num_kv_heads, draft.head_dim, device=device, dtype=draft.dtype)
        for _ in range(draft.num_layers)
    ]
    return _Inputs(hidden, positions, cache_loc, [b[0] for b in fused], [b[1] for b in fused])


def _index_writes(x: _Inputs) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    """What sglang's set_kv_buffer does with a layer's K/V for an NHD pool of the same dtype: row writes."""

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        x.k_pool[i][x.cache_loc] = k
        x.v_pool[i][x.cache_loc] = v

    return write


def _no_write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
    return None


def _discard(_: object) -> None:
    return None


def e2e_table(result: dict[str, Any]) -> str:
    """The end-to-end section as a fixed-width text table; below it each ratio's range over the rounds, if recorded."""
    lines = [
        f"end to end, hidden states to K/V ({result.get('sglang', '')}); "
        "us per call (median of the rounds), each ratio the median of its per-round ratios:"
    ]
    impls = list(dict.fromkeys(impl for row in result["rows"] for impl in row["us"]))
    ratios = list(dict.fromkeys(r for row in result["rows"] for r in row["ratio"]))
    lines.append(f"{'T':>6} " + " ".join(f"{impl:>13}" for impl in impls) + "  " + "  ".join(ratios))
    for row in result["rows"]:
        cells = " ".join(f"{row['us'].get(impl, float('nan')):>13.2f}" for impl in impls)
        lines.append(
            f"{row['tokens']:>6} {cells}  "
            + "  ".join(f"{row['ratio'].get(r, float('nan')):>{len(r)}.3f}" for r in ratios)
        )
    if any("ratio_range" in row for row in result["rows"]):
        lines += ["", "each ratio's range over the rounds (lowest-highest):"]
        widths = {r: max(len(r), 11) for r in ratios}  # 11: "0.000-0.000"
        lines.append(f"{'T':>6}  " + "  ".join(f"{r:>{widths[r]}}" for r in ratios))
        for row in result["rows"]:
            spans = row.get("ratio_range", {})
            cells = "  ".join(f"{_span(spans.get(r)):>{widths[r]}}" for r in ratios)
            lines.append(f"{row['tokens']:>6}  {cells}")
    if any(row.get("gpu", {}).get("samples") for row in result["rows"]):
        limits = result.get("gpu", {})
        lines += [
            "",
            f"the GPU while each T was timed (NVML; highest SM clock {limits.get('max_sm_mhz', '?')} MHz, "
            f"power limit {limits.get('power_limit_w', '?')} W): SM clock median (lowest), power median, "
            "share of samples held at the power limit, what lowered the clock:",
        ]
        for row in result["rows"]:
            gpu = row.get("gpu", {})
            if not gpu.get("samples"):
                lines.append(f"{row['tokens']:>6}  (no samples)")
                continue
            lines.append(
                f"{row['tokens']:>6}  {gpu['sm_mhz']:>6.0f} ({gpu['sm_mhz_low']:.0f}) MHz  {gpu['watts']:>6.1f} W  "
                f"{gpu['at_power_limit']:>4.0%}  {', '.join(gpu['reasons']) or '-'}"
            )
    return "\n".join(lines)


def _span(low_high: Sequence[float] | None) -> str:
    return "-" if low_high is None else f"{low_high[0]:.3f}-{low_high[1]:.3f}"
