"""The projection kernel: ``hidden @ W^T`` with the K/V epilogue fused in, math only, no checking.

One program computes the projection of ``BLOCK_M`` tokens for one layer and one
head slot: slots ``[0, H)`` are K heads, ``[H, 2H)`` V heads (the weight's rows
are ordered so, per layer). The GEMM runs on ``tl.dot`` with float32
accumulators over ``hidden`` in ``BLOCK_K`` chunks. In the epilogue each tile is
first rounded to the storage dtype (``hidden``'s), as a GEMM that stores ``kv``
would; from there K and V follow `typedkv.kv.kernel` step by step: K's RMSNorm in
float32, rounded to the storage dtype, then RoPE, rounded once on store; V as
it is, or RMSNorm'ed as K's (``V_NORM``). Nothing is written but K and V at their
destination: dense ``[L, T, H, D]`` outputs or pool rows, addressed as in
`typedkv.kv.kernel` (``INDEXED``, ``PAGE``, ``LAYER_TABLE``, FP8 stores and
scales written per row through `typedkv.core.epilogue`); a per-layer cos/sin
cache as there (``cos_sin_stride_l``).

A K head keeps its rotary pairs in two accumulators, so RoPE is elementwise
between them: NeoX pairs weight rows ``j`` and ``j + R/2``, GPT-J rows ``2j`` and
``2j + 1``; the pass-through dims ``[R, D)`` are a third accumulator. RMSNorm's
sum of squares covers all three.

Where the launch says so (``W_TMA``), the weight's tiles load by TMA from host-side
descriptors, whole rows of a head piece at a time, and a full-rotary K head is one
tile and one product, its halves split after the loop. Programs may run in bands
of token blocks (``GROUP_M``, `_banded`), so a band's rows of ``hidden`` stay in
L2 while every head passes over them.

Every pointer load and store is masked (tokens past ``num_tokens``, ``hidden`` not a
multiple of ``BLOCK_K``, padded head dims), so no value in ``positions`` or
the slots sends the kernel out of bounds: a position outside ``[0, P)`` gives
NaN in K, a slot that is negative or ``>= num_rows`` skips the token.
"""

from __future__ import annotations

# Parameters deliberately unannotated, as in `typedkv.kv.kernel` (Triton reads
# parameter annotations when it compiles); mypy skips this module's bodies.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from typedkv.core.epilogue import (
    _abs_max,
    _cast,
    _destination_rows,
    _layer_base,
    _layer_scale,
    _nan_max,
    _norm_weight_row,
    _rope_row,
    _row_offset,
    _rstd,
    _scale_destinations,
    _store_scaled,
    _written_scale,
)


@triton.jit
def _project(acc, a, w_head, w_stride_n, w_stride_k, rows, rows_ok, kk, HIDDEN: tl.constexpr, EVEN_K: tl.constexpr,
             PRECISION: tl.constexpr):  # fmt: skip
    """``acc + a @ W[rows, kk]^T``: ``a`` ``[M, K]``, ``rows`` (``[N]``) counted from the head's first row ``w_head``.

    Rows outside ``rows_ok``, and columns past ``HIDDEN`` (unless ``EVEN_K``), read 0.
    """
    mask = rows_ok[None, :]
    if not EVEN_K:
        mask = mask & (kk < HIDDEN)[:, None]
    w = tl.load(w_head + rows[None, :] * w_stride_n + kk[:, None] * w_stride_k, mask=mask, other=0.0)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _project_tma(acc, a, w_desc, first_row, k0, PRECISION: tl.constexpr):
    """``acc + a @ W[first_row : first_row + N, k0 : k0 + K]^T``, the weight tile loaded by TMA from ``w_desc``.

    The descriptor's block is ``[N, K]`` (whole rows of one head piece, see `project_kv_kernel`'s
    ``W_TMA``); columns past the weight's last read 0 (TMA's bounds).
    """
    w = w_desc.load([first_row, k0])
    return tl.dot(a, w.T, acc, input_precision=PRECISION)


