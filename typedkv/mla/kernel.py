"""The MLA materialization kernel: math only, no checking.

An MLA layer caches one row per token: the compressed latent (``C`` dims,
RMSNorm'ed with the layer's ``kv_a_layernorm``) followed by the rotary part
(``R`` dims, rotated by RoPE). One program handles ``BLOCK_T`` tokens of one
layer with the whole row in registers: it reads each token's row of ``ckv``
once, norms the latent (``NORM``; float32, rounded to the storage dtype as the
unfused path stores the norm's output) or passes it bit for bit, rotates the
rope part (rounded once, on the store), and writes the row to the token itself
(dense ``[L, T, C+R]``) or to its pool slot (``INDEXED``), paged or not, the
layer base by stride or from a table, as `typedkv.kv.kernel` addresses pools.

Every load and store is masked: a position outside ``[0, P)`` gives NaN in the
rope part (the latent does not depend on it), and a slot that is negative or
``>= S`` skips the token.
"""

from __future__ import annotations

# Parameters deliberately unannotated, as in `typedkv.kv.kernel`: Triton reads
# parameter annotations when it compiles.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from typedkv.core.epilogue import (
    _cast,
    _destination_rows,
    _layer_base,
    _layer_scale,
    _rope_row,
    _row_offset,
    _rstd,
    _store_scaled,
)


@triton.jit
def _rope_part(
    src, dst, tok, tok_ok, row_ok, rope, scale, QUANT, R: tl.constexpr, NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """The rope part of BLOCK_T rows: every one of its R dims rotates, NeoX or GPT-J pairs.

    ``rope`` and ``QUANT`` as in `typedkv.core.epilogue`.
    """
    HALF: tl.constexpr = R // 2
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < HALF
    pos_ok, cos, sin = _rope_row(rope, tok, tok_ok, pair, pair_ok, HALF)
    m1 = tok_ok[:, None] & pair_ok[None, :]
    if NEOX:
        x1 = tl.load(src[:, None] + pair[None, :], mask=m1, other=0.0).to(tl.float32)
        x2 = tl.load(src[:, None] + (pair + HALF)[None, :], mask=m1, other=0.0).to(tl.float32)
    else:
        # One contiguous load, viewed as [.., R/2, 2] pairs (dims 2j and 2j + 1).
        rot = tl.arange(0, 2 * BLOCK_HALF)
        x = tl.load(src[:, None] + rot[None, :], mask=tok_ok[:, None] & (rot < R)[None, :], other=0.0)
        x1, x2 = tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], BLOCK_HALF, 2)))
    # NaN for a token whose position is outside [0, P); -0.0 changes no bits.
    bad = tl.where(pos_ok, -0.0, float("nan"))[:, None]
    o1 = x1 * cos - x2 * sin + bad
    o2 = x2 * cos + x1 * sin + bad
    if NEOX:
        s1 = row_ok[:, None] & pair_ok[None, :]
        _store_scaled(dst[:, None] + pair[None, :], o1, s1, scale, QUANT)
        _store_scaled(dst[:, None] + (pair + HALF)[None, :], o2, s1, scale, QUANT)
    else:
        o = tl.reshape(tl.join(o1, o2), (o1.shape[0], 2 * BLOCK_HALF))
        _store_scaled(dst[:, None] + rot[None, :], o, row_ok[:, None] & (rot < R)[None, :], scale, QUANT)


@triton.jit
def _quotient(x, s):
    """``x / s`` rounded as IEEE division rounds it (`tl.div_rn`), by one reciprocal of each ``s`` and fused
    multiply-adds: a GPU's division of every element takes a special-function unit's reciprocal of each, at a
    quarter of the FMA rate.

    ``q = x * (1 / s)`` is within 1.5 ulps of ``x / s``; a correction ``q + (x - q*s) / s``, its residual exact
    by a fused multiply-add, brings it within 1 ulp, and a second rounds it correctly (Markstein's theorem; it
    holds where nothing underflows, and quotients that small are 0 in e4m3 either way). An infinite ``s`` (a tile
    holding an infinity) makes the residual NaN: a finite ``x`` then keeps ``x * 0 = 0``, ``x / inf``.
    """
    inv = tl.div_rn(1.0, s)
    q0 = x * inv
    r = tl.fma(-q0, s, x)
    q1 = tl.fma(r, inv, q0)
    q = tl.fma(tl.fma(-q1, s, x), inv, q1)
    return tl.where(r == r, q, q0)


