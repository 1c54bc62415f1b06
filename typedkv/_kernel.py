"""The fused KV materialization kernel: math only, no checking.

One program handles ``BLOCK_T`` tokens of one layer, all ``H`` heads at once:
it reads each token's K and V blocks from ``kv`` once, applies the layer's K
RMSNorm (float32, rounded to the storage dtype as the unfused path does) and
RoPE, and writes K and V. The destination row of a token is the token itself
(dense ``[L, T, H, D]`` outputs) or its pool slot (``INDEXED``); the layer base is
``layer * stride`` (one stacked tensor) or an element offset read from a table
(``LAYER_TABLE``: an engine's list of per-layer pool tensors).

Every load and store is masked, so the kernel never touches memory outside its
tensors whatever the values of ``positions`` or the slots are: a token whose
position is outside ``[0, P)`` gets NaN in K (V is still copied), and a token
whose slot is negative or ``>= S`` is skipped.
"""

from __future__ import annotations

# The kernels' parameters are deliberately unannotated: Triton reads parameter
# annotations when it compiles (as type/specialisation hints; `tl.tensor[...]`
# fails to compile on Triton 3.6), so mypy skips this module's bodies
# (pyproject.toml: [[tool.mypy.overrides]] for typedkv._kernel).
import triton
import triton.language as tl


