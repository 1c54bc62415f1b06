"""Tensor parallelism, one process per rank: ``torchrun --nproc-per-node 2 tests/tp_worker.py``.

An engine that shards a draft model's KV heads across ranks gives each rank the
weight rows of its heads -- the K rows *and* the V rows of heads
``[rank*H/world, (rank+1)*H/world)`` of every layer -- and each rank calls typedkv
with ``num_kv_heads=H/world`` into its own pool shard ``[L, S, H/world, D]``. Here
every rank builds the full model from one seed, takes its shard, writes its pool
shard with `typedkv.KVMaterializer.into_pool`, and checks, bit for bit:

- its pool shard is the full-head pool's heads of this rank, where the full-head
  pool is what one process writes with the full-head ``KVMaterializer`` (every
  rank computes it);
- the pool gathered from all ranks (``all_gather``, concatenated on the head dim)
  is that full-head pool;
- the pool rows ``cache_loc`` does not name (negative slots, other slots) keep
  their random fill, in the shard and in the full-head pool, and every named row
  was written.

The GEMM is the one step whose bits could depend on the shard: a rank multiplies by
``2*H/world*D`` rows per layer, not ``2*H*D``, and a GEMM library may pick another
kernel or split for another matrix shape. Each case therefore also compares the
shard's GEMM rows with the full GEMM's rows of the same heads (they must agree too:
a skipped token's rows never reach a pool). Where the pools differ, the report says
whose the difference is: the shard's weight rows (a sharding bug), the GEMM (then
`typedkv.materialize_kv_into_pool` on the full GEMM's rows of the shard must give
the full-head pool's heads), or the op -- with the number of differing elements and
the largest difference. Nothing is compared to a tolerance.

Every case runs once per path named by ``--paths``: a projection path (``KVMaterializer.projection_path``:
``auto``, ``fused``, ``gemm``), the full-head and the shard materializer on the same path; or ``op``:
`typedkv.materialize_kv_into_pool` itself, on the full model's ``kv`` rows and on the rank's heads of
them. The cases cover stacked, per-layer and paged pools, FP8 pools with given scales and with scales
the call writes (``k_scale_out``/``v_scale_out``, one per token, layer and head: sharded and gathered
like the pools), a V norm and a RoPE table per layer. The path ``mla`` runs `MLA_CASES`: MLA caches
are not sharded by heads (the latent is every head's), so every rank writes the whole cache, with
`typedkv.materialize_mla_kv_into_pool` and `typedkv.MLAKVMaterializer`, and the caches gathered from
all ranks must each be the one this process writes, bit for bit.
``--ws-everywhere`` widens the measured table of the warp-specialised kernel
(`typedkv.projection.warp_specialized`) to every T, so that the fused path (``auto`` or pinned) takes it wherever it can run
(head_dim 128, NeoX over the whole head, no FP8 pool, sm_90 under Triton 3.6), and
counts its launches: rank 0 prints them, and the test asserts there were some.

Prints one line per case, path and rank; exits non-zero on any mismatch (every rank,
after the last case, so that no rank is left waiting in a collective).
Debug checking is on (`typedkv.set_debug`), as in the test suite. Under
``TRITON_INTERPRET=1`` CPU tensors run the Triton kernel in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from ws_launches import counted_launches, taken_everywhere

import typedkv
from typedkv.projection.dispatch import ProjectionPath

# A projection path of KVMaterializer, the op on the projection's rows, or the MLA cases.
Path = ProjectionPath | Literal["op", "mla"]


@dataclass(frozen=True)
class Shape:
    """The model and call sizes (every rank the same)."""

    num_layers: int
    num_kv_heads: int  # H of the full model; a rank holds H / world
    head_dim: int
    hidden_size: int
    num_tokens: int
    num_slots: int  # S, the pool's rows
    max_position: int  # P, the rows of cos_sin_cache


@dataclass(frozen=True)
class Case:
    """One configuration: kv dtype, RoPE, pool dtype and form."""

    dtype: torch.dtype
    rope_style: typedkv.RopeStyle
    partial_rotary: bool  # R = about D/2 (the rest of each head passes through), else R = D
    fp8_pool: bool  # float8_e4m3fn pools with per-layer k_scale / v_scale [L]
    per_layer: bool  # weights and pools as sequences of L per-layer tensors
    page_size: int = 0  # pages of this many slots ([L, N, B, H, D], NHD); 0: flat [L, S, H, D]
    scales_out: bool = False  # FP8 pools: per-(token, layer, head) scales written by the call, not given
    v_norm: bool = False  # a V RMSNorm (v_norm_weight [L, D])
    layer_tables: bool = False  # cos_sin_cache [L, P, R]: each layer its own RoPE base

    def name(self, shape: Shape) -> str:
        pool = f"{_dt(FP8 if self.fp8_pool else self.dtype)} pool"
        form = "per-layer" if self.per_layer else "stacked"
        form += f" paged B={self.page_size}" if self.page_size else ""
        extras = [
            name
            for name, on in (("scales written", self.scales_out), ("V norm", self.v_norm), ("tables per layer", self.layer_tables))
            if on
        ]  # fmt: skip
        return f"{_dt(self.dtype)} {self.rope_style} R={rotary_dim(self, shape)} {form} {pool}" + "".join(
            f", {extra}" for extra in extras
        )


CASES = (
    Case(torch.bfloat16, "neox", partial_rotary=False, fp8_pool=False, per_layer=False),
    Case(torch.bfloat16, "gptj", partial_rotary=True, fp8_pool=False, per_layer=False),
    Case(torch.bfloat16, "neox", partial_rotary=True, fp8_pool=True, per_layer=False),
    Case(torch.bfloat16, "gptj", partial_rotary=False, fp8_pool=False, per_layer=True),
    Case(torch.float16, "neox", partial_rotary=True, fp8_pool=True, per_layer=True),
    Case(torch.bfloat16, "neox", partial_rotary=False, fp8_pool=False, per_layer=False, page_size=4, v_norm=True),
    Case(torch.bfloat16, "gptj", partial_rotary=True, fp8_pool=False, per_layer=True, page_size=8, layer_tables=True),
    Case(torch.bfloat16, "neox", partial_rotary=False, fp8_pool=True, per_layer=False, scales_out=True, v_norm=True),
    Case(
        torch.float16,
        "neox",
        partial_rotary=True,
        fp8_pool=True,
        per_layer=True,
        page_size=4,
        scales_out=True,
        v_norm=True,
        layer_tables=True,
    ),
)
FP8 = torch.float8_e4m3fn


def rotary_dim(case: Case, shape: Shape) -> int:
    # Even, as RoPE pairs dims; at most D.
    return (shape.head_dim // 4) * 2 if case.partial_rotary else shape.head_dim


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- the model and one call


@dataclass(frozen=True)
class Model:
    """The full model's K/V path (all heads), on the rank's device."""

    kv_weight: Tensor  # [L, 2*H*D, hidden]: nn.Linear rows, K block then V block, head-major
    k_norm_weight: Tensor  # [L, D]
    eps: Tensor  # [L]
    cos_sin_cache: Tensor  # [P, R], or [L, P, R] (a table per layer)
    k_scale: Tensor | None  # [L], FP8 pools with given scales only
    v_scale: Tensor | None
    v_norm_weight: Tensor | None  # [L, D]
    kv: Tensor  # [T, L, 2*H*D]: the rows the op path writes (the K/V projection's output)


@dataclass(frozen=True)
class Call:
    """One ``into_pool`` call's inputs and the full-head pools' fill before it."""

    hidden: Tensor  # [T, hidden]
    positions: Tensor  # [T]
    cache_loc: Tensor  # [T], shuffled slots, some negative (skipped)
    k_fill: Tensor  # [L, S, H, D], random bits (the pool dtype)
    v_fill: Tensor
    k_scale_fill: Tensor  # [L, S, H] float32, random: the written scales' fill
    v_scale_fill: Tensor


def make_model(case: Case, shape: Shape, seed: int, device: torch.device) -> Model:
    """Random weights (never zeros) from ``seed``: drawn on the CPU, so every rank and device gets the same bits."""
    g = torch.Generator().manual_seed(seed)
    num_layers, width = shape.num_layers, 2 * shape.num_kv_heads * shape.head_dim
    rotary = rotary_dim(case, shape)
    kv_weight = torch.randn(num_layers, width, shape.hidden_size, generator=g) / shape.hidden_size**0.5
    # A table per layer: each layer its own RoPE base, as drafts with local and global layers have.
    tables = [
        rope_table(shape.max_position, rotary, base) for base in (10000.0 * 4**layer for layer in range(num_layers))
    ]
    k_norm_weight = torch.rand(num_layers, shape.head_dim, generator=g) + 0.5
    v_norm_weight = torch.rand(num_layers, shape.head_dim, generator=g) + 0.5
    k_scale, v_scale = (torch.rand(num_layers, generator=g) * 0.05 + 0.01 for _ in range(2))
    given = case.fp8_pool and not case.scales_out
    kv = torch.randn(shape.num_tokens, num_layers, width, generator=g)
    return Model(
        kv_weight.to(case.dtype).to(device),
        k_norm_weight.to(device),
        torch.logspace(-6, -3, num_layers).to(device),
        (torch.stack(tables) if case.layer_tables else tables[0]).to(device),
        k_scale.to(device) if given else None,
        v_scale.to(device) if given else None,
        v_norm_weight.to(device) if case.v_norm else None,
        kv.to(case.dtype).to(device),
    )


def rope_table(max_position: int, rotary: int, base: float) -> Tensor:
    """``[P, R]`` float32: cos then sin of each position's angles, computed in float64."""
    inv_freq = base ** -(torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def make_call(case: Case, shape: Shape, seed: int, device: torch.device) -> Call:
    g = torch.Generator().manual_seed(seed)
    num_tokens = shape.num_tokens
    hidden = torch.randn(num_tokens, shape.hidden_size, generator=g).to(case.dtype)
    positions = torch.randint(0, shape.max_position, (num_tokens,), generator=g)
    cache_loc = torch.randperm(shape.num_slots, generator=g)[:num_tokens]
    # About one token in four skipped; at least one.
    skipped = torch.rand(num_tokens, generator=g) < 0.25
    skipped[torch.randint(0, num_tokens, (1,), generator=g)] = True
    cache_loc[skipped] = -1
    pool_shape = (shape.num_layers, shape.num_slots, shape.num_kv_heads, shape.head_dim)

    def fill() -> Tensor:
        if case.fp8_pool:
            return torch.randint(0, 256, pool_shape, dtype=torch.uint8, generator=g).view(FP8)
        return torch.randn(pool_shape, generator=g).to(case.dtype)

    scales = [torch.rand(pool_shape[:3], generator=g) for _ in range(2)]
    return Call(*(t.to(device) for t in (hidden, positions, cache_loc, fill(), fill(), *scales)))


# --------------------------------------------------------------------------- sharding


def head_range(rank: int, world_size: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads ``[first, end)`` this rank holds."""
    per_rank = num_kv_heads // world_size
    return rank * per_rank, (rank + 1) * per_rank


def shard_kv_weight(kv_weight: Tensor, heads: tuple[int, int], num_kv_heads: int, head_dim: int) -> Tensor:
    """``[L, 2*h*D, hidden]``: the K rows, then the V rows, of heads ``[first, end)`` (h of them) of every layer.

    K rows of head ``i`` are ``i*D .. (i+1)*D``; its V rows are ``H*D + i*D .. H*D + (i+1)*D``.
    """
    first, end = heads
    k_rows = kv_weight[:, first * head_dim : end * head_dim]
    v_rows = kv_weight[:, (num_kv_heads + first) * head_dim : (num_kv_heads + end) * head_dim]
    return torch.cat((k_rows, v_rows), dim=1)


def as_pool(stacked: Tensor, case: Case) -> Tensor | list[Tensor]:
    """A stacked ``[L, S, ...]`` pool (or scale tensor) in the case's form: flat or in pages of
    ``case.page_size`` slots (``[L, N, B, ...]``), stacked or as L per-layer tensors (each its own
    allocation, as an engine's may be)."""
    if case.page_size:
        stacked = stacked.unflatten(1, (-1, case.page_size))
    return [layer.clone() for layer in stacked] if case.per_layer else stacked


def stacked(pool: Tensor | Sequence[Tensor], case: Case) -> Tensor:
    """`as_pool`'s pool back as one ``[L, S, ...]`` tensor."""
    whole = pool if isinstance(pool, Tensor) else torch.stack(list(pool))
    return whole.flatten(1, 2) if case.page_size else whole


# --------------------------------------------------------------------------- checks


def bits(t: Tensor) -> Tensor:
    """The bytes of ``t`` (its last dim times its item size): what bit-for-bit equality and the gather use."""
    return t.contiguous().view(torch.uint8)


def difference(got: Tensor, want: Tensor) -> str:
    """How many elements' bits differ, and the largest ``|got - want|`` among them (a random FP8 fill may hold NaN)."""
    differ = (bits(got) != bits(want)).unflatten(-1, (got.shape[-1], got.element_size())).any(-1)
    diff = (got.float()[differ] - want.float()[differ]).abs()
    finite = diff.isfinite()
    largest = diff[finite].max().item() if finite.any() else float("nan")
    text = f"{int(differ.sum())} of {differ.numel()} elements differ, max abs diff {largest:.6g}"
    return text if finite.all() else f"{text} ({int((~finite).sum())} of them NaN or inf)"


def gather_heads(shard: Tensor, world_size: int) -> Tensor:
    """Every rank's ``[L, S, h, D]`` pool shard, concatenated on the head dim: ``[L, S, H, D]``.

    Gathered as bytes: every backend moves uint8 (gloo has no float8), and bytes are what is compared.
    """
    shard_bits = bits(shard)
    parts = [torch.empty_like(shard_bits) for _ in range(world_size)]
    dist.all_gather(parts, shard_bits)
    return torch.cat(parts, dim=2).view(shard.dtype)


def row_problems(name: str, pool: Tensor, fill: Tensor, cache_loc: Tensor) -> list[str]:
    """The rows ``cache_loc`` skips must hold their fill; every row it names must have been written."""
    named = torch.zeros(pool.shape[1], dtype=torch.bool, device=pool.device)
    named[cache_loc[cache_loc >= 0]] = True
    row_bits, fill_bits = bits(pool).flatten(2), bits(fill).flatten(2)
    problems = []
    if not torch.equal(row_bits[:, ~named], fill_bits[:, ~named]):
        problems.append(f"{name}: rows cache_loc does not name were changed")
    if (row_bits[:, named] == fill_bits[:, named]).all(-1).any():
        problems.append(f"{name}: a row cache_loc names still holds its fill (not written)")
    return problems


def compare(name: str, got: Tensor, want: Tensor) -> list[str]:
    """Nothing when ``got`` and ``want`` are equal bit for bit; else what differs."""
    return [] if torch.equal(bits(got), bits(want)) else [f"{name}: {difference(got, want)}"]


class Written(NamedTuple):
    """What one write left: its K and V pools and, with written scales, K's and V's scales (stacked, flat)."""

    k: Tensor
    v: Tensor
    k_scales: Tensor | None
    v_scales: Tensor | None


def write(
    case: Case, model: Model, call: Call, path: Path, heads: tuple[int, int], kv_weight: Tensor, num_kv_heads: int
) -> Written:
    """Heads ``[first, end)`` of the call written on ``path`` (a materializer built from ``kv_weight``, or the op
    on those heads' rows of ``model.kv``) into pools filled from the call's fills; what they hold after."""
    first, end = heads
    k_pool = as_pool(call.k_fill[:, :, first:end].clone(), case)
    v_pool = as_pool(call.v_fill[:, :, first:end].clone(), case)
    # Pages of B slots read as NHD or HND when B equals the heads: the layout is named.
    pool_options: dict[str, Any] = {"kv_layout": "NHD" if case.page_size else None}
    k_scales = v_scales = None
    if case.scales_out:
        k_scales = as_pool(call.k_scale_fill[:, :, first:end].clone(), case)
        v_scales = as_pool(call.v_scale_fill[:, :, first:end].clone(), case)
        pool_options.update(k_scale_out=k_scales, v_scale_out=v_scales)
    else:
        pool_options.update(k_scale=model.k_scale, v_scale=model.v_scale)
    if path == "op":
        typedkv.materialize_kv_into_pool(
            shard_rows(model.kv, heads, model.k_norm_weight.shape[-1]), model.k_norm_weight, model.eps,
            model.cos_sin_cache, call.positions, call.cache_loc, k_pool, v_pool, num_kv_heads=end - first,
            rope_style=case.rope_style, v_norm_weight=model.v_norm_weight, **pool_options,
        )  # fmt: skip
    else:
        materializer = typedkv.KVMaterializer(
            list(kv_weight) if case.per_layer else kv_weight, model.k_norm_weight, model.eps, model.cos_sin_cache,
            num_kv_heads=num_kv_heads, rope_style=case.rope_style, v_norm_weight=model.v_norm_weight,
        )  # fmt: skip
        materializer.projection_path = cast("ProjectionPath", path)
        materializer.into_pool(call.hidden, call.positions, call.cache_loc, k_pool, v_pool, **pool_options)
    return Written(
        stacked(k_pool, case),
        stacked(v_pool, case),
        None if k_scales is None else stacked(k_scales, case),
        None if v_scales is None else stacked(v_scales, case),
    )


def shard_rows(kv: Tensor, heads: tuple[int, int], head_dim: int) -> Tensor:
    """``[T, L, 2*h*D]``: the K rows, then the V rows, of heads ``[first, end)`` of every token and layer of ``kv``
    (``[T, L, 2*H*D]``): the op's input on a rank holding those heads."""
    first, end = heads
    rows: Tensor = kv.unflatten(-1, (2, -1, head_dim))[:, :, :, first:end]
    return rows.flatten(2)


def run_case(case: Case, shape: Shape, seed: int, device: torch.device, path: Path) -> list[str]:
    """Write this rank's pool shard and the full-head pool on ``path``; the problems found (none: bit for bit)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(case, shape, seed, device)
    call = make_call(case, shape, seed + 1, device)
    num_kv_heads, head_dim = shape.num_kv_heads, shape.head_dim

    # One process, all heads; then this rank: its heads' weight rows, its pool shard.
    full = write(case, model, call, path, (0, num_kv_heads), model.kv_weight, num_kv_heads)
    heads = head_range(rank, world_size, num_kv_heads)
    first, end = heads
    shard_weight = shard_kv_weight(model.kv_weight, heads, num_kv_heads, head_dim)
    shard = write(case, model, call, path, heads, shard_weight, num_kv_heads // world_size)

    want_heads = (full.k[:, :, first:end], full.v[:, :, first:end])
    problems = [
        *compare("shard K vs full-head K", shard.k, want_heads[0]),
        *compare("shard V vs full-head V", shard.v, want_heads[1]),
        *compare("gathered K vs full-head K", gather_heads(shard.k, world_size), full.k),
        *compare("gathered V vs full-head V", gather_heads(shard.v, world_size), full.v),
        *row_problems("shard K pool", shard.k, call.k_fill[:, :, first:end], call.cache_loc),
        *row_problems("shard V pool", shard.v, call.v_fill[:, :, first:end], call.cache_loc),
        *row_problems("full-head K pool", full.k, call.k_fill, call.cache_loc),
        *row_problems("full-head V pool", full.v, call.v_fill, call.cache_loc),
    ]
    for name, got, want, fill in (
        ("K scales", shard.k_scales, full.k_scales, call.k_scale_fill),
        ("V scales", shard.v_scales, full.v_scales, call.v_scale_fill),
    ):
        if got is not None and want is not None:
            problems += [
                *compare(f"shard {name} vs full-head {name}", got, want[:, :, first:end]),
                *compare(f"gathered {name} vs full-head {name}", gather_heads(got, world_size), want),
                *row_problems(f"shard {name}", got, fill[:, :, first:end], call.cache_loc),
            ]
    if path == "op":
        return problems
    return problems + diagnose(case, shape, model, call, shard_weight, heads, want_heads, bool(problems), path)


def diagnose(
    case: Case,
    shape: Shape,
    model: Model,
    call: Call,
    shard_weight: Tensor,
    heads: tuple[int, int],
    want_heads: tuple[Tensor, Tensor],
    pools_differ: bool,
    path: Path,
) -> list[str]:
    """Where a difference comes from -- the shard's weight rows, the GEMM, or the op; nothing when all agree.

    The GEMMs run as `typedkv.KVMaterializer` runs them: one ``torch.mm`` of all layers' rows.
    On the GEMM path the GEMM check runs even when the pools agree: a skipped token's rows
    never reach a pool. The other paths may not run ``torch.mm`` at all (the fused kernel
    computes the product itself), so there it only explains a difference.
    """
    if path != "gemm" and not pools_differ:
        return []
    first, end = heads
    num_tokens, num_layers, num_kv_heads = shape.num_tokens, shape.num_layers, shape.num_kv_heads
    head_dim, hidden_size = shape.head_dim, shape.hidden_size
    # The rows of this rank's heads, indexed another way than shard_kv_weight's: [L, K|V, H, D, hidden].
    want_weight = model.kv_weight.view(num_layers, 2, num_kv_heads, head_dim, hidden_size)[:, :, first:end]
    weight = compare(
        "shard's weight rows vs the full weight's rows of its heads", shard_weight, want_weight.flatten(1, 3)
    )
    if weight:
        return [f"a sharding bug, not numerics: {weight[0]}"]
    full_kv = torch.mm(call.hidden, model.kv_weight.reshape(-1, hidden_size).t())
    full_kv = full_kv.view(num_tokens, num_layers, 2, num_kv_heads, head_dim)[:, :, :, first:end]
    shard_kv = torch.mm(call.hidden, shard_weight.reshape(-1, hidden_size).t()).view_as(full_kv)
    gemm = compare("the shard's GEMM rows vs the full GEMM's rows of its heads", shard_kv, full_kv)
    if not gemm:
        # Both runs fed the op the same kv bits.
        return ["the GEMM rows agree bit for bit: the difference is the op's"] if pools_differ else []
    found = [f"the sharded GEMM is not row-for-row the full GEMM on this device (another kernel or split): {gemm[0]}"]
    if not pools_differ:
        return found
    # The op alone, on the full GEMM's rows of this rank's heads: it must give the full-head pool's heads.
    full_rows = torch.mm(call.hidden, model.kv_weight.reshape(-1, hidden_size).t()).view(num_tokens, num_layers, -1)
    op = write(case, dataclasses.replace(model, kv=full_rows), call, "op", heads, shard_weight, end - first)
    op_problems = [*compare("K", op.k, want_heads[0]), *compare("V", op.v, want_heads[1])]
    verdict = (
        "also differs: " + "; ".join(op_problems)
        if op_problems
        else "equal the full-head pool's heads: the GEMM alone differs"
    )
    return [*found, f"the op's pools on the full GEMM's rows of these heads {verdict}"]


# --------------------------------------------------------------------------- MLA: the whole cache on every rank


@dataclass(frozen=True)
class MLACase:
    """One MLA configuration: the writer, the pool's form and format, the RoPE table."""

    name: str
    materializer: bool  # MLAKVMaterializer.into_pool (else materialize_mla_kv_into_pool)
    page_size: int  # 0: flat [L, S, W]
    per_layer: bool
    cache_format: typedkv.CacheFormat  # "plain" (kv's dtype) or "fp8_ds_mla" (uint8 rows of 656 bytes)
    layer_tables: bool


MLA_CASES = (
    MLACase("op, stacked bf16 pool, a table per layer", False, 0, False, "plain", True),
    MLACase("materializer, paged per-layer bf16 pools", True, 4, True, "plain", False),
    MLACase("op, paged fp8_ds_mla pool, a table per layer", False, 4, False, "fp8_ds_mla", True),
    MLACase("materializer, per-layer fp8_ds_mla pools", True, 0, True, "fp8_ds_mla", False),
)
MLA_LATENT, MLA_ROPE, MLA_ROW_BYTES = 512, 64, 656


def run_mla_case(case: MLACase, shape: Shape, seed: int, device: torch.device) -> list[str]:
    """This rank's whole MLA cache; every rank's, gathered, must be this one's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    num_layers, num_tokens, hidden_size = shape.num_layers, shape.num_tokens, shape.hidden_size
    width = MLA_LATENT + MLA_ROPE
    tables = [rope_table(shape.max_position, MLA_ROPE, 10000.0 * 4**layer) for layer in range(num_layers)]
    cos_sin_cache = torch.stack(tables) if case.layer_tables else tables[0]
    norm_weight = torch.rand(num_layers, MLA_LATENT, generator=g) + 0.5
    kv_a_weight = (torch.randn(num_layers, width, hidden_size, generator=g) / hidden_size**0.5).to(torch.bfloat16)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(torch.bfloat16)
    ckv = torch.randn(num_tokens, num_layers, width, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, shape.max_position, (num_tokens,), generator=g)
    cache_loc = torch.randperm(shape.num_slots, generator=g)[:num_tokens]
    cache_loc[torch.rand(num_tokens, generator=g) < 0.25] = -1
    ds = case.cache_format == "fp8_ds_mla"
    fill = (
        torch.randint(0, 256, (num_layers, shape.num_slots, MLA_ROW_BYTES), dtype=torch.uint8, generator=g)
        if ds
        else torch.randn(num_layers, shape.num_slots, width, generator=g).to(torch.bfloat16)
    )
    cos_sin_cache, norm_weight, kv_a_weight, hidden, ckv, positions, cache_loc, fill = (
        t.to(device) for t in (cos_sin_cache, norm_weight, kv_a_weight, hidden, ckv, positions, cache_loc, fill)
    )
    stacked_pool = fill.clone()
    form = stacked_pool.unflatten(1, (-1, case.page_size)) if case.page_size else stacked_pool
    pool = [layer.clone() for layer in form] if case.per_layer else form
    eps = 1e-6
    if case.materializer:
        materializer = typedkv.MLAKVMaterializer(kv_a_weight, norm_weight, eps, cos_sin_cache, rope_style="gptj")
        materializer.into_pool(hidden, positions, cache_loc, pool, cache_format=case.cache_format)
    else:
        typedkv.materialize_mla_kv_into_pool(
            ckv, norm_weight, eps, cos_sin_cache, positions, cache_loc, pool, rope_style="gptj",
            cache_format=case.cache_format,
        )  # fmt: skip
    whole = torch.stack(list(pool)) if case.per_layer else form
    got = whole.flatten(1, 2) if case.page_size else whole
    row_bits = bits(got)
    parts = [torch.empty_like(row_bits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, row_bits)
    problems = [
        f"rank {rank}'s cache differs from this rank's"
        for rank, part in enumerate(parts)
        if not torch.equal(part, row_bits)
    ]
    return problems + row_problems("MLA pool", got, fill, cache_loc)


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout, and print writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Shape]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--kv-heads", type=int, default=4, help="H of the full model, a multiple of the world size")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=37)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-position", type=int, default=128)
    parser.add_argument("--paths", type=_paths, default=("auto",), help=f"paths, comma-separated ({', '.join(PATHS)})")
    parser.add_argument(
        "--ws-everywhere",
        action="store_true",
        help="the fused path takes the warp-specialised kernel at every T it can run",
    )
    args = parser.parse_args(argv)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.hidden, args.tokens, args.slots, args.max_position)
    return args, shape


PATHS: tuple[str, ...] = (*get_args(ProjectionPath), "op", "mla")


def _paths(text: str) -> tuple[Path, ...]:
    paths = tuple(text.split(","))
    if not paths or any(p not in PATHS for p in paths):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PATHS)}, got {text!r}")
    return cast("tuple[Path, ...]", paths)


def runs_of(paths: Sequence[str]) -> int:
    """How many case runs a rank makes on ``paths``."""
    return sum(len(MLA_CASES) if path == "mla" else len(CASES) for path in paths)


def main(argv: Sequence[str] | None = None) -> int:
    args, shape = parse_args(argv)
    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=args.backend, device_id=device if device.type == "cuda" else None)
    typedkv.set_debug(True)
    try:
        with contextlib.ExitStack() as stack:
            ws_launches: list[int] = []
            if args.ws_everywhere and device.type == "cuda":
                stack.enter_context(taken_everywhere(torch.cuda.get_device_name(device)))
                ws_launches = stack.enter_context(counted_launches())
            return run_cases(args, shape, device, ws_launches)
    finally:
        dist.destroy_process_group()


def run_cases(args: argparse.Namespace, shape: Shape, device: torch.device, ws_launches: list[int]) -> int:
    """Every case on every path, on this rank; 1 if any rank's case failed (every rank says the same)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if shape.num_kv_heads % world_size:
        raise SystemExit(f"--kv-heads {shape.num_kv_heads} is not a multiple of the world size {world_size}")
    failures = 0
    first, end = head_range(rank, world_size, shape.num_kv_heads)
    for path in args.paths:
        if path == "mla":
            for index, mla_case in enumerate(MLA_CASES):
                problems = run_mla_case(mla_case, shape, args.seed + 100 * index, device)
                verdict = "OK, bit for bit" if not problems else "MISMATCH: " + "; ".join(problems)
                say(f"rank {rank}/{world_size} whole MLA cache: {mla_case.name}, path mla: {verdict}")
                failures += bool(problems)
            continue
        for index, case in enumerate(CASES):
            problems = run_case(case, shape, args.seed + 100 * index, device, path)
            where = f"rank {rank}/{world_size} heads [{first}, {end}) of {shape.num_kv_heads}"
            verdict = "OK, bit for bit" if not problems else "MISMATCH: " + "; ".join(problems)
            say(f"{where}: {case.name(shape)}, path {path}: {verdict}")
            failures += bool(problems)
    # Every rank exits with the verdict of all ranks.
    total = torch.tensor([failures], device=device)
    dist.all_reduce(total)
    if rank == 0:
        if args.ws_everywhere:
            say(f"tp_worker: {len(ws_launches)} launches of the warp-specialised kernel on rank 0")
        say(f"tp_worker: {int(total.item())} of {runs_of(args.paths) * world_size} case runs failed")
    return 1 if total.item() else 0


if __name__ == "__main__":
    sys.exit(main())
