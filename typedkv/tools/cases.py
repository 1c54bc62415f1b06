"""The cases ``typedkv bench`` times: draft shapes, pool layouts, MLA; their inputs and the calls timed."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from typedkv.kv import reference as kv_reference
from typedkv.kv.api import materialize_kv, materialize_kv_into_pool
from typedkv.mla import reference as mla_reference
from typedkv.mla.api import materialize_mla_kv, materialize_mla_kv_into_pool
from typedkv.tools.timing import _discard

FP8_DS_MLA_BYTES = 656  # a fp8_ds_mla row: 512 FP8 latent values, 4 float32 scales, 64 bf16 rope values
_L2_SPAN = 256 << 20  # bytes the rotating input sets must span, several times the H200's 60 MB L2


def rotating_sets(nbytes: int) -> int:
    """How many input sets of ``nbytes`` a timing rotates through so that L2 holds none of them (1 to 64)."""
    return max(1, min(64, math.ceil(_L2_SPAN / nbytes)))


@dataclass(frozen=True)
class Case:
    """One benchmarked configuration."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dtype: torch.dtype = torch.bfloat16
    rope_style: str = "neox"
    pool: str = ""  # "", "bf16" (pool of kv's dtype), "fp8", "int8", or (MLA) "fp8_ds_mla"
    norm: bool = True  # False: a RoPE-only draft (k_norm_weight=None)
    v_norm: bool = False  # V normed too (v_norm_weight)
    layer_tables: bool = False  # a RoPE table per layer ([L, P, R])
    # An FP8 pool whose per-(token, head) scales the call writes (k_scale_out / v_scale_out); an int8 pool
    # always writes them (`writes_scales`).
    written_scales: bool = False
    # Paged pools (page_size > 0): the K and V halves of one combined cache
    # [L, N, 2, B, H, D] (NHD) or [L, N, 2, H, B, D] (HND), passed as views.
    page_size: int = 0
    kv_layout: str = "NHD"
    # MLA (kv_lora_rank > 0): rows of C + R per token and layer (heads and head_dim unused);
    # a paged MLA pool is [L, N, B, C+R].
    kv_lora_rank: int = 0

    @property
    def writes_scales(self) -> bool:
        """Whether a call writes the pool's per-(token, head) scales: asked for, or an int8 pool (it has no other)."""
        return self.written_scales or self.pool == "int8"


