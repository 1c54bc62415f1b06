"""``typedkv bench``'s real-drafts section: the K/V path of drafts that ship, from hidden states to the cache.

Each case is a published draft's shape, read from its config (`DRAFTS`: where each number comes from
beside it), with the features it needs. At each T every implementation is timed in one paired call of
the end-to-end section's timer (`typedkv.tools.bench_e2e.Timer`: CUDA-graph replays, the
implementations in the rows of a balanced Latin square, rotating input sets up to
`typedkv.tools.bench_e2e.ROTATE_UP_TO`):

- ``typedkv``: `KVMaterializer.into_pool` / `MLAKVMaterializer.into_pool`, with the draft's features;
- ``per_layer``: one materializer per layer, called in turn -- a GEMM and a launch per layer, as an
  engine does when each attention module writes its own layer's cache;
- ``eager``: the unfused PyTorch path (the GEMM, then norms, RoPE and quantization as separate ops),
  then one indexed write per layer;
- ``compile``: ``torch.compile`` of the eager path's math, the writes left eager as an engine's are.

A row's ``pct_of_copy`` is `bytes_moved` over each implementation's time, as a share of the copy
roofline the bench measures.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from typedkv.core.reference import rotated
from typedkv.projection.materializer import KVMaterializer
from typedkv.projection.mla_materializer import MLAKVMaterializer
from typedkv.tools.bench_e2e import ROTATE_UP_TO, Timer, paired_ratio
from typedkv.tools.draft_shapes import DRAFTS, Draft

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
IMPLEMENTATIONS = ("per_layer", "eager", "compile")  # the alternatives timed beside typedkv
MAX_POSITION = 4096  # rows of the RoPE tables (the positions drawn stay below it)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
DS_MLA_ROW = 656  # bytes of an fp8_ds_mla row: 512 e4m3 | 4 float32 scales | 64 bfloat16


def bytes_moved(draft: Draft, num_tokens: int) -> int:
    """Hidden and the projection weights (and bias) read once, the cache rows and their scales written once.

    The weights are the model's: a K=V draft's K rows once (the materializer is given them twice).
    """
    item = draft.dtype.itemsize
    read = (num_tokens + draft.num_layers * draft.projection_rows) * draft.hidden * item
    if draft.bias:
        read += draft.num_layers * draft.projection_rows * item
    if draft.kv_lora_rank:
        row = DS_MLA_ROW if draft.cache_format == "fp8_ds_mla" else (draft.kv_lora_rank + draft.rotary_dim) * item
    elif draft.pool == "fp8_scales":
        row = 2 * draft.num_kv_heads * (draft.head_dim + 4)
    else:
        row = 2 * draft.num_kv_heads * draft.head_dim * item
    return read + num_tokens * draft.num_layers * row


@dataclass
class Weights:
    """A draft's weights as the materializer takes them, and the model's own where they differ."""

    kv_weight: Tensor  # [L, rows, hidden]: K rows then V rows (K=V: K's rows twice), MLA: latent then rope rows
    model_weight: Tensor  # [L * projection_rows, hidden]: the one GEMM of the unfused path (a view when it can be)
    bias: Tensor | None  # [L, rows]
    k_norm_weight: Tensor | None  # [L, D] (MLA: [L, C])
    v_norm_weight: Tensor | None  # [L, D]
    eps: float
    cos_sin_cache: Tensor  # [P, R], or [L, P, R]


def make_weights(draft: Draft, device: torch.device) -> Weights:
    """Fresh random weights (never zeros) of ``draft``'s shapes on ``device``."""
    L, hidden, rows = draft.num_layers, draft.hidden, draft.projection_rows
    weight = torch.randn(L, rows, hidden, device=device, dtype=draft.dtype) / hidden**0.5
    kv_weight = torch.cat((weight, weight), dim=1) if draft.k_eq_v else weight
    bias = torch.randn(L, rows, device=device, dtype=draft.dtype) / 4 if draft.bias else None
    norm_width = draft.kv_lora_rank or draft.head_dim
    k_norm = torch.rand(L, norm_width, device=device) + 0.5 if draft.k_norm else None
    v_norm = torch.rand(L, draft.head_dim, device=device) + 0.5 if draft.v_norm else None
    bases = [draft.rope_theta * (layer + 1) for layer in range(L)] if draft.per_layer_rope else [draft.rope_theta]
    tables = torch.stack([_table(draft, base, device) for base in bases])
    cos_sin = tables if draft.per_layer_rope else tables[0]
    return Weights(kv_weight, weight.flatten(0, 1), bias, k_norm, v_norm, 1e-6, cos_sin)


