"""The `@triton.jit` pieces every kernel shares: rounding and FP8 stores, RMSNorm, the RoPE row, pool addresses.

Math only, no checking. `typedkv.kv.kernel` (per-head K/V),
`typedkv.projection.kernel` (the projection with the K/V epilogue) and
`typedkv.mla.kernel` (MLA latent rows) call them, so all store, round, norm
and address pools alike. Pieces that need many arguments take them grouped as
tuples: ``QUANT`` (how a value is stored), ``rope`` (positions and the cos/sin
cache), a pool's page ``strides``, an FP8 ``scale`` (`_layer_scale`), where scales
written per row go (`_scale_destinations`). A tuple
holds either constexprs (its name in capitals, each read as
``X: tl.constexpr = T[i]``) or run-time values: Triton 3.6 turns the
constexprs of a mixed tuple, or of one unpacked, into run-time values.
"""

from __future__ import annotations

# Parameters deliberately unannotated, as in `typedkv.kv.kernel`: Triton reads
# parameter annotations when it compiles.
import triton
import triton.language as tl

from typedkv.core.tensor_types import SCALE_FLOOR

_SCALE_FLOOR: tl.constexpr = tl.constexpr(SCALE_FLOOR)


@triton.jit
def _to_fp8_grid(x, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Saturate ``x`` to +-FP8_MAX and round it (to nearest even) onto the FP8 grid.

    The cast to FP8 that follows is then exact. Rounding here, in float32
    arithmetic, gives the same bits on every backend: Triton's CPU interpreter
    mis-rounds values whose mantissa carries into the exponent.
    """
    # NaN compares false both ways and stays NaN.
    x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP)  # below the smallest normal the grid is uniform
    # 1.5 * 2**(exp - MANT + 23): adding it leaves exactly the bits of a
    # multiple of the grid step 2**(exp - MANT), rounded to nearest even.
    magic = (((exp - MANT + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    mag = (tl.abs(x) + magic) - magic
    # The sign bit copied back, so -0.0 stays -0.0 (0 - 0 would give +0.0).
    return (mag.to(tl.int32, bitcast=True) | (bits & -(2**31))).to(tl.float32, bitcast=True)


@triton.jit
def _to_int8_grid(x):
    """``x`` saturated to ``[-128, 127]`` and rounded to the nearest integer (ties to even), in float32; NaN as 0.

    The cast to int8 that follows is then exact (a float-to-int conversion alone would truncate).
    """
    x = tl.where(x > 127.0, 127.0, tl.where(x < -128.0, -128.0, x))
    # 1.5 * 2**23: adding it leaves a multiple of 1 (|x| <= 128), rounded to nearest even; subtracting it is exact.
    rounded = (x + 12582912.0) - 12582912.0
    return tl.where(x != x, 0.0, rounded)


@triton.jit
def _cvt_int8(x):
    """On GPUs, what `_to_int8_grid` computes, cast to int8: one ``cvt.rni.sat.s8.f32`` an element (rounded to
    the nearest integer, ties to even, saturated to int8's range, NaN as 0) in place of six instructions."""
    q = tl.inline_asm_elementwise("cvt.rni.sat.s8.f32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    return q.to(tl.int8)


@triton.jit
def _cast(x, dtype: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """``x`` (float32) as ``dtype``, rounded to nearest even on every backend.

    Triton's CPU interpreter truncates float32 -> bfloat16; with SOFT_ROUND the
    bits are rounded here first, which makes that conversion exact. GPUs round
    to nearest even in hardware and skip it.
    """
    if SOFT_ROUND and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _store_scaled(dst, x, mask, scale, QUANT):
    """Store ``x`` (float32) as ``QUANT`` says.

    ``QUANT`` is ``(MODE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)``, all
    constexprs: MODE 0 casts to dst's dtype; 1 and 2 store FP8 of ``x / scale``
    (the FP8 format's largest finite value, mantissa bits and smallest normal
    exponent follow); 3 and 4 (scales written per row, `_written_scale`) store
    ``x / scale`` in an FP8 or int8 destination (FP8_MAX 127 for int8), ``scale``
    one per row. SOFT_ROUND as in `_cast`.
    """
    # Read one by one, annotated: Triton keeps a tuple's constexprs constant only so.
    MODE: tl.constexpr = QUANT[0]
    FP8_MAX: tl.constexpr = QUANT[1]
    FP8_MANT: tl.constexpr = QUANT[2]
    FP8_MIN_EXP: tl.constexpr = QUANT[3]
    SOFT_ROUND: tl.constexpr = QUANT[4]
    if MODE == 0:
        tl.store(dst, _cast(x, dst.dtype.element_ty, SOFT_ROUND), mask=mask)
    else:
        # One IEEE reciprocal per program, then multiplies: the reference
        # quantizes with the same x * (1 / scale).
        inv = tl.div_rn(1.0, scale)
        x = x * inv
        if dst.dtype.element_ty == tl.int8:
            if SOFT_ROUND:
                q = _to_int8_grid(x).to(tl.int8)
            else:
                q = _cvt_int8(x)
        elif SOFT_ROUND:
            x = _to_fp8_grid(x, FP8_MAX, FP8_MANT, FP8_MIN_EXP)
            q = x.to(dst.dtype.element_ty)
            if FP8_MANT == 3:
                # The interpreter's cast to float8_e4m3fn loses NaN (gives +-384):
                # NaN is S.1111.111 in that format, the sign kept.
                nan_bits = (((x.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
                q = tl.where(x != x, nan_bits, q.to(tl.uint8, bitcast=True)).to(dst.dtype.element_ty, bitcast=True)
        else:
            # On GPUs the conversion is one `cvt.rn.satfinite` per pair: round to
            # nearest even, saturate to the finite range, NaN stays NaN. An explicit
            # clamp here cost 4 instructions per element (tests/test_gpu.py pins
            # the saturation on CUDA).
            q = x.to(dst.dtype.element_ty)
        tl.store(dst, q, mask=mask)


@triton.jit
def _layer_scale(scale, layer, MODE: tl.constexpr):
    """A destination's FP8 scale for ``layer``, as `_store_scaled` takes it.

    ``scale`` is the kernel's ``(tensor, its stride, float)`` argument: with
    MODE 2 the tensor's entry for ``layer`` (read with its stride), else the
    float (1.0 when none was given; MODE 0 ignores it).
    """
    if MODE == 2:
        return tl.load(scale[0] + layer * scale[1]).to(tl.float32)
    else:
        return scale[2]


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max(x, axis: tl.constexpr):
    """The largest magnitude of ``x`` along ``axis``; NaN where a NaN is among them (as ``torch.amax``)."""
    return tl.reduce(tl.abs(x), axis, _nan_max)


@triton.jit
def _written_scale(amax, scale_dst, mask, QUANT):
    """The scale of rows whose largest magnitude is ``amax``, stored at ``scale_dst`` where ``mask``, and returned.

    ``amax / FP8_MAX`` (``QUANT[1]``: the format's largest value), at least `SCALE_FLOOR`, in float32 with an
    IEEE division, as the reference; a NaN stays NaN.
    """
    QMAX: tl.constexpr = QUANT[1]
    scale = tl.maximum(tl.div_rn(amax, QMAX), _SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    tl.store(scale_dst, scale, mask=mask)
    return scale


@triton.jit
def _scale_destinations(scale_out, scale_strides, layer, row, head, PAGE: tl.constexpr, NUM_LAYERS: tl.constexpr,
                        MODE: tl.constexpr):  # fmt: skip
    """Where K's and V's scale of each row go (scales written per row), as ``(k, v)`` pointers of ``row + head``'s shape.

    ``scale_out`` is ``(K's, V's, table)``: layer 0's scale tensors and, with MODE 4 (per-layer tensors),
    a ``[2, L]`` table of element offsets from them to each layer's; ``scale_strides`` their ``(layer, page, slot,
    head)`` strides. ``row`` and ``head`` broadcast against each other (``[T, 1]`` and ``[1, H]``, or ``[T]`` and
    one head).
    """
    k_strides = scale_strides[0]
    v_strides = scale_strides[1]
    if MODE == 4:
        k_base = scale_out[0] + tl.load(scale_out[2] + layer)
        v_base = scale_out[1] + tl.load(scale_out[2] + NUM_LAYERS + layer)
    else:
        k_base = scale_out[0] + layer.to(tl.int64) * k_strides[0]
        v_base = scale_out[1] + layer.to(tl.int64) * v_strides[0]
    # In int64 throughout: a few stores a row, and no WIDE to decide.
    head = head.to(tl.int64)
    k = k_base + _row_offset(row, PAGE, (k_strides[1], k_strides[2])) + head * k_strides[3]
    v = v_base + _row_offset(row, PAGE, (v_strides[1], v_strides[2])) + head * v_strides[3]
    return k, v


@triton.jit
def _rstd(sum_sq, WIDTH: tl.constexpr, eps):
    """RMSNorm's ``1 / sqrt(mean(x**2) + eps)`` of rows whose squares sum to ``sum_sq`` (float32)."""
    return tl.rsqrt(sum_sq / WIDTH + eps)


@triton.jit
def _normed(x, rstd, weight, store_ty: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """``x * rstd * weight`` of ``[T, H, F]`` tiles (``rstd`` ``[T, H, 1]``, ``weight`` ``[F]``; float32).

    Rounded to ``store_ty`` (and back to float32), as the unfused path stores a norm's output.
    """
    return _cast(x * rstd * weight[None, None, :], store_ty, SOFT_ROUND).to(tl.float32)


@triton.jit
def _norm_weight_row(norm, layer, WIDTH: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """A layer's norm weight, ``[BLOCK]`` (float32, 0 past ``WIDTH``); ``norm`` is ``(weight_ptr, its layer stride,
    its dim stride)``, ``WIDE`` as the kernels' (the dim's offsets in int64)."""
    dim = tl.arange(0, BLOCK)
    if WIDE:
        dim = dim.to(tl.int64)
    return tl.load(norm[0] + layer * norm[1] + dim * norm[2], mask=dim < WIDTH, other=0.0).to(tl.float32)


@triton.jit
def _rope_row(rope, tok, tok_ok, freq, freq_ok, HALF: tl.constexpr):
    """``(pos_ok, cos, sin)`` of each token at frequencies ``freq`` (float32, ``[T, F]``).

    ``rope`` is ``(positions_ptr, positions_stride, num_positions, cos_sin_ptr,
    cos_sin_stride_p, cos_sin_stride_r)``: the tokens' positions and the
    ``[P, R]`` cos/sin cache (cos in the first ``HALF`` columns, sin after; the layer's
    table of a per-layer cache, ``cos_sin_ptr`` moved to it by the kernel).
    Issued before K's loads: the position and then its cos/sin row are two
    dependent loads, whose latency then overlaps K's instead of following the
    norm. A position outside ``[0, P)`` is never read (``pos_ok`` is False).
    """
    positions_ptr, positions_stride, num_positions, cos_sin_ptr, cos_sin_stride_p, cos_sin_stride_r = rope
    pos = tl.load(positions_ptr + tok * positions_stride, mask=tok_ok, other=0).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < num_positions)
    cs_row = cos_sin_ptr + pos * cos_sin_stride_p
    cs_mask = (tok_ok & pos_ok)[:, None] & freq_ok[None, :]
    cos = tl.load(cs_row[:, None] + freq[None, :] * cos_sin_stride_r, mask=cs_mask, other=1.0)
    sin = tl.load(cs_row[:, None] + (freq + HALF)[None, :] * cos_sin_stride_r, mask=cs_mask, other=0.0)
    return pos_ok, cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED: tl.constexpr):
    """``(row, row_ok)`` of each token: its slot (``INDEXED``) or itself, in int64; False past the tokens.

    A slot that is negative or ``>= num_rows`` is not OK: the token is skipped.
    """
    if INDEXED:
        row = tl.load(slots_ptr + tok * slots_stride, mask=tok_ok, other=-1).to(tl.int64)
        return row, tok_ok & (row >= 0) & (row < num_rows)
    else:
        return tok.to(tl.int64), tok_ok


@triton.jit
def _row_offset(row, PAGE: tl.constexpr, strides):
    """Element offset of pool row ``row``: slot ``row % PAGE`` of page ``row // PAGE`` (``PAGE`` 1: no pages).

    ``strides`` is ``(stride_page, stride_slot)``.
    """
    stride_page, stride_slot = strides
    if PAGE == 1:
        return row * stride_page
    else:
        # A constant divisor: a multiply and shift, not a division.
        return (row // PAGE) * stride_page + (row % PAGE) * stride_slot


@triton.jit
def _layer_base(ptr, layer_offsets_ptr, entry, layer, stride_l, LAYER_VEC: tl.constexpr, LAYER_TABLE: tl.constexpr):
    """Where ``layer`` of a destination starts: ``ptr`` plus the table's ``entry`` (``LAYER_TABLE``) or the layer stride.

    The table holds element offsets from ``ptr`` (per-layer tensors), each a multiple of ``LAYER_TABLE``
    elements (16 bytes' worth when every layer starts on 16 bytes: the stores stay whole vectors);
    ``stride_l`` arrives divided by ``LAYER_VEC``.
    """
    if LAYER_TABLE:
        return ptr + tl.multiple_of(tl.load(layer_offsets_ptr + entry), LAYER_TABLE)
    else:
        return ptr + layer.to(tl.int64) * stride_l * LAYER_VEC