MAIN = Case("L5 H8 D128", 5, 8, 128, 128)
POOL = Case("L5 H8 D128 pool", 5, 8, 128, 128, pool="bf16")
# DeepSeek-V3's MLA geometry (kv_lora_rank 512, qk_rope_head_dim 64), GPT-J RoPE as vLLM and sglang run it.
MLA_MAIN = Case("MLA L5 C512 R64", 5, 1, 0, 64, rope_style="gptj", kv_lora_rank=512)
MLA_POOL = Case("MLA L5 C512 R64 B64", 5, 1, 0, 64, rope_style="gptj", pool="bf16", page_size=64, kv_lora_rank=512)
GPU_CASES = (
    MAIN,
    Case("L1 H8 D128", 1, 8, 128, 128),
    Case("L3 H4 D128", 3, 4, 128, 128),
    Case("L2 H8 D256 R64", 2, 8, 256, 64),
    Case("L5 H8 D128 fp16", 5, 8, 128, 128, torch.float16),
    Case("L5 H8 D128 gptj", 5, 8, 128, 128, rope_style="gptj"),
    POOL,
    Case("L5 H8 D128 pool fp8", 5, 8, 128, 128, pool="fp8"),
    Case("L5 H8 D128 rope-only", 5, 8, 128, 128, norm=False),
    Case("L5 H8 D128 NHD B16", 5, 8, 128, 128, pool="bf16", page_size=16),
    Case("L5 H8 D128 NHD B64", 5, 8, 128, 128, pool="bf16", page_size=64),
    Case("L5 H8 D128 HND B16", 5, 8, 128, 128, pool="bf16", page_size=16, kv_layout="HND"),
    Case("L5 H8 D128 HND B64", 5, 8, 128, 128, pool="bf16", page_size=64, kv_layout="HND"),
    Case("L5 H8 D128 NHD B16 fp8", 5, 8, 128, 128, pool="fp8", page_size=16),
    MLA_MAIN,
    Case("MLA L5 C512 R64 no-norm", 5, 1, 0, 64, rope_style="gptj", norm=False, kv_lora_rank=512),
    Case("MLA L5 C512 R64 pool", 5, 1, 0, 64, rope_style="gptj", pool="bf16", kv_lora_rank=512),
    MLA_POOL,
    Case("MLA L5 C512 R64 B64 fp8", 5, 1, 0, 64, rope_style="gptj", pool="fp8", page_size=64, kv_lora_rank=512),
    # The features drafts ship with, one a case: the main shape, or MLA's pages of 64, with that feature.
    Case("L5 H8 D128 v-norm", 5, 8, 128, 128, v_norm=True),
    Case("L5 H8 D128 layer-tables", 5, 8, 128, 128, layer_tables=True),
    Case("L5 H8 D128 pool fp8 scales-out", 5, 8, 128, 128, pool="fp8", written_scales=True),
    Case("L5 H8 D128 pool int8 scales-out", 5, 8, 128, 128, pool="int8", written_scales=True),
    replace(MLA_POOL, name="MLA L5 C512 R64 B64 fp8_ds_mla", pool="fp8_ds_mla"),
)
GPU_TOKENS = (16, 256, 2048, 16384, 65536)
CPU_CASES = (
    Case("L2 H2 D64", 2, 2, 64, 64, torch.float32),
    Case("L2 H2 D64 pool", 2, 2, 64, 64, torch.float32, pool="bf16"),
)
CPU_TOKENS = (16, 256, 1024)


@dataclass
class Row:
    """One measured (case, T): microseconds and GB/s per implementation."""

    case: str
    tokens: int
    megabytes: float
    us: dict[str, float] = field(default_factory=dict)
    gbps: dict[str, float] = field(default_factory=dict)
    pct_of_copy: dict[str, float] = field(default_factory=dict)


@dataclass
class Inputs:
    kv: torch.Tensor
    weight: torch.Tensor
    eps: torch.Tensor
    cos_sin: torch.Tensor
    positions: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor
    slots: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    v_weight: torch.Tensor | None = None  # v_norm_weight
    k_scale_out: torch.Tensor | None = None  # the pool's per-(token, head) scales, written by the call
    v_scale_out: torch.Tensor | None = None

    @property
    def norm_weight(self) -> torch.Tensor | None:
        return self.weight if self.weight.numel() else None