def _table(draft: Draft, base: float, device: torch.device) -> Tensor:
    """``[P, R]``: cos then sin of each frequency; a proportional table has the last frequencies zero (cos 1, sin 0)."""
    half = draft.rotary_dim // 2
    inv_freq = 1.0 / base ** (torch.arange(half, dtype=torch.float32, device=device) / half)
    inv_freq[math.ceil(half * draft.rotary_fraction) :] = 0.0
    angles = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@dataclass
class Inputs:
    """One call's inputs: hidden states, positions, slots, and the pools (``k``, ``v`` [, ``k_scales``,
    ``v_scales``], or ``kv`` for MLA), each ``[L, ...]``."""

    hidden: Tensor
    positions: Tensor
    cache_loc: Tensor
    pools: dict[str, Tensor] = field(default_factory=dict)

    def cloned(self) -> Inputs:
        """The same inputs with pools of their own (what each implementation of a check writes)."""
        return replace(self, pools={k: p.clone() for k, p in self.pools.items()})


def make_inputs(draft: Draft, num_tokens: int, device: torch.device) -> Inputs:
    """Fresh random hidden states and positions, distinct random slots, zeroed pools of twice ``num_tokens`` slots."""
    L, T = draft.num_layers, num_tokens
    hidden = torch.randn(T, draft.hidden, device=device, dtype=draft.dtype)
    positions = torch.randint(0, MAX_POSITION, (T,), device=device)
    slots = 2 * T
    if draft.kv_lora_rank:
        pages = -(-slots // draft.page_size)
        slots = pages * draft.page_size
        if draft.cache_format == "fp8_ds_mla":
            pools = {"kv": torch.zeros(L, pages, draft.page_size, DS_MLA_ROW, device=device, dtype=torch.uint8)}
        else:
            width = draft.kv_lora_rank + draft.rotary_dim
            pools = {"kv": torch.zeros(L, pages, draft.page_size, width, device=device, dtype=draft.dtype)}
    else:
        H, D = draft.num_kv_heads, draft.head_dim
        fp8 = draft.pool == "fp8_scales"
        dtype = torch.float8_e4m3fn if fp8 else draft.dtype
        pools = {name: torch.zeros(L, slots, H, D, device=device).to(dtype) for name in ("k", "v")}
        if fp8:
            pools |= {name: torch.zeros(L, slots, H, device=device) for name in ("k_scales", "v_scales")}
    return Inputs(hidden, positions, torch.randperm(slots, device=device)[:T], pools)


Make = Callable[[Inputs], Callable[[], None]]


def implementations(draft: Draft, weights: Weights, names: Sequence[str] = IMPLEMENTATIONS) -> dict[str, Make]:
    """``typedkv`` and each alternative of ``names``, by name."""
    made = {"typedkv": _materializer_call(draft, [_materializer(draft, weights, slice(None))])}
    if "per_layer" in names:
        layers = [_materializer(draft, weights, slice(i, i + 1)) for i in range(draft.num_layers)]
        made["per_layer"] = _materializer_call(draft, layers)
    for compiled in (False, True):
        if ("compile" if compiled else "eager") in names:
            made["compile" if compiled else "eager"] = _unfused_call(draft, weights, compiled)
    return made


def _materializer(draft: Draft, w: Weights, layers: slice) -> KVMaterializer | MLAKVMaterializer:
    """The materializer of ``layers`` of the draft (the stacked weights' views: nothing is copied)."""
    bias = None if w.bias is None else w.bias[layers]
    k_norm = None if w.k_norm_weight is None else w.k_norm_weight[layers]
    cos_sin = w.cos_sin_cache[layers] if draft.per_layer_rope else w.cos_sin_cache
    if draft.kv_lora_rank:
        return MLAKVMaterializer(
            w.kv_weight[layers], k_norm, w.eps, cos_sin, rope_style=draft.rope_style, kv_a_bias=bias
        )
    v_norm = None if w.v_norm_weight is None else w.v_norm_weight[layers]
    return KVMaterializer(
        w.kv_weight[layers], k_norm, w.eps, cos_sin, num_kv_heads=draft.num_kv_heads, rope_style=draft.rope_style,
        kv_bias=bias, v_norm_weight=v_norm,
    )  # fmt: skip


def _materializer_call(draft: Draft, ms: Sequence[KVMaterializer | MLAKVMaterializer]) -> Make:
    """Each of ``ms`` (one for all layers, or one per layer) writing its layers' rows of the pools."""
    step = draft.num_layers // len(ms)

    def make(x: Inputs) -> Callable[[], None]:
        def call() -> None:
            for i, m in enumerate(ms):
                own = {name: pool[i * step : (i + 1) * step] for name, pool in x.pools.items()}
                if isinstance(m, MLAKVMaterializer):
                    m.into_pool(x.hidden, x.positions, x.cache_loc, own["kv"], cache_format=draft.cache_format)
                elif "k_scales" in own:
                    m.into_pool(
                        x.hidden, x.positions, x.cache_loc, own["k"], own["v"],
                        k_scale_out=own["k_scales"], v_scale_out=own["v_scales"],
                    )  # fmt: skip
                else:
                    m.into_pool(x.hidden, x.positions, x.cache_loc, own["k"], own["v"])

        return call

    return make


def _unfused_call(draft: Draft, w: Weights, compiled: bool) -> Make:
    """The model's path: `unfused_rows` (compiled or not), then one indexed write per layer and pool."""

    def rows(hidden: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        return unfused_rows(draft, w, hidden, positions)

    if compiled:
        # Every draft compiles the same `rows`, and Dynamo keeps at most 8 versions of one function (two a
        # draft: its first T, then dynamic shapes), failing the ninth under fullgraph: each draft starts clean.
        torch.compiler.reset()
    fn = torch.compile(rows, fullgraph=True) if compiled else rows

    def make(x: Inputs) -> Callable[[], None]:
        # An MLA pool's pages flattened: slot s is row s of [L, N*B, row]. FP8 rows are copied as bytes
        # (index_copy_ takes no float8 dtype).
        flat = [p.view(p.shape[0], -1, p.shape[-1]) if draft.kv_lora_rank else p for p in x.pools.values()]
        flat = [_bytes(p) for p in flat]

        def call() -> None:
            for pool, values in zip(flat, fn(x.hidden, x.positions), strict=True):
                for layer in range(draft.num_layers):
                    pool[layer].index_copy_(0, x.cache_loc, _bytes(values[layer]))

        return call

    return make


def _bytes(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def unfused_rows(draft: Draft, w: Weights, hidden: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
    """What the model writes, computed by separate PyTorch ops: per pool of `make_inputs`, ``[L, T, ...]``.

    One GEMM for all layers; K: RMSNorm in float32 rounded to the storage dtype (as the model stores the
    norm's output), then RoPE in float32; V as projected, or RMS-normed (Gemma-4); FP8 pools: the scale of
    each (layer, token, head) row is its largest magnitude over 448 and the values are divided by it and
    saturated (`_fp8_rows`); fp8_ds_mla rows: the latent in four groups of 128 quantized so, the rope part in
    bfloat16 (`_ds_mla_rows`).
    """
    L, T = draft.num_layers, hidden.shape[0]
    flat_bias = None if w.bias is None else w.bias.flatten()
    if flat_bias is None:
        proj = torch.mm(hidden, w.model_weight.t())
    else:
        proj = torch.addmm(flat_bias, hidden, w.model_weight.t())
    proj = proj.view(T, L, -1).transpose(0, 1)  # [L, T, rows]
    table = w.cos_sin_cache if draft.per_layer_rope else w.cos_sin_cache[None]
    neox = draft.rope_style == "neox"
    if draft.kv_lora_rank:
        latent, rope = proj[..., : draft.kv_lora_rank].float(), proj[..., draft.kv_lora_rank :].float()
        if w.k_norm_weight is not None:
            latent = _rms(latent, w.k_norm_weight, w.eps).to(draft.dtype).float()
        rope = _rope(rope, table, positions, neox)
        if draft.cache_format == "fp8_ds_mla":
            return (_ds_mla_rows(latent, rope),)
        return (torch.cat((latent, rope), dim=-1).to(draft.dtype),)
    heads = (draft.num_kv_heads, draft.head_dim)
    width = draft.num_kv_heads * draft.head_dim
    k = proj[..., :width].unflatten(-1, heads)
    v = k if draft.k_eq_v else proj[..., width:].unflatten(-1, heads)
    kf = k.float()
    if w.k_norm_weight is not None:
        kf = _rms(kf, w.k_norm_weight, w.eps).to(draft.dtype).float()
    kf = _rope(kf, table, positions, neox)
    vf = v.float() if w.v_norm_weight is None else _rms(v.float(), w.v_norm_weight, w.eps).to(draft.dtype).float()
    if draft.pool == "fp8_scales":
        (k8, k_scale), (v8, v_scale) = _fp8_rows(kf), _fp8_rows(vf)
        return k8, v8, k_scale, v_scale
    return kf.to(draft.dtype), vf.to(draft.dtype)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x`` (float32, ``[L, ..., F]``) RMS-normed over its last dim, times ``weight`` ``[L, F]``."""
    scale = weight.float().view(weight.shape[0], *(1,) * (x.dim() - 2), weight.shape[-1])
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def _rope(x: Tensor, table: Tensor, positions: Tensor, neox: bool) -> Tensor:
    """``x`` (float32, ``[L, T, ..., F]``) with its first R dims rotated by ``table`` (``[L or 1, P, R]``)."""
    cos_sin = table[:, positions].float()  # [L or 1, T, R]
    cos_sin = cos_sin.view(*cos_sin.shape[:2], *(1,) * (x.dim() - 3), cos_sin.shape[-1])
    half = cos_sin.shape[-1] // 2
    return rotated(x, cos_sin[..., :half], cos_sin[..., half:], neox)


def _fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (float32) as float8_e4m3fn rows over its last dim, and each row's float32 scale, as vLLM's
    per-token-head FP8 caches quantize: ``max(amax / 448, 1e-6)``, the row times its reciprocal, saturated."""
    scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(1e-6)
    return (x * scale.reciprocal()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _ds_mla_rows(latent: Tensor, rope: Tensor) -> Tensor:
    """fp8_ds_mla rows, ``[L, T, 656]`` uint8: the latent's 512 e4m3 values (each group of 128 divided by its scale,
    ``max(amax / 448, float32's tiny)``, saturated), the four scales, the rope part in bfloat16."""
    groups = latent.unflatten(-1, (4, 128))
    scales = (groups.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    parts = (values.flatten(-2).view(torch.uint8), scales.view(torch.uint8), rope.to(torch.bfloat16).view(torch.uint8))
    return torch.cat(parts, dim=-1)


def section(
    timer: Timer,
    device: torch.device,
    copy_gbps: float,
    quick: bool,
    only: str = "",
    names: Sequence[str] = IMPLEMENTATIONS,
    tokens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The bench's real-drafts section: every draft of `DRAFTS` (those whose name holds ``only`` unless it is
    empty or ``"drafts"``), at ``tokens`` (default `TOKENS`; ``quick``: its first four)."""
    drafts = [d for d in DRAFTS if only in ("", "drafts") or only in d.name]
    return run_drafts(timer, device, drafts, tokens or (TOKENS[:4] if quick else TOKENS), copy_gbps, names)


def run_drafts(
    timer: Timer,
    device: torch.device,
    drafts: Sequence[Draft],
    tokens: Sequence[int],
    copy_gbps: float,
    names: Sequence[str] = IMPLEMENTATIONS,
) -> dict[str, Any]:
    """Each draft timed at each T, every implementation of one T in one paired ``timer`` call.

    An implementation whose first call fails (a baseline ``torch.compile`` cannot build) is left out
    of the draft's rows, with the error.
    """
    out = []
    for draft in drafts:
        entry: dict[str, Any] = {
            "name": draft.name, "source": draft.source, "shape": draft.shape(), "features": list(draft.features),
            "assumed": draft.assumed,
        }  # fmt: skip
        weights = make_weights(draft, device)
        makes = implementations(draft, weights, names)
        rows = []
        for num_tokens in tokens:
            sets = [make_inputs(draft, num_tokens, device) for _ in range(4 if num_tokens <= ROTATE_UP_TO else 1)]
            calls = {impl: [make(x) for x in sets] for impl, make in makes.items()}
            for impl, fns in list(calls.items()):
                try:  # a baseline that cannot run is reported, not fatal (as the bench's other sections)
                    fns[0]()
                except Exception as err:
                    entry.setdefault("failed", {})[impl] = f"{type(err).__name__}: {err}"
                    _log(f"{draft.name}  T={num_tokens}: {impl} failed: {type(err).__name__}: {err}")
                    del calls[impl]
            _log(f"{draft.name:>32}  T={num_tokens:<6} {', '.join(calls)} ...")
            rounds = timer(calls) if calls else {}
            del sets, calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(_row(draft, num_tokens, rounds, copy_gbps))
            # Each row as it is measured: a run stopped early still tells what it timed.
            _log(" ".join(f"{impl} {us:.2f} us" for impl, us in rows[-1]["us"].items()))
        entry["rows"] = rows
        out.append(entry)
    return {"copy_GBps": copy_gbps, "drafts": out}


def _row(draft: Draft, num_tokens: int, rounds: Mapping[str, Sequence[float]], copy_gbps: float) -> dict[str, Any]:
    nbytes = bytes_moved(draft, num_tokens)
    us = {impl: round(statistics.median(times), 2) for impl, times in rounds.items()}
    pct = {impl: round(100 * nbytes / t / 1e3 / copy_gbps, 1) for impl, t in us.items()}
    alternatives = [impl for impl in rounds if impl != "typedkv"] if "typedkv" in rounds else []
    paired = {f"{impl} / typedkv": paired_ratio(rounds[impl], rounds["typedkv"]) for impl in alternatives}
    return {
        "tokens": num_tokens,
        "megabytes": round(nbytes / 1e6, 3),
        "us": us,
        "pct_of_copy": pct,
        "ratio": {name: round(r.median, 3) for name, r in paired.items()},
        "ratio_range": {name: [round(r.low, 3), round(r.high, 3)] for name, r in paired.items()},
    }


def drafts_table(result: dict[str, Any]) -> str:
    """The section as text: per draft its source and shape, then per T each implementation's µs and % of copy."""
    lines = [
        f"real drafts, hidden states to the cache (copy roofline {result['copy_GBps']:.0f} GB/s); "
        "us per call (median of the rounds) and % of copy, each alternative over typedkv:"
    ]
    for entry in result["drafts"]:
        shape = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry["shape"].items())
        features = ", ".join(entry["features"]) or "-"
        lines += ["", f"{entry['name']}: {shape}; features: {features}", f"  source: {entry['source']}"]
        if entry["assumed"]:
            lines.append(f"  assumed: {entry['assumed']}")
        for impl, error in entry.get("failed", {}).items():
            lines.append(f"  {impl} failed: {error}")
        for row in entry["rows"]:
            cells = "  ".join(f"{impl} {row['us'][impl]:.2f} us {row['pct_of_copy'][impl]:.1f}%" for impl in row["us"])
            ratios = "  ".join(f"{name} {value:.2f}" for name, value in row["ratio"].items())
            lines.append(f"  T={row['tokens']:<6} {cells}  {ratios}".rstrip())
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