@triton.jit
def _ds_mla_latent(dst, y, row_ok, QUANT, C: tl.constexpr):
    """The latent of DeepSeek's FP8 rows (float32 ``y``, ``[BLOCK_T, C]``), as vLLM's ``fp8_ds_mla`` cache holds it.

    Rounded to bfloat16, then each tile of 128 values divided by its own scale, ``max(amax / 448,
    2**-126)`` (NaN left out of the amax, as CUDA's fmaxf leaves it), and stored as e4m3 (QUANT,
    by a scale of 1.0: the division is IEEE ``x / scale``, vLLM's, not ``x * (1 / scale)``); the
    ``C // 128`` scales follow the ``C`` bytes as float32.
    """
    TILES: tl.constexpr = C // 128
    SOFT_ROUND: tl.constexpr = QUANT[4]
    y = _cast(y, tl.bfloat16, SOFT_ROUND).to(tl.float32)
    tiles = tl.reshape(y, (y.shape[0], TILES, 128))
    amax = tl.max(tl.where(tiles == tiles, tl.abs(tiles), 0.0), axis=2)
    tile_scale = tl.maximum(tl.div_rn(amax, 448.0), 1.1754943508222875e-38)
    tile = tl.arange(0, TILES)
    lane = tl.arange(0, 128)
    values = dst[:, None, None] + (tile[:, None] * 128 + lane[None, :])[None, :, :]
    if SOFT_ROUND:
        quotient = tl.div_rn(tiles, tile_scale[:, :, None])
    else:
        quotient = _quotient(tiles, tile_scale[:, :, None])
    _store_scaled(values, quotient, row_ok[:, None, None], 1.0, QUANT)
    scales = (dst + C).to(tl.pointer_type(tl.float32))
    tl.store(scales[:, None] + tile[None, :], tile_scale, mask=row_ok[:, None])