def make_inputs(case: Case, num_tokens: int, device: torch.device, num_slots: int = 0) -> Inputs:
    """Fresh random inputs for one call (never zeros: they hide unwritten outputs)."""
    if case.kv_lora_rank:
        return _mla_inputs(case, num_tokens, device, num_slots)
    L, H, D, R = case.num_layers, case.num_kv_heads, case.head_dim, case.rotary_dim
    positions_max = 32768 if case.layer_tables else 131072
    kv = torch.randn(num_tokens, L, 2 * H * D, device=device, dtype=case.dtype)
    weight = torch.rand(L, D, device=device) + 0.5 if case.norm else torch.empty(0, device=device)
    v_weight = torch.rand(L, D, device=device) + 0.5 if case.v_norm else None
    eps = torch.full((L,), 1e-6, device=device)
    angles = torch.rand(*((L,) if case.layer_tables else ()), positions_max, R // 2, device=device) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, positions_max, (num_tokens,), device=device)
    k_out = torch.empty(L, num_tokens, H, D, device=device, dtype=case.dtype)
    v_out = torch.empty_like(k_out)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    k_pool = v_pool = torch.empty(0, device=device)
    k_scale_out = v_scale_out = None
    if case.pool:
        num_slots, pages, pool_dtype = _pool_shape(case, num_tokens, num_slots)
        if pages:
            page = (case.page_size, H) if case.kv_layout == "NHD" else (H, case.page_size)
            cache = torch.empty(L, pages, 2, *page, D, device=device, dtype=pool_dtype)
            k_pool, v_pool = cache[:, :, 0], cache[:, :, 1]
        else:
            k_pool = torch.empty(L, num_slots, H, D, device=device, dtype=pool_dtype)
            v_pool = torch.empty_like(k_pool)
        slots = torch.randperm(num_slots, device=device)[:num_tokens]
        if case.writes_scales:
            # The pool's shape less its last dim, as an engine's separate scale tensor.
            k_scale_out = torch.empty(k_pool.shape[:-1], device=device)
            v_scale_out = torch.empty_like(k_scale_out)
    return Inputs(
        kv, weight, eps, cos_sin, positions, k_out, v_out, slots, k_pool, v_pool, v_weight, k_scale_out, v_scale_out
    )


def _mla_inputs(case: Case, num_tokens: int, device: torch.device, num_slots: int) -> Inputs:
    """An MLA case's inputs: ``kv`` is ckv ``[T, L, C+R]``, ``k_out`` the output, ``k_pool`` the MLA pool."""
    L, C, R = case.num_layers, case.kv_lora_rank, case.rotary_dim
    positions_max = 131072
    ckv = torch.randn(num_tokens, L, C + R, device=device, dtype=case.dtype)
    weight = torch.rand(L, C, device=device) + 0.5 if case.norm else torch.empty(0, device=device)
    angles = torch.rand(positions_max, R // 2, device=device) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(0, positions_max, (num_tokens,), device=device)
    out = torch.empty(L, num_tokens, C + R, device=device, dtype=case.dtype)
    unused = torch.empty(0, device=device)
    slots = torch.empty(0, dtype=torch.int64, device=device)
    pool = unused
    if case.pool:
        num_slots, pages, pool_dtype = _pool_shape(case, num_tokens, num_slots)
        width = FP8_DS_MLA_BYTES if case.pool == "fp8_ds_mla" else C + R
        if pages:
            pool = torch.empty(L, pages, case.page_size, width, device=device, dtype=pool_dtype)
        else:
            pool = torch.empty(L, num_slots, width, device=device, dtype=pool_dtype)
        slots = torch.randperm(num_slots, device=device)[:num_tokens]
    eps = torch.full((L,), 1e-6, device=device)
    return Inputs(ckv, weight, eps, cos_sin, positions, out, unused, slots, pool, unused)


def _pool_shape(case: Case, num_tokens: int, num_slots: int) -> tuple[int, int, torch.dtype]:
    """``(slots, pages, dtype)`` of a pool case's pool: ``num_slots`` (0: twice the tokens), rounded up to whole
    pages where the case has pages (else 0 pages)."""
    num_slots = num_slots or 2 * num_tokens
    pages = -(-num_slots // case.page_size) if case.page_size else 0
    dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "fp8_ds_mla": torch.uint8}.get(case.pool, case.dtype)
    return (pages * case.page_size if pages else num_slots), pages, dtype


def bytes_moved(case: Case, num_tokens: int) -> int:
    """kv read once plus K and V (or the pool rows) written once, with the scales a call writes.

    A ``fp8_ds_mla`` row counts its 656 bytes written; a written scale counts its 4 bytes.
    """
    written = 1 if case.pool in ("fp8", "int8") else case.dtype.itemsize
    if case.kv_lora_rank:
        rows = num_tokens * case.num_layers
        elems = rows * (case.kv_lora_rank + case.rotary_dim)
        if case.pool == "fp8_ds_mla":
            return elems * case.dtype.itemsize + rows * FP8_DS_MLA_BYTES
        return elems * case.dtype.itemsize + elems * written
    elems = num_tokens * case.num_layers * 2 * case.num_kv_heads * case.head_dim
    scales = num_tokens * case.num_layers * 2 * case.num_kv_heads * 4 if case.writes_scales else 0
    return elems * case.dtype.itemsize + elems * written + scales


def typedkv_call(case: Case, x: Inputs) -> Callable[[], None]:
    style: Any = case.rope_style
    if case.kv_lora_rank:
        return _mla_call(case, x)
    H = case.num_kv_heads
    if case.pool:
        scale = 0.5 if case.pool == "fp8" and x.k_scale_out is None else None
        layout: Any = case.kv_layout
        return lambda: materialize_kv_into_pool(
            x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, x.v_pool,
            num_kv_heads=H, rope_style=style, v_norm_weight=x.v_weight, k_scale=scale, v_scale=scale,
            k_scale_out=x.k_scale_out, v_scale_out=x.v_scale_out, kv_layout=layout,
        )  # fmt: skip
    return lambda: _discard(
        materialize_kv(
            x.kv,
            x.norm_weight,
            x.eps,
            x.cos_sin,
            x.positions,
            num_kv_heads=H,
            rope_style=style,
            v_norm_weight=x.v_weight,
            k_out=x.k_out,
            v_out=x.v_out,
        )
    )


def _mla_call(case: Case, x: Inputs) -> Callable[[], None]:
    style: Any = case.rope_style
    if case.pool:
        scale = 0.5 if case.pool == "fp8" else None
        cache_format: Any = "fp8_ds_mla" if case.pool == "fp8_ds_mla" else "plain"
        return lambda: materialize_mla_kv_into_pool(
            x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, x.slots, x.k_pool, rope_style=style, kv_scale=scale,
            cache_format=cache_format,
        )  # fmt: skip
    return lambda: _discard(
        materialize_mla_kv(x.kv, x.norm_weight, x.eps, x.cos_sin, x.positions, rope_style=style, out=x.k_out)
    )


def eager_call(case: Case, x: Inputs, compiled: bool = False) -> Callable[[], None]:
    """The plain PyTorch path a model would run (the reference), optionally compiled."""
    neox = case.rope_style == "neox"
    if case.kv_lora_rank:
        return _mla_eager_call(case, x, compiled)

    def run(
        kv: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = kv_reference.rmsnorm_rope(kv, (w, eps, cs, pos), case.num_kv_heads, neox)
        return k.to(kv.dtype), v

    fn = torch.compile(run, fullgraph=True) if compiled else run
    if case.pool:

        def pool_path() -> None:
            k, v = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
            for layer in range(case.num_layers):
                x.k_pool[layer].index_copy_(0, x.slots, k[layer].to(x.k_pool.dtype))
                x.v_pool[layer].index_copy_(0, x.slots, v[layer].to(x.v_pool.dtype))

        return pool_path

    def dense() -> None:
        k, v = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
        x.k_out.copy_(k)
        x.v_out.copy_(v)

    return dense


def _mla_eager_call(case: Case, x: Inputs, compiled: bool) -> Callable[[], None]:
    """MLA's plain PyTorch path: the reference rows in ckv's dtype, then a copy or one indexed copy per layer."""
    neox = case.rope_style == "neox"

    def run(ckv: torch.Tensor, w: torch.Tensor, eps: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return mla_reference.mla_rows(ckv, (w if w.numel() else None, eps, cs, pos), neox).to(ckv.dtype)

    fn = torch.compile(run, fullgraph=True) if compiled else run
    if case.pool:
        rows = x.k_pool.view(case.num_layers, -1, x.k_pool.shape[-1])  # pages flattened: slot s is row s

        def pool_path() -> None:
            out = fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)
            for layer in range(case.num_layers):
                rows[layer].index_copy_(0, x.slots, out[layer].to(rows.dtype))

        return pool_path
    return lambda: _discard(x.k_out.copy_(fn(x.kv, x.weight, x.eps, x.cos_sin, x.positions)))


def staging_call(case: Case, x: Inputs) -> Callable[[], None]:
    """materialize_kv into a staging buffer, then one indexed copy per layer (the path of sglang's fused_kv_materialize helper)."""

    def run() -> None:
        k, v = materialize_kv(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=case.num_kv_heads, k_out=x.k_out, v_out=x.v_out
        )
        for layer in range(case.num_layers):
            x.k_pool[layer].index_copy_(0, x.slots, k[layer])
            x.v_pool[layer].index_copy_(0, x.slots, v[layer])

    return run