@triton.jit
def _to_fp8_grid(x, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Saturate ``x`` to +-FP8_MAX and round it (to nearest even) onto the FP8 grid.

    The cast to FP8 that follows is then exact. Rounding here, in float32
    arithmetic, gives the same bits on every backend: Triton's CPU interpreter
    mis-rounds values whose mantissa carries into the exponent.
    """
    # NaN compares false both ways and stays NaN.
    x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))
    exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP)  # below the smallest normal the grid is uniform
    # 1.5 * 2**(exp - MANT + 23): adding it leaves exactly the bits of a
    # multiple of the grid step 2**(exp - MANT), rounded to nearest even.
    magic = (((exp - MANT + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    mag = (tl.abs(x) + magic) - magic
    return tl.where(x < 0, -mag, mag)


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
    eps,
    cos_sin_ptr,
    cos_sin_stride_p,
    cos_sin_stride_r,
    positions_ptr,
    positions_stride,
    slots_ptr,
    slots_stride,
    k_ptr,
    k_stride_l,
    k_stride_row,
    k_stride_h,
    v_ptr,
    v_stride_l,
    v_stride_row,
    v_stride_h,
    layer_offsets_ptr,
    k_scale_ptr,
    k_scale,
    v_scale_ptr,
    v_scale,
    num_tokens,
    num_positions,
    num_rows,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NEOX: tl.constexpr,
    EPS_PER_LAYER: tl.constexpr,
    INDEXED: tl.constexpr,
    LAYER_TABLE: tl.constexpr,
    K_SCALE: tl.constexpr,  # 0: store as is, 1: divide by k_scale, 2: by k_scale_ptr[layer]
    V_SCALE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    LAYER_VEC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    HALF: tl.constexpr = R // 2
    layer = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.arange(0, BLOCK_H)
    dim = tl.arange(0, BLOCK_D)
    tok_ok = tok < num_tokens
    lane_ok = (head[:, None] < H) & (dim[None, :] < D)
    mask = tok_ok[:, None, None] & lane_ok[None, :, :]
    # Row offsets in int64: T * stride overflows int32 for large batches.
    kv_row = kv_ptr + tok.to(tl.int64) * kv_stride_t + layer * kv_stride_l
    lane = head[:, None] * D + dim[None, :]
    k_src = kv_row[:, None, None] + lane[None, :, :]
    x = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(k_src + H * D, mask=mask, other=0.0)

    # RMSNorm in float32, then rounded to the storage dtype, as the unfused path.
    dim_ok = dim < D
    w_row = weight_ptr + layer * weight_stride_l
    w = tl.load(w_row + dim * weight_stride_d, mask=dim_ok, other=0.0).to(tl.float32)
    if EPS_PER_LAYER:
        layer_eps = tl.load(eps_ptr + layer).to(tl.float32)
    else:
        layer_eps = eps
    rstd = tl.rsqrt(tl.sum(x * x, axis=2) / D + layer_eps)
    store_ty = kv_ptr.dtype.element_ty
    y = (x * rstd[:, :, None] * w[None, None, :]).to(store_ty).to(tl.float32)

    # RoPE on the first R dims. Each dim's rotation partner is read again from
    # kv (the row is already in L1), which avoids a register shuffle.
    if NEOX:
        first = dim < HALF
        partner = tl.where(first, dim + HALF, dim - HALF)
        freq = tl.where(first, dim, dim - HALF)
        sign = tl.where(first, -1.0, 1.0)
    else:
        partner = dim ^ 1
        freq = dim // 2
        sign = tl.where(dim % 2 == 0, -1.0, 1.0)
    rot = dim < R
    p_mask = tok_ok[:, None, None] & (head[:, None] < H)[None, :, :] & rot[None, None, :]
    xp = tl.load(kv_row[:, None, None] + (head[:, None] * D + partner[None, :])[None, :, :], mask=p_mask, other=0.0)
    wp = tl.load(w_row + partner * weight_stride_d, mask=rot, other=0.0).to(tl.float32)
    yp = (xp.to(tl.float32) * rstd[:, :, None] * wp[None, None, :]).to(store_ty).to(tl.float32)

    pos = tl.load(positions_ptr + tok * positions_stride, mask=tok_ok, other=0).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < num_positions)
    cs_row = cos_sin_ptr + pos * cos_sin_stride_p
    cs_mask = (tok_ok & pos_ok)[:, None] & rot[None, :]
    cos = tl.load(cs_row[:, None] + freq[None, :] * cos_sin_stride_r, mask=cs_mask, other=1.0).to(tl.float32)
    sin = tl.load(cs_row[:, None] + (freq + HALF)[None, :] * cos_sin_stride_r, mask=cs_mask, other=0.0).to(tl.float32)
    k = tl.where(rot[None, None, :], y * cos[:, None, :] + sign[None, None, :] * (yp * sin[:, None, :]), y)
    k = tl.where(pos_ok[:, None, None], k, float("nan"))

    if INDEXED:
        row = tl.load(slots_ptr + tok * slots_stride, mask=tok_ok, other=-1).to(tl.int64)
        row_ok = tok_ok & (row >= 0) & (row < num_rows)
    else:
        row = tok.to(tl.int64)
        row_ok = tok_ok
    if LAYER_TABLE:
        k_base = k_ptr + tl.load(layer_offsets_ptr + layer)
        v_base = v_ptr + tl.load(layer_offsets_ptr + tl.num_programs(1) + layer)
    else:
        k_base = k_ptr + layer.to(tl.int64) * k_stride_l * LAYER_VEC
        v_base = v_ptr + layer.to(tl.int64) * v_stride_l * LAYER_VEC
    out_mask = row_ok[:, None, None] & lane_ok[None, :, :]

    if K_SCALE == 2:
        k = tl.div_rn(k, tl.load(k_scale_ptr + layer).to(tl.float32))
    elif K_SCALE == 1:
        k = tl.div_rn(k, k_scale)
    if K_SCALE != 0:
        k = _to_fp8_grid(k, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
    k_dst = k_base + row[:, None, None] * k_stride_row + (head[:, None] * k_stride_h + dim[None, :])[None, :, :]
    tl.store(k_dst, k.to(k_ptr.dtype.element_ty), mask=out_mask)

    if V_SCALE != 0:
        vf = v.to(tl.float32)
        if V_SCALE == 2:
            vf = tl.div_rn(vf, tl.load(v_scale_ptr + layer).to(tl.float32))
        else:
            vf = tl.div_rn(vf, v_scale)
        vf = _to_fp8_grid(vf, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
        v_out = vf.to(v_ptr.dtype.element_ty)
    else:
        v_out = v  # bit for bit
    v_dst = v_base + row[:, None, None] * v_stride_row + (head[:, None] * v_stride_h + dim[None, :])[None, :, :]
    tl.store(v_dst, v_out, mask=out_mask)