# As in `typedkv.kv.kernel`: ints that change with every batch are not specialised
# on (one compiled kernel serves every T); the layer stride arrives divided by
# LAYER_VEC so the compiler still sees 16-byte aligned rows.
@triton.jit(do_not_specialize=["dst_stride_l", "num_tokens", "num_rows"])
def materialize_mla_kv_kernel(
    ckv_ptr,
    ckv_stride_t,
    ckv_stride_l,
    weight_ptr,
    weight_stride_l,
    weight_stride_d,
    eps_ptr,
    eps_stride,
    eps,
    cos_sin_ptr,
    cos_sin_stride_l,  # a table per layer: its layer stride (None: one table for all layers)
    cos_sin_stride_p,
    cos_sin_stride_r,
    positions_ptr,
    positions_stride,
    slots_ptr,
    slots_stride,
    dst_ptr,
    dst_stride_l,
    dst_stride_page,
    dst_stride_slot,
    layer_offsets_ptr,
    kv_scale,  # the FP8 scale: (tensor or None, its stride, float), see _layer_scale
    num_tokens,
    num_positions,
    num_rows,
    C: tl.constexpr,
    R: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,  # RMSNorm the latent (else it passes bit for bit)
    EPS_PER_LAYER: tl.constexpr,
    INDEXED: tl.constexpr,
    PAGE: tl.constexpr,  # slots per page: row r is page r // PAGE, slot r % PAGE (1: a page per row)
    LAYER_TABLE: tl.constexpr,  # 0: layer l at l * dst_stride_l; else offsets from a table, multiples of this
    SCALE: tl.constexpr,  # 0: store as is, 1: divide by kv_scale's float, 2: by its tensor's entry for the layer
    DS_MLA: tl.constexpr,  # DeepSeek's FP8 rows (dst: their bytes): latent (e4m3) | C // 128 scales | bf16 rope part
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    LAYER_VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    NUM_LAYERS: tl.constexpr,
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent launch: wait for the prior kernel first
    WIDE: tl.constexpr,  # some index * stride of this layout passes int32 (`typedkv.core.launch_args.wide_offsets`)
):
    if WAIT_PRIOR:
        gdc_wait()  # before any load: what the kernel reads may be the prior kernel's output
    # One program per (token block, layer); a token's layers on neighbouring
    # programs, so ckv is read front to back.
    pid = tl.program_id(0)
    layer = pid % NUM_LAYERS
    tok = (pid // NUM_LAYERS) * BLOCK_T + tl.arange(0, BLOCK_T)
    if WIDE:
        # As in `typedkv.kv.kernel`: every index * stride below in int64.
        wide = tl.full([], 0, tl.int64)
        layer += wide
        tok += wide
        weight_stride_d += wide
        cos_sin_stride_r += wide
    if cos_sin_stride_l is not None:
        cos_sin_ptr += layer * cos_sin_stride_l  # the layer's own RoPE table
    tok_ok = tok < num_tokens
    # Row offsets in int64: T * stride overflows int32 for large batches.
    src = ckv_ptr + tok.to(tl.int64) * ckv_stride_t + layer * ckv_stride_l
    row, row_ok = _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED)
    if DS_MLA:
        # The rows' bytes, addressed as the latent's e4m3 values (its FP8 store), the rest by casts below.
        dst_ptr = dst_ptr.to(tl.pointer_type(tl.float8e4nv))
    base = _layer_base(dst_ptr, layer_offsets_ptr, layer, layer, dst_stride_l, LAYER_VEC, LAYER_TABLE)
    dst = base + _row_offset(row, PAGE, (dst_stride_page, dst_stride_slot))
    scale = _layer_scale(kv_scale, layer, SCALE)

    # The latent's loads are issued first, before the rope part's stores: the
    # compiler may not move loads across a store (dst may alias ckv as far as it
    # knows), and issued here their latency overlaps the rope part's two
    # dependent loads (position, then cos/sin); issued after those stores, the kernel
    # was slower (docs/decisions/010-mla-kernel-configuration.md).
    dim = tl.arange(0, BLOCK_C)
    dim_ok = dim < C
    x = tl.load(src[:, None] + dim[None, :], mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    if NORM:
        w = tl.load(weight_ptr + layer * weight_stride_l + dim * weight_stride_d, mask=dim_ok, other=0.0)

    QUANT: tl.constexpr = (SCALE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
    rope = (positions_ptr, positions_stride, num_positions, cos_sin_ptr, cos_sin_stride_p, cos_sin_stride_r)
    if DS_MLA:
        ROPE_QUANT: tl.constexpr = (0, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
        rope_dst = (dst + C + 4 * (C // 128)).to(tl.pointer_type(tl.bfloat16))
        _rope_part(src + C, rope_dst, tok, tok_ok, row_ok, rope, scale, ROPE_QUANT, R, NEOX, BLOCK_HALF)
    else:
        _rope_part(src + C, dst + C, tok, tok_ok, row_ok, rope, scale, QUANT, R, NEOX, BLOCK_HALF)

    out = dst[:, None] + dim[None, :]
    out_ok = row_ok[:, None] & dim_ok[None, :]
    if NORM:
        if EPS_PER_LAYER:
            eps = tl.load(eps_ptr + layer * eps_stride).to(tl.float32)
        xf = x.to(tl.float32)
        rstd = _rstd(tl.sum(xf * xf, axis=1), C, eps)
        y = xf * rstd[:, None] * w.to(tl.float32)[None, :]
        if DS_MLA:
            _ds_mla_latent(dst, y, row_ok, QUANT, C)
        else:
            if SCALE != 0:
                # Rounded to the storage dtype first, as the unfused path stores the norm's output.
                y = _cast(y, ckv_ptr.dtype.element_ty, SOFT_ROUND).to(tl.float32)
            _store_scaled(out, y, out_ok, scale, QUANT)
    elif DS_MLA:
        _ds_mla_latent(dst, x.to(tl.float32), row_ok, QUANT, C)
    elif SCALE == 0:
        tl.store(out, x, mask=out_ok)  # bit for bit
    else:
        _store_scaled(out, x.to(tl.float32), out_ok, scale, QUANT)
