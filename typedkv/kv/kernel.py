"""The fused KV materialization kernel: math only, no checking.

One program handles ``BLOCK_T`` tokens of one layer, all ``H`` heads at once:
it reads each token's K and V blocks from ``kv`` once, applies the layer's K
RMSNorm (``NORM``; float32, rounded to the storage dtype as the unfused path
does) and RoPE, and V's RMSNorm where there is one (``V_NORM``), and writes K and
V. A cos/sin cache with a table per layer is read at the layer's table
(``cos_sin_stride_l``). The destination row of a token is the token
itself (dense ``[L, T, H, D]`` outputs) or its pool slot (``INDEXED``); a paged
pool's row ``r`` is slot ``r % PAGE`` of page ``r // PAGE``, each with its own
stride (NHD and HND pages differ only in strides); the layer base is
``layer * stride`` (one stacked tensor) or an element offset read from a table
(``LAYER_TABLE``: an engine's list of per-layer pool tensors). K and V of a
token block are handled by one program, or by two (``SPLIT``, grid axis 2) when
there are few programs. K is either split into the rotary pairs and the
pass-through dims (`_k_part`) or, for NeoX RoPE over part of the head, kept as
one tile (`_k_row`, ``FULL_ROW``), each rotary dim's partner then gathered from
the normed row in registers (``FULL_ROW == 2``, the default) or loaded again.

Every load and store is masked, so the kernel never touches memory outside its
tensors whatever the values of ``positions`` or the slots are: a token whose
position is outside ``[0, P)`` gets NaN in K (V is still copied), and a token
whose slot is negative or ``>= S`` (``N*B``) is skipped.
"""

from __future__ import annotations

# The kernels' parameters are deliberately unannotated: Triton reads parameter
# annotations when it compiles (as type/specialisation hints; `tl.tensor[...]`
# fails to compile on Triton 3.6), so mypy skips this module's bodies
# (pyproject.toml: [[tool.mypy.overrides]] for typedkv.kv.kernel).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from typedkv.core.epilogue import (
    _abs_max,
    _cast,
    _destination_rows,
    _layer_base,
    _layer_scale,
    _nan_max,
    _norm_weight_row,
    _normed,
    _rope_row,
    _row_offset,
    _rstd,
    _scale_destinations,
    _store_scaled,
    _written_scale,
)