@triton.jit
def _whole_head_tma(a_row, hidden_stride_k, tok_ok, w_desc, head_row, HIDDEN: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    """``hidden[tokens] @ W[head_row : head_row + ROWS]^T`` (``[BLOCK_M, ROWS]``, float32): a whole head, its weight
    tiles by TMA from ``w_desc`` (a V head, or a K head of full rotary), one product per step."""
    acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = _hidden_tile(a_row, hidden_stride_k, tok_ok, kk, HIDDEN, EVEN_K)
        acc = _project_tma(acc, a, w_desc, head_row, k0, PRECISION)
    return acc


@triton.jit
def _prefetch_head(w_ptr, head_row, w_stride_n, w_stride_k, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   HIDDEN: tl.constexpr, COLUMNS: tl.constexpr):  # fmt: skip
    """Ask L2 for the first ``COLUMNS`` columns of the head's ``D`` weight rows, a 128-byte line each request.

    The weights are no prior kernel's output, so this may run before ``gdc_wait``: the
    program then has its first steps' tiles in L2 when its loads start."""
    LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
    rows = head_row + tl.minimum(tl.arange(0, BLOCK_D), D - 1)
    cols = tl.minimum(tl.arange(0, COLUMNS // LINE) * LINE, HIDDEN - 1)
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * w_stride_n + (cols * w_stride_k)[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _banded(block, head, num_blocks, num_heads, GROUP_M: tl.constexpr):
    """``(token block, head slot)`` of a program, the programs taken in bands of ``GROUP_M`` token blocks.

    Programs start in launch order, grid axis 0 fastest. Without bands, those running
    together are one head's token blocks, and ``hidden`` is read once per head: from
    memory once it outgrows L2 (80 heads read 128 MB of ``hidden`` 80 times at
    T = 16384). In a band, the programs running together are ``GROUP_M`` token blocks
    of a few heads, and a band's rows of ``hidden`` stay in L2 while every head passes.
    """
    linear = head * num_blocks + block
    per_band = GROUP_M * num_heads
    first = (linear // per_band) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    within = linear % per_band
    return first + within % size, within // size


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """``acc[:, :HALF]`` and ``acc[:, HALF:]`` of a ``[BLOCK_M, 2 * HALF]`` tile (its NeoX rotary pairs)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def _hidden_tile(a_row, hidden_stride_k, tok_ok, kk, HIDDEN: tl.constexpr, EVEN_K: tl.constexpr):
    """``hidden[tokens, kk]`` (``[M, K]``), 0 past the last token and past ``HIDDEN``."""
    mask = tok_ok[:, None]
    if not EVEN_K:
        mask = mask & (kk < HIDDEN)[None, :]
    return tl.load(a_row + kk[None, :] * hidden_stride_k, mask=mask, other=0.0)


@triton.jit
def _rounded(acc, bias_head, rows, rows_ok, store_ty: tl.constexpr, HAS_BIAS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """The accumulator (plus bias, in float32) rounded to the storage dtype, as a stored ``kv`` holds it; float32."""
    if HAS_BIAS:
        acc += tl.load(bias_head + rows, mask=rows_ok, other=0.0).to(tl.float32)[None, :]
    return _cast(acc, store_ty, SOFT_ROUND).to(tl.float32)


@triton.jit
def _weight_row(w_row, dims, dims_ok, weight_stride_d):
    """The layer's K norm weight at head dims ``dims`` (``[F]``, float32; 0 outside ``dims_ok``)."""
    return tl.load(w_row + dims * weight_stride_d, mask=dims_ok, other=0.0).to(tl.float32)


@triton.jit
def _norm_loads(eps, norm, layer, pieces, EPS_PER_LAYER: tl.constexpr, PASS: tl.constexpr):
    """``(eps, w1, w2, w3)``: the layer's eps (a per-layer load, else ``eps``) and its K norm weights at the
    three pieces' dims, all loads issued together. ``norm`` is ``(eps_ptr, eps_stride, weight_ptr,
    weight_stride_l, weight_stride_d)``, ``pieces`` ``(dims1, dims2, dims3, pair_ok, rest_ok)``; ``w3``
    is ``w1`` without pass-through dims."""
    eps_ptr, eps_stride, weight_ptr, weight_stride_l, weight_stride_d = norm
    dims1, dims2, dims3, pair_ok, rest_ok = pieces
    w_row = weight_ptr + layer * weight_stride_l
    if EPS_PER_LAYER:
        eps = tl.load(eps_ptr + layer * eps_stride).to(tl.float32)
    w1 = _weight_row(w_row, dims1, pair_ok, weight_stride_d)
    w2 = _weight_row(w_row, dims2, pair_ok, weight_stride_d)
    w3 = w1
    if PASS > 0:
        w3 = _weight_row(w_row, dims3, rest_ok, weight_stride_d)
    return eps, w1, w2, w3


@triton.jit
def _normed2(x, rstd, w, store_ty: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """``x * rstd * w`` of ``[M, F]`` tiles (``w`` from `_weight_row`), rounded to ``store_ty`` as the unfused path."""
    return _cast(x * rstd * w[None, :], store_ty, SOFT_ROUND).to(tl.float32)


# Ints that change with every batch are not specialised on (one compiled kernel
# serves every T); the layer strides among them arrive divided by LAYER_VEC so
# the compiler still sees 16-byte aligned rows.
@triton.jit(do_not_specialize=["k_stride_l", "v_stride_l", "num_tokens", "num_rows"])
def project_kv_kernel(
    hidden_ptr,
    hidden_stride_t,
    hidden_stride_k,
    w_ptr,
    w_stride_n,
    w_stride_k,
    bias_ptr,
    w_half_desc,  # W_TMA: the weight as TMA descriptors of R/2 (partial rotary only), D and D-R rows (else None)
    w_head_desc,
    w_pass_desc,
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
    HIDDEN: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,  # a K RMSNorm (else K is RoPE(k) only)
    V_NORM: tl.constexpr,  # a V RMSNorm (else V is the projection's value)
    HAS_BIAS: tl.constexpr,
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
    NUM_LAYERS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    V_STAGES: tl.constexpr,  # V's pipeline depth (shallower than K's: K's loop ends first, its epilogue hidden)
    EARLY_ROPE: tl.constexpr,  # load K's RoPE rows before the GEMM loop (else after it)
    EARLY_LOADS: tl.constexpr,  # load the epilogue's layer base, scale, eps and norm weights before it too
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for float32 (no TF32, as torch's float32 GEMM)
    SOFT_ROUND: tl.constexpr,
    W_TMA: tl.constexpr,  # weight tiles through the descriptors (NeoX, every piece a power of two rows)
    GROUP_M: tl.constexpr,  # token blocks per band of programs (`_banded`; 1: none)
    L2_BEFORE_WAIT: tl.constexpr,  # the head's first weight columns asked of L2 before WAIT_PRIOR's wait (0: none)
    SIGNAL_NEXT: tl.constexpr,  # after the weight loop, let the next kernel launch (griddepcontrol.launch_dependents)
    WAIT_PRIOR: tl.constexpr,  # launched as a programmatic dependent launch: wait for the prior kernel first
    WIDE: tl.constexpr,  # some index * stride of this layout passes int32 (`typedkv.core.launch_args.wide_offsets`)
):
    if WAIT_PRIOR and L2_BEFORE_WAIT == 0:
        gdc_wait()  # before any load: hidden may be the prior kernel's output
    # Token blocks on grid axis 0, (layer, head slot) on axis 1: the programs
    # launched together share their weight rows, which L2 then serves.
    block = tl.program_id(0)
    pid = tl.program_id(1)
    if GROUP_M > 1:
        block, pid = _banded(block, pid, tl.num_programs(0), tl.num_programs(1), GROUP_M)
    layer = pid // (2 * H)
    slot = pid % (2 * H)
    # This head's first weight row (K heads come first in each layer's 2*H*D rows).
    head_row = layer * (2 * H * D) + slot * D
    if L2_BEFORE_WAIT > 0:
        # Launched while the prior kernel ends, a program has its first weight tiles on their
        # way before it may load anything that kernel wrote (`_prefetch_head`).
        _prefetch_head(w_ptr, head_row, w_stride_n, w_stride_k, D, BLOCK_D, HIDDEN, L2_BEFORE_WAIT)
        if WAIT_PRIOR:
            gdc_wait()
    store_ty: tl.constexpr = hidden_ptr.dtype.element_ty
    HALF: tl.constexpr = R // 2
    PASS: tl.constexpr = D - R
    EVEN_K: tl.constexpr = HIDDEN % BLOCK_K == 0

    tok = block * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:
        # As in `typedkv.kv.kernel`: every index * stride below in int64.
        wide = tl.full([], 0, tl.int64)
        layer += wide
        tok += wide
        hidden_stride_k += wide
        w_stride_k += wide
        k_stride_h += wide
        v_stride_h += wide
        weight_stride_d += wide
        cos_sin_stride_r += wide
    if cos_sin_stride_l is not None:
        cos_sin_ptr += layer * cos_sin_stride_l  # the layer's own RoPE table
    tok_ok = tok < num_tokens
    # Row offsets in int64: T * stride overflows int32 for large batches.
    a_row = hidden_ptr + tok.to(tl.int64)[:, None] * hidden_stride_t
    # The head's address: in int64, since L*2*H*D*hidden may exceed int32.
    w_head = w_ptr + head_row.to(tl.int64) * w_stride_n
    if HAS_BIAS:
        bias_head = bias_ptr + head_row
    else:
        bias_head = bias_ptr

    # Destination rows, as in `typedkv.kv.kernel`.
    if not W_TMA:
        # Loaded before the loop, their latency hidden by it (the TMA configurations load
        # K's after its loop, where registers held through it spilled, and V's before its own).
        row, row_ok = _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED)

    if slot < H:
        head = slot
        pair = tl.arange(0, BLOCK_HALF)
        pair_ok = pair < HALF
        # The head dims (= weight rows from w_head) of each accumulator: NeoX pairs j
        # and j + R/2, GPT-J 2j and 2j + 1; the pass-through dims [R, D) after them.
        if NEOX:
            dims1 = pair
            dims2 = pair + HALF
        else:
            dims1 = 2 * pair
            dims2 = 2 * pair + 1
        rest = tl.arange(0, BLOCK_PASS)
        rest_ok = rest < PASS
        dims3 = R + rest
        rope = (positions_ptr, positions_stride, num_positions, cos_sin_ptr, cos_sin_stride_p, cos_sin_stride_r)
        pieces = (dims1, dims2, dims3, pair_ok, rest_ok)
        norm = (eps_ptr, eps_stride, weight_ptr, weight_stride_l, weight_stride_d)
        if EARLY_ROPE:
            # Their dependent loads (position, then cos/sin) in flight while the weights stream in,
            # not after: at small T the epilogue's latency is a part of the time worth having.
            pos_ok, cos, sin = _rope_row(rope, tok, tok_ok, pair, pair_ok, HALF)
        if EARLY_LOADS:
            # The epilogue's other loads in flight during the loop as well (one dependent
            # load each after it otherwise: the layer table's entry, the scale, eps, weights).
            k_base = _layer_base(k_ptr, layer_offsets_ptr, layer, layer, k_stride_l, LAYER_VEC, LAYER_TABLE)
            scale = _layer_scale(scales[0], layer, K_SCALE)
            if NORM:
                eps, w1, w2, w3 = _norm_loads(eps, norm, layer, pieces, EPS_PER_LAYER, PASS)
        if W_TMA and PASS == 0:
            # The whole head as one tile and one dot (products half as wide ran far slower
            # than a plain GEMM of whole heads; docs/decisions/005-fused-kernel-launch-tables.md),
            # its rotary halves split after the loop.
            acc = _whole_head_tma(
                a_row, hidden_stride_k, tok_ok, w_head_desc, head_row, HIDDEN, EVEN_K, BLOCK_M, 2 * BLOCK_HALF,
                BLOCK_K, NUM_STAGES, PRECISION,
            )  # fmt: skip
            acc1, acc2 = _halves(acc, BLOCK_M, BLOCK_HALF)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_PASS), dtype=tl.float32)
            for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
                kk = k0 + tl.arange(0, BLOCK_K)
                a = _hidden_tile(a_row, hidden_stride_k, tok_ok, kk, HIDDEN, EVEN_K)
                if W_TMA:
                    acc1 = _project_tma(acc1, a, w_half_desc, head_row, k0, PRECISION)
                    acc2 = _project_tma(acc2, a, w_half_desc, head_row + HALF, k0, PRECISION)
                    if PASS > 0:
                        acc3 = _project_tma(acc3, a, w_pass_desc, head_row + R, k0, PRECISION)
                else:
                    acc1 = _project(
                        acc1, a, w_head, w_stride_n, w_stride_k, dims1, pair_ok, kk, HIDDEN, EVEN_K, PRECISION
                    )
                    acc2 = _project(
                        acc2, a, w_head, w_stride_n, w_stride_k, dims2, pair_ok, kk, HIDDEN, EVEN_K, PRECISION
                    )
                    if PASS > 0:
                        acc3 = _project(
                            acc3, a, w_head, w_stride_n, w_stride_k, dims3, rest_ok, kk, HIDDEN, EVEN_K, PRECISION
                        )
        if SIGNAL_NEXT:
            # The weights are in: the next kernel's launch and its programs' start overlap this
            # epilogue (it waits for this kernel's end before it loads anything).
            gdc_launch_dependents()
        if NORM and not EARLY_LOADS:
            # The norm's loads together, before the first layout conversion (a barrier no load
            # moves across): loaded where each was used, w2's followed y1's conversion in the
            # SASS. Both orders ran alike; this one keeps the loads' latencies together.
            eps, w1, w2, w3 = _norm_loads(eps, norm, layer, pieces, EPS_PER_LAYER, PASS)
        if W_TMA:
            row, row_ok = _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED)
        # kv as a GEMM would have stored it.
        x1 = _rounded(acc1, bias_head, dims1, pair_ok, store_ty, HAS_BIAS, SOFT_ROUND)
        x2 = _rounded(acc2, bias_head, dims2, pair_ok, store_ty, HAS_BIAS, SOFT_ROUND)
        if PASS > 0:
            x3 = _rounded(acc3, bias_head, dims3, rest_ok, store_ty, HAS_BIAS, SOFT_ROUND)
        if not EARLY_ROPE:
            pos_ok, cos, sin = _rope_row(rope, tok, tok_ok, pair, pair_ok, HALF)
        if NORM:
            # RMSNorm in float32 over the whole head row, then rounded to the storage dtype, as the unfused path.
            sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if PASS > 0:
                sum_sq += tl.sum(x3 * x3, axis=1)
            rstd = _rstd(sum_sq, D, eps)[:, None]
            y1 = _normed2(x1, rstd, w1, store_ty, SOFT_ROUND)
            y2 = _normed2(x2, rstd, w2, store_ty, SOFT_ROUND)
            if PASS > 0:
                y3 = _normed2(x3, rstd, w3, store_ty, SOFT_ROUND)
        else:
            y1 = x1
            y2 = x2
            if PASS > 0:
                y3 = x3
        # Added to every K dim: NaN for a bad position, -0.0 (which changes no bits) otherwise.
        bad = tl.where(pos_ok, -0.0, float("nan"))[:, None]
        o1 = y1 * cos - y2 * sin + bad
        o2 = y2 * cos + y1 * sin + bad

        if not EARLY_LOADS:
            k_base = _layer_base(k_ptr, layer_offsets_ptr, layer, layer, k_stride_l, LAYER_VEC, LAYER_TABLE)
        k_dst = k_base + _row_offset(row, PAGE, (k_stride_page, k_stride_slot)) + head * k_stride_h
        if not EARLY_LOADS:
            scale = _layer_scale(scales[0], layer, K_SCALE)
        K_QUANT: tl.constexpr = (K_SCALE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
        if K_SCALE >= 3:
            # Scales written per row, as in `typedkv.kv.kernel`: K as stored in the storage dtype, its
            # largest magnitude over the head's dims. The store below adds `bad` to y3 again: -0.0
            # changes no bits, and a row at a bad position is NaN already.
            o1 = _cast(o1, store_ty, SOFT_ROUND).to(tl.float32)
            o2 = _cast(o2, store_ty, SOFT_ROUND).to(tl.float32)
            amax = _nan_max(_abs_max(o1, 1), _abs_max(o2, 1))
            if PASS > 0:
                y3 = _cast(y3 + bad, store_ty, SOFT_ROUND).to(tl.float32)
                amax = _nan_max(amax, _abs_max(y3, 1))
            k_scale_dst = _scale_destinations(scale_out, scale_strides, layer, row, head, PAGE, NUM_LAYERS, K_SCALE)
            scale = _written_scale(amax, k_scale_dst[0], row_ok, K_QUANT)[:, None]
        s1 = row_ok[:, None] & pair_ok[None, :]
        if NEOX:
            _store_scaled(k_dst[:, None] + dims1[None, :], o1, s1, scale, K_QUANT)
            _store_scaled(k_dst[:, None] + dims2[None, :], o2, s1, scale, K_QUANT)
        else:
            # Pairs interleaved back into one contiguous row of R dims.
            rot = tl.arange(0, 2 * BLOCK_HALF)
            o = tl.reshape(tl.join(o1, o2), (BLOCK_M, 2 * BLOCK_HALF))
            _store_scaled(k_dst[:, None] + rot[None, :], o, row_ok[:, None] & (rot < R)[None, :], scale, K_QUANT)
        if PASS > 0:
            s3 = row_ok[:, None] & rest_ok[None, :]
            _store_scaled(k_dst[:, None] + dims3[None, :], y3 + bad, s3, scale, K_QUANT)
    else:
        head = slot - H
        dim = tl.arange(0, BLOCK_D)
        dim_ok = dim < D
        if W_TMA:
            # V's loop holds one accumulator, with room for its rows (a pool's slots), its
            # layer's base and scale: loaded after it, they put a load's latency before the
            # first store, at the end of the programs that end last (small T).
            row, row_ok = _destination_rows(tok, tok_ok, slots_ptr, slots_stride, num_rows, INDEXED)
        if EARLY_LOADS or W_TMA:
            v_base = _layer_base(
                v_ptr, layer_offsets_ptr, NUM_LAYERS + layer, layer, v_stride_l, LAYER_VEC, LAYER_TABLE
            )
            scale = _layer_scale(scales[1], layer, V_SCALE)
        if W_TMA:
            acc = _whole_head_tma(
                a_row, hidden_stride_k, tok_ok, w_head_desc, head_row, HIDDEN, EVEN_K, BLOCK_M, BLOCK_D, BLOCK_K,
                V_STAGES, PRECISION,
            )  # fmt: skip
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=V_STAGES):
                kk = k0 + tl.arange(0, BLOCK_K)
                a = _hidden_tile(a_row, hidden_stride_k, tok_ok, kk, HIDDEN, EVEN_K)
                acc = _project(acc, a, w_head, w_stride_n, w_stride_k, dim, dim_ok, kk, HIDDEN, EVEN_K, PRECISION)
        if SIGNAL_NEXT:
            gdc_launch_dependents()
        # V is kv's value, bit for bit (normed with V_NORM; quantized for an FP8 pool).
        v = _rounded(acc, bias_head, dim, dim_ok, store_ty, HAS_BIAS, SOFT_ROUND)
        if V_NORM:
            # V's RMSNorm as K's (float32, rounded to the storage dtype), without RoPE.
            if EPS_PER_LAYER:
                eps = tl.load(eps_ptr + layer * eps_stride).to(tl.float32)
            vw = _norm_weight_row(v_norm, layer, D, BLOCK_D, WIDE)
            v = _normed2(v, _rstd(tl.sum(v * v, axis=1), D, eps)[:, None], vw, store_ty, SOFT_ROUND)
        if not (EARLY_LOADS or W_TMA):
            v_base = _layer_base(
                v_ptr, layer_offsets_ptr, NUM_LAYERS + layer, layer, v_stride_l, LAYER_VEC, LAYER_TABLE
            )
        v_dst = v_base + _row_offset(row, PAGE, (v_stride_page, v_stride_slot)) + head * v_stride_h
        v_ok = row_ok[:, None] & dim_ok[None, :]
        if not (EARLY_LOADS or W_TMA):
            scale = _layer_scale(scales[1], layer, V_SCALE)
        V_QUANT: tl.constexpr = (V_SCALE, FP8_MAX, FP8_MANT, FP8_MIN_EXP, SOFT_ROUND)
        if V_SCALE >= 3:
            v_scale_dst = _scale_destinations(scale_out, scale_strides, layer, row, head, PAGE, NUM_LAYERS, V_SCALE)
            scale = _written_scale(_abs_max(v, 1), v_scale_dst[1], row_ok, V_QUANT)[:, None]
        # Already on the storage grid: MODE 0's cast to the (same) dtype is exact.
        _store_scaled(v_dst[:, None] + dim[None, :], v, v_ok, scale, V_QUANT)