@triton.jit
def _k_part(
    block, norm, rope, scale, QUANT, SHAPE, BLOCKS, NEOX: tl.constexpr, NORM: tl.constexpr, CACHE: tl.constexpr
):
    """K of BLOCK_T tokens, all heads, one layer: RMSNorm (if NORM), RoPE, store.

    ``block`` is ``(k_head, head_ok, tok, tok_ok, layer, row_ok, k_dst)``: the block's K heads in kv
    (``[T, H]`` pointers, which exist), its tokens (which exist), its layer, and its destination rows
    (which to write, ``[T, H]`` pointers); run-time values only. ``norm`` is ``(weight_ptr,
    weight_stride_l, weight_stride_d, eps)``, ``SHAPE`` ``(H, D, R)``, ``BLOCKS`` ``(BLOCK_H,
    BLOCK_HALF, BLOCK_PASS)``; ``rope``, ``scale`` (the layer's, `_layer_scale`) and ``QUANT`` as in
    `typedkv.core.epilogue`; ``CACHE`` the cache modifier of kv's loads; with scales written per row
    (MODE 3 and 4), ``scale`` is where each row's goes (`_scale_destinations`). K is handled as the
    rotary pairs (x1[j], x2[j]), j < R/2, plus the pass-through dims [R, D); each piece is loaded
    once, contiguously, so no element is gathered twice. NeoX pairs dim j with j + R/2, GPT-J 2j with
    2j + 1. Without a norm K's values enter RoPE as they are (already in the storage dtype).
    """
    k_head, head_ok, tok, tok_ok, layer, row_ok, k_dst = block
    weight_ptr, weight_stride_l, weight_stride_d, eps = norm
    H: tl.constexpr = SHAPE[0]
    D: tl.constexpr = SHAPE[1]
    R: tl.constexpr = SHAPE[2]
    BLOCK_H: tl.constexpr = BLOCKS[0]
    BLOCK_HALF: tl.constexpr = BLOCKS[1]
    BLOCK_PASS: tl.constexpr = BLOCKS[2]
    MODE: tl.constexpr = QUANT[0]
    SOFT_ROUND: tl.constexpr = QUANT[4]
    store_ty: tl.constexpr = k_head.dtype.element_ty
    HALF: tl.constexpr = R // 2
    PASS: tl.constexpr = D - R
    head = tl.arange(0, BLOCK_H)
    if NORM:
        w_row = weight_ptr + layer * weight_stride_l
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < HALF
    # The RoPE row first; a token whose position is outside [0, P) gets NaN in K.
    pos_ok, cos, sin = _rope_row(rope, tok, tok_ok, pair, pair_ok, HALF)
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    m1 = head_ok[:, :, None] & pair_ok[None, None, :]
    if NEOX:
        x1 = tl.load(k_head[:, :, None] + pair[None, None, :], mask=m1, other=0.0, cache_modifier=CACHE).to(tl.float32)
        x2 = tl.load(k_head[:, :, None] + (pair + HALF)[None, None, :], mask=m1, other=0.0, cache_modifier=CACHE).to(
            tl.float32
        )
        if NORM:
            w1 = tl.load(w_row + pair * weight_stride_d, mask=pair_ok, other=0.0).to(tl.float32)
            w2 = tl.load(w_row + (pair + HALF) * weight_stride_d, mask=pair_ok, other=0.0).to(tl.float32)
    else:
        # The rotary dims in one contiguous (vectorised) load, then viewed as
        # [.., R/2, 2] pairs (dims 2j and 2j + 1 are pair j).
        rot = tl.arange(0, 2 * BLOCK_HALF)
        m2 = head_ok[:, :, None] & (rot < R)[None, None, :]
        x = tl.load(k_head[:, :, None] + rot[None, None, :], mask=m2, other=0.0, cache_modifier=CACHE).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_HALF, 2)))
        if NORM:
            w = tl.load(w_row + rot * weight_stride_d, mask=rot < R, other=0.0).to(tl.float32)
            w1, w2 = tl.split(tl.reshape(w, (BLOCK_HALF, 2)))
    if PASS > 0:
        rest = tl.arange(0, BLOCK_PASS)
        rest_ok = rest < PASS
        m3 = head_ok[:, :, None] & rest_ok[None, None, :]
        x3 = tl.load(k_head[:, :, None] + (R + rest)[None, None, :], mask=m3, other=0.0, cache_modifier=CACHE).to(
            tl.float32
        )

    if NORM:
        # RMSNorm in float32, then rounded to the storage dtype, as the unfused path.
        sum_sq = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
        if PASS > 0:
            w3 = tl.load(w_row + (R + rest) * weight_stride_d, mask=rest_ok, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x3 * x3, axis=2)
        rstd = _rstd(sum_sq, D, eps)[:, :, None]
        y1 = _normed(x1, rstd, w1, store_ty, SOFT_ROUND)
        y2 = _normed(x2, rstd, w2, store_ty, SOFT_ROUND)
    else:
        y1 = x1
        y2 = x2

    # Added to every K dim: NaN for a bad token, -0.0 (which changes no bits, -0.0 included) otherwise.
    bad = tl.where(pos_ok, -0.0, float("nan"))[:, None, None]
    o1 = y1 * cos - y2 * sin + bad
    o2 = y2 * cos + y1 * sin + bad

    out_ok = row_ok[:, None] & (head < H)[None, :]
    if MODE >= 3:
        # Scales written per row: K as stored in kv's dtype (what an unfused cache write quantizes), each
        # row's scale from its largest magnitude over the head's dims. The pass-through dims are
        # finished here, once, for both the row's amax and their store below.
        o1 = _cast(o1, store_ty, SOFT_ROUND).to(tl.float32)
        o2 = _cast(o2, store_ty, SOFT_ROUND).to(tl.float32)
        amax = _nan_max(_abs_max(o1, 2), _abs_max(o2, 2))
        if PASS > 0:
            if NORM:
                y3 = _normed(x3, rstd, w3, store_ty, SOFT_ROUND) + bad
            else:
                y3 = x3 + bad
            y3 = _cast(y3, store_ty, SOFT_ROUND).to(tl.float32)
            amax = _nan_max(amax, _abs_max(y3, 2))
        scale = _written_scale(amax, scale, out_ok, QUANT)[:, :, None]
    s1 = out_ok[:, :, None] & pair_ok[None, None, :]
    if NEOX:
        _store_scaled(k_dst[:, :, None] + pair[None, None, :], o1, s1, scale, QUANT)
        _store_scaled(k_dst[:, :, None] + (pair + HALF)[None, None, :], o2, s1, scale, QUANT)
    else:
        # Pairs interleaved back into one contiguous row of R dims.
        o = tl.reshape(tl.join(o1, o2), (o1.shape[0], o1.shape[1], 2 * BLOCK_HALF))
        _store_scaled(
            k_dst[:, :, None] + rot[None, None, :], o, out_ok[:, :, None] & (rot < R)[None, None, :], scale, QUANT
        )
    if PASS > 0:
        if MODE < 3:
            if NORM:
                y3 = _normed(x3, rstd, w3, store_ty, SOFT_ROUND) + bad
            else:
                y3 = x3 + bad
        s3 = out_ok[:, :, None] & rest_ok[None, None, :]
        _store_scaled(k_dst[:, :, None] + (R + rest)[None, None, :], y3, s3, scale, QUANT)


@triton.jit
def _k_row(block, norm, rope, scale, QUANT, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr,
           BLOCK_D: tl.constexpr, GATHER: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """K with NeoX RoPE over part of the head (R < D): every dim in one tile.

    Arguments as `_k_part`'s. Its pieces (two rotary halves, then the
    pass-through dims padded to a power of two) each get their own register
    layout when R is small beside D, and the norm then moves values between
    layouts. Here the row is one ``[T, H, D]`` tile, and
    ``o[d] = y[d] * cos[j] + y[partner] * (+-sin[j])`` with ``j = d mod R/2`` for
    each rotary dim and its partner ``d +- R/2``. ``GATHER``: the partner is taken
    from the normed row in registers (``tl.gather``); else from a second load of
    the same row (an L1 hit) and of the norm weight, normed again. Both give the
    same value, each dim being normed and rounded on its own; the gather saves a
    predicated load per element of the tile (docs/decisions/002-rope-partners-gathered-in-registers.md).
    """
    k_head, head_ok, tok, tok_ok, layer, row_ok, k_dst = block
    weight_ptr, weight_stride_l, weight_stride_d, eps = norm
    MODE: tl.constexpr = QUANT[0]
    SOFT_ROUND: tl.constexpr = QUANT[4]
    store_ty: tl.constexpr = k_head.dtype.element_ty
    HALF: tl.constexpr = R // 2
    dim = tl.arange(0, BLOCK_D)
    rotary = dim < R
    first = dim < HALF
    partner = tl.where(first, dim + HALF, dim - HALF)
    freq = tl.where(first, dim, dim - HALF)
    # The RoPE row first, as in `_k_part`; the first half's sin enters negated.
    pos_ok, cos, sin = _rope_row(rope, tok, tok_ok, freq, rotary, HALF)
    sin = tl.where(first[None, :], -sin, sin)[:, None, :]
    cos = cos[:, None, :]

    in_row = dim < D
    in_head = head_ok[:, :, None] & in_row[None, None, :]
    x = tl.load(k_head[:, :, None] + dim[None, None, :], mask=in_head, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if NORM:
        w_row = weight_ptr + layer * weight_stride_l
        w = tl.load(w_row + dim * weight_stride_d, mask=in_row, other=0.0).to(tl.float32)[None, None, :]
        # RMSNorm in float32, then rounded to the storage dtype, as the unfused path.
        rstd = _rstd(tl.sum(x * x, axis=2), D, eps)[:, :, None]
        y = _cast(x * rstd * w, store_ty, SOFT_ROUND).to(tl.float32)
    else:
        y = x
    if GATHER:
        yp = tl.gather(y, tl.broadcast_to(partner[None, None, :], y.shape), axis=2)
    else:
        in_rotary = head_ok[:, :, None] & rotary[None, None, :]
        xp = tl.load(k_head[:, :, None] + partner[None, None, :], mask=in_rotary, other=0.0, cache_modifier=CACHE)
        xp = xp.to(tl.float32)
        if NORM:
            wp = tl.load(w_row + partner * weight_stride_d, mask=rotary, other=0.0).to(tl.float32)[None, None, :]
            yp = _cast(xp * rstd * wp, store_ty, SOFT_ROUND).to(tl.float32)
        else:
            yp = xp
    # NaN for a bad token, -0.0 (changes no bits) otherwise; pass-through dims are y itself.
    bad = tl.where(pos_ok, -0.0, float("nan"))[:, None, None]
    o = tl.where(rotary[None, None, :], y * cos + yp * sin, y) + bad
    out_ok = row_ok[:, None] & head_ok
    if MODE >= 3:
        # Scales written per row, as in `_k_part`.
        o = _cast(o, store_ty, SOFT_ROUND).to(tl.float32)
        scale = _written_scale(_abs_max(o, 2), scale, out_ok, QUANT)[:, :, None]
    _store_scaled(k_dst[:, :, None] + dim[None, None, :], o, out_ok[:, :, None] & in_row[None, None, :], scale, QUANT)


@triton.jit
def _v_load(k_head, head_ok, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """V of BLOCK_T tokens, all heads, one layer, as stored in kv (``[T, H, BLOCK_D]``, 0 past the row)."""
    dim = tl.arange(0, BLOCK_D)
    vm = head_ok[:, :, None] & (dim < D)[None, None, :]
    return tl.load(k_head[:, :, None] + (H * D + dim)[None, None, :], mask=vm, other=0.0, cache_modifier=CACHE)


@triton.jit
def _v_part(
    v,
    row_ok,
    v_base,
    row,
    PAGE: tl.constexpr,
    v_strides,
    v_stride_h,
    scale,
    QUANT,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """V of BLOCK_T tokens (``v``, from `_v_load`) stored: copied bit for bit (quantized for an FP8 or int8 pool).

    ``v_strides`` (page, slot), ``scale`` and ``QUANT`` as in `typedkv.core.epilogue`, for the V destination
    (with scales written per row, ``scale`` is where each row's goes, as in `_k_part`).
    """
    V_SCALE: tl.constexpr = QUANT[0]
    head = tl.arange(0, BLOCK_H)
    out_ok = row_ok[:, None] & (head < H)[None, :]
    dim = tl.arange(0, BLOCK_D)
    # The destination is worked out here, not beside K's: with K and V in one program
    # (no SPLIT), V's pointers would stay live through K's math, which ran slower.
    v_row = _row_offset(row, PAGE, v_strides)
    v_dst = v_base + v_row[:, None, None] + (head[:, None] * v_stride_h + dim[None, :])[None, :, :]
    v_ok = out_ok[:, :, None] & (dim < D)[None, None, :]
    if V_SCALE == 0:
        tl.store(v_dst, v, mask=v_ok)
    else:
        v = v.to(tl.float32)
        if V_SCALE >= 3:
            scale = _written_scale(_abs_max(v, 2), scale, out_ok, QUANT)[:, :, None]
        _store_scaled(v_dst, v, v_ok, scale, QUANT)


# Ints that change with every batch are not specialised on (one compiled kernel
# serves every T); the layer strides among them arrive divided by LAYER_VEC so
# the compiler still sees 16-byte aligned rows.
@triton.jit(do_not_specialize=["k_stride_l", "v_stride_l", "num_tokens", "num_rows"])
def materialize_kv_kernel(
    kv_ptr,
    kv_stride_t,
    kv_stride_l,
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
    k_ptr,
    k_stride_l,
    k_stride_page,
    k_stride_slot,
    k_stride_h,
    v_ptr,
    v_stride_l,
    v_stride_page,
    v_stride_slot,
    v_stride_h,
    layer_offsets_ptr,
    scales,  # K's and V's FP8 scale, each (tensor or None, its stride, float): see _layer_scale
    v_norm,  # V_NORM: V's norm weight (tensor, its layer stride, its dim stride); else None
    scale_out,  # scales written per row: (K's, V's, layer table or None), else None (_scale_destinations)
    scale_strides,  # their (layer, page, slot, head) strides, K's then V's, else None
    num_tokens,
    num_positions,
    num_rows,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,  # a K RMSNorm (else K is RoPE(k) only)
    V_NORM: tl.constexpr,  # a V RMSNorm (else V is copied bit for bit)
    EPS_PER_LAYER: tl.constexpr,
    INDEXED: tl.constexpr,
    PAGE: tl.constexpr,  # slots per page: row r is page r // PAGE, slot r % PAGE (1: a page per row)
    LAYER_TABLE: tl.constexpr,  # 0: layer l at l * stride; else offsets from a table, multiples of this
    # 0: store as is, 1: divide by scales[0]'s float, 2: by its tensor's entry for the layer;
    # 3: by each row's scale, written to scale_out (4: per-layer scale tensors, through its table)
    K_SCALE: tl.constexpr,
    V_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    LAYER_VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    SPLIT: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    NUM_LAYERS: tl.constexpr,
    LAYER_FAST: tl.constexpr,
    FULL_ROW: tl.constexpr,  # 0: K in pieces (`_k_part`); 1: one tile (`_k_row`); 2: one tile, partners gathered
    V_FIRST: tl.constexpr,  # K and V in one program: V's loads issued before K's stores (else after them)
    LOAD_CACHE: tl.constexpr,  # the cache modifier of kv's loads ("": the default, ".cg": L2 only)
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent launch: wait for the prior kernel first
    WIDE: tl.constexpr,  # some index * stride of this layout passes int32 (`typedkv.core.launch_args.wide_offsets`)
):
    if WAIT_PRIOR:
        gdc_wait()  # before any load: what the kernel reads may be the prior kernel's output
    # One program per (token block, layer) on a 1-D grid; LAYER_FAST puts a
    # token's layers on neighbouring programs, so kv is read front to back.
    pid = tl.program_id(0)
    if LAYER_FAST:
        layer = pid % NUM_LAYERS
        block = pid // NUM_LAYERS
    else:
        block = pid % tl.cdiv(num_tokens, BLOCK_T)
        layer = pid // tl.cdiv(num_tokens, BLOCK_T)
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    if WIDE:
        # Every index * stride below then multiplies in int64: the layer's and the token's
        # indices, and the strides that multiply a head's or a dim's (a constant 1 stays exact).
        wide = tl.full([], 0, tl.int64)
        layer += wide
        tok += wide
        k_stride_h += wide
        v_stride_h += wide
        weight_stride_d += wide
        cos_sin_stride_r += wide
    if cos_sin_stride_l is not None:
        cos_sin_ptr += layer * cos_sin_stride_l  # the layer's own RoPE table
    head = tl.arange(0, BLOCK_H)
    tok_ok = tok < num_tokens
    head_ok = tok_ok[:, None] & (head < H)[None, :]  # [T, H]
    # Row offsets in int64: T * stride overflows int32 for large batches.
    kv_row = kv_ptr + tok.to(tl.int64) * kv_stride_t + layer * kv_stride_l
    k_head = kv_row[:, None] + (head * D)[None, :]  # [T, H] pointers to each head's K

    # Destination rows and layer bases.
    row, row_ok = _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED)
    k_base = _layer_base(k_ptr, layer_offsets_ptr, layer, layer, k_stride_l, LAYER_VEC, LAYER_TABLE)
    v_base = _layer_base(v_ptr, layer_offsets_ptr, NUM_LAYERS + layer, layer, v_stride_l, LAYER_VEC, LAYER_TABLE)
    k_dst = k_base + _row_offset(row, PAGE, (k_stride_page, k_stride_slot))[:, None] + (head * k_stride_h)[None, :]
    # Per-layer scalars read once here, honouring the tensors' strides.
    if EPS_PER_LAYER:
        eps = tl.load(eps_ptr + layer * eps_stride).to(tl.float32)
    scale = (_layer_scale(scales[0], layer, K_SCALE), _layer_scale(scales[1], layer, V_SCALE))  # K's, V's
    if K_SCALE >= 3:
        # Scales written per row: K's and V's part each get where their rows' scales go instead.
        scale = _scale_destinations(scale_out, scale_strides, layer, row[:, None], head[None, :], PAGE, NUM_LAYERS,
                                    K_SCALE)  # fmt: skip
    # SPLIT: K and V in separate programs (grid axis 2), fewer live registers each.
    part = tl.program_id(2)
    if V_FIRST:
        # The compiler does not move a load across a store that may alias it: issued
        # here, V's loads overlap K's dependent loads instead of waiting for K's stores.
        v = _v_load(k_head, head_ok, H, D, BLOCK_D, LOAD_CACHE)
    if not SPLIT or part == 0:
        norm = (weight_ptr, weight_stride_l, weight_stride_d, eps)
        rope = (positions_ptr, positions_stride, num_positions, cos_sin_ptr, cos_sin_stride_p, cos_sin_stride_r)
        K_QUANT: tl.constexpr = (K_SCALE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
        k_block = (k_head, head_ok, tok, tok_ok, layer, row_ok, k_dst)
        if FULL_ROW:
            _k_row(k_block, norm, rope, scale[0], K_QUANT, D, R, NORM, BLOCK_D, FULL_ROW == 2, LOAD_CACHE)
        else:
            _k_part(
                k_block,
                norm,
                rope,
                scale[0],
                K_QUANT,
                (H, D, R),
                (BLOCK_H, BLOCK_HALF, BLOCK_PASS),
                NEOX,
                NORM,
                LOAD_CACHE,
            )
    if not SPLIT or part == 1:
        V_QUANT: tl.constexpr = (V_SCALE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
        if not V_FIRST:
            v = _v_load(k_head, head_ok, H, D, BLOCK_D, LOAD_CACHE)
        if V_NORM:
            # V's RMSNorm as K's (float32, rounded to the storage dtype), without RoPE.
            v_ty: tl.constexpr = kv_ptr.dtype.element_ty
            vf = v.to(tl.float32)
            vw = _norm_weight_row(v_norm, layer, D, BLOCK_D, WIDE)
            v = _normed(vf, _rstd(tl.sum(vf * vf, axis=2), D, eps)[:, :, None], vw, v_ty, SOFT_ROUND).to(v_ty)
        _v_part(
            v, row_ok, v_base, row, PAGE, (v_stride_page, v_stride_slot), v_stride_h, scale[1], V_QUANT,
            H, D, BLOCK_H, BLOCK_D,
        )  # fmt: skip
