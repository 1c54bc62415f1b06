"""The projection kernel for Hopper, warp-specialised (Gluon): ``hidden @ W^T`` with the K/V epilogue, math only.

`typedkv.projection.kernel` runs one program per (token block, head) and its K
epilogue does not overlap any loads, which leaves it a fifth over ``torch.mm`` from T = 2048 on.
This kernel, written in Gluon (``triton.experimental.gluon``, Triton 3.6's API,
sm_90 only), is persistent: one program per SM takes tiles of ``BM`` tokens by
``BN`` weight rows (two heads) in turn, in three partitions of warps:

- a load warp (`_producer`) issues the TMA loads of ``hidden``'s and the
  weight's tiles into a ring of ``STAGES`` shared-memory slots (an mbarrier each
  way per slot);
- the MMA warpgroups (`_mma`) multiply by wgmma as slots fill, round each tile
  to the storage dtype (as a GEMM that stores ``kv`` would) into a staging tile
  in shared memory, hand it over (two mbarriers) and go on to the next tile;
- the epilogue warps (`_epilogue`, ``EPI_WARPS``) take the staged tile a few
  rows at a time and store it: so the tensor cores do not wait on K's norm and
  RoPE, their loads or the stores (docs/decisions/007-warp-specialised-gluon-kernel.md).

A program's last tile has no next tile's products to overlap: with ``LAST_MMA``
the MMA warps, idle by then, run its epilogue themselves (`_tile_epilogue`, the
same code at four times the rows a pass) instead of waiting for two warps to.

The epilogue follows `typedkv.projection.kernel` step by step: a K tile (the weight's
rows are ordered per layer as ``H*D`` K rows, then ``H*D`` V rows, and a tile
never straddles the two) is RMS-normed per head in float32 and rounded, then
NeoX-roped, a position outside ``[0, P)`` giving NaN; a V tile is stored as it
is. Tiles go out by TMA stores into ``[L, T, H*D]`` views of dense outputs,
which clip the rows past ``T``, or from registers into pool rows at the tokens'
slots (`_pool_store`); ``hidden``'s rows past ``T`` load as zeros. A K tile's
positions, cos/sin rows and norm weights load ahead of the rows that use them.

Gluon kernels do not run under Triton's interpreter: this kernel runs on the GPU
only, and the fused path takes it only where it may (`typedkv.projection.warp_specialized.launchable`).
"""

from __future__ import annotations

# Parameters deliberately unannotated, as in `typedkv.kv.kernel` (Gluon reads
# parameter annotations when it compiles); mypy skips this module's bodies.
from typing import Any

try:  # Triton 3.6's Gluon API (other versions differ: `typedkv.projection.warp_specialized.available` checks)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    def _jit(fn: Any = None, **options: Any) -> Any:
        return gluon.jit(fn, **options) if fn is not None else gluon.jit(**options)

    _constexpr_function = gluon.constexpr_function

except ImportError:  # no Gluon: nothing here can run, and importing the module still works
    gl = None

    def _jit(fn: Any = None, **options: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    def _constexpr_function(fn: Any) -> Any:
        return fn


# Ints that change with the batch are not specialised on (a new T compiles nothing).
_PER_CALL = ("num_tokens", "tiles_m", "num_tiles", "positions_stride", "slots_stride")


@_jit
def _band(tile, tiles_a, tiles_b, GROUP: gl.constexpr):
    """Tile ``tile``'s ``(a, b)`` block indices when tiles go in bands of ``GROUP`` blocks along ``a`` over every
    block along ``b``, ``a`` the faster within a band (the last band may be narrower)."""
    in_band = GROUP * tiles_b
    first = (tile // in_band) * GROUP
    band = gl.minimum(tiles_a - first, GROUP)
    return first + (tile % in_band) % band, (tile % in_band) // band


@_jit
def _tile_coords(tile, tiles_m, tiles_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                 GROUP_N: gl.constexpr = 0):  # fmt: skip
    """Tile ``tile``'s ``(row, column)`` offsets, in bands: ``GROUP_M`` token blocks over every column block,
    or (``GROUP_N`` > 0) ``GROUP_N`` column blocks over every token block.

    A band's rows of ``hidden`` stay in L2 while every head passes over them; with ``GROUP_N`` the
    band's weight rows stay in L2 while every token block passes over them instead, so the weight
    is read from memory once and ``hidden`` once a band.
    """
    if GROUP_N > 0:
        pid_n, pid_m = _band(tile, tiles_n, tiles_m, GROUP_N)
    else:
        pid_m, pid_n = _band(tile, tiles_m, tiles_n, GROUP_M)
    return pid_m * BM, pid_n * BN


@_jit
def _loads(a_desc, w_desc, a_bufs, w_bufs, ready, empty, it, off_m, off_n, k_begin, k_end, BK: gl.constexpr,
           STAGES: gl.constexpr, nbytes: gl.constexpr):  # fmt: skip
    """A tile's k-steps ``[k_begin, k_end)``, ``hidden``'s tile and the weight's under one barrier a slot, into the
    ring from slot ``it % STAGES`` on (``nbytes`` a slot); returns the next ``it``."""
    for k in range(k_begin, k_end):
        s = it % STAGES
        # The slot's last use released (on the first pass the wait's parity 1 passes at once).
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, k * BK], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_n, k * BK], ready.index(s), w_bufs.index(s))
        it += 1
    return it


@_jit
def _products(acc, a_bufs, w_bufs, ready, empty, it, k_begin, k_end, STAGES: gl.constexpr):
    """``acc`` plus a tile's k-steps ``[k_begin, k_end)`` by wgmma as the ring's slots fill (from ``it``), every
    slot read given back; returns the sum and the next ``it``."""
    for k in range(k_begin, k_end):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        # At most this product in flight: the one before has read its slots, which go back.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > k_begin)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
    return acc, it


@_jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, num_tiles, k_steps,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, GROUP_N: gl.constexpr):  # fmt: skip
    """The load warp: every k-step of every tile of this program into the ring (`_loads`)."""
    bits: gl.constexpr = a_desc.block_type.element_ty.primitive_bitwidth
    nbytes: gl.constexpr = (BM + BN) * BK * bits // 8
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_coords(tile, tiles_m, tiles_n, BM, BN, GROUP_M, GROUP_N)
        it = _loads(a_desc, w_desc, a_bufs, w_bufs, ready, empty, it, off_m, off_n, 0, k_steps, BK, STAGES, nbytes)


@_jit
def _pool_part(dst, part, layer, TABLE: gl.constexpr):
    """Where layer ``layer`` of K (``part`` 0) or V (1) starts in its pool, its strides, the pools' rows and the
    tokens' slots: ``(start, stride_page, stride_slot, stride_h, num_rows, slots_ptr, slots_stride)``.

    ``dst`` is ``(k_ptr, v_ptr, layer_offsets_ptr, offsets_stride_part, offsets_stride_layer,
    k_strides, v_strides, slots_ptr, slots_stride, num_rows)``, each strides ``(layer, page,
    slot in page, head)`` in elements; a layer starts ``layer * strides[0]`` from the pool's
    address, or (``TABLE`` > 0) at the offset table's entry, a multiple of ``TABLE`` elements.
    """
    (
        k_ptr,
        v_ptr,
        offsets_ptr,
        offsets_stride_part,
        offsets_stride_layer,
        k_strides,
        v_strides,
        slots_ptr,
        slots_stride,
        num_rows,
    ) = dst
    if part == 0:
        base = k_ptr
        stride_l, stride_page, stride_slot, stride_h = k_strides
    else:
        base = v_ptr
        stride_l, stride_page, stride_slot, stride_h = v_strides
    if TABLE:
        # The multiple is known (16 bytes' elements when every layer starts on 16 bytes): the
        # stores stay 16-byte vectors, as with a stacked pool.
        layer_start = gl.multiple_of(
            gl.load(offsets_ptr + part * offsets_stride_part + layer * offsets_stride_layer), TABLE
        )
    else:
        layer_start = layer.to(gl.int64) * stride_l
    return base + layer_start, stride_page, stride_slot, stride_h, num_rows, slots_ptr, slots_stride


@_jit
def _pool_store(vals, target, rows, cols, num_tokens, D: gl.constexpr, PAGE: gl.constexpr):
    """``vals`` (token rows ``rows``, columns ``cols`` of the part's ``H*D``) into the pool rows at the tokens'
    slots, ``target`` from `_pool_part`. Row ``r`` is page ``r // PAGE``, slot ``r % PAGE``; a slot that is
    negative or ``>= num_rows`` skips the token, as does a row at or past ``num_tokens``."""
    start, stride_page, stride_slot, stride_h, num_rows, slots_ptr, slots_stride = target
    slot = gl.load(slots_ptr + rows * slots_stride, mask=rows < num_tokens, other=-1).to(gl.int64)
    ok = (rows < num_tokens) & (slot >= 0) & (slot < num_rows)
    row_start = (slot // PAGE) * stride_page + (slot % PAGE) * stride_slot
    col_start = (cols // D).to(gl.int64) * stride_h + cols % D
    ptrs = start + gl.expand_dims(row_start, 1) + gl.expand_dims(col_start, 0)
    gl.store(ptrs, vals, mask=gl.expand_dims(ok, 1))


@_constexpr_function
def _epilogue_layout(num_warps):
    """The epilogue's layout: rows of 8 consecutive columns a thread (16-byte shared loads and stores, and pool
    stores where the addresses allow), a rotary pair's two columns ``D/2`` apart in one thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [int(num_warps), 1], [1, 0])


@_jit
def _hand_over(c_smem, out, c_full, c_free, free_phase):
    """``out`` into the staging tile once `_epilogue` has given it back (``c_free``'s phase ``free_phase``), then
    to `_epilogue` (``c_full``)."""
    mbarrier.wait(c_free, free_phase)
    c_smem.store(out)
    fence_async_shared()  # a V tile leaves by a TMA store (the async proxy) as it is
    mbarrier.arrive(c_full)


@_jit
def _mma(a_bufs, w_bufs, ready, empty, c_smem, c_full, c_free, dst, norm, rope, num_tokens, tiles_m, tiles_n,
         num_tiles, k_steps, HD: gl.constexpr, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
         STAGES: gl.constexpr, GROUP_M: gl.constexpr, GROUP_N: gl.constexpr, WARPS_M: gl.constexpr,
         WARPS_N: gl.constexpr, NORM: gl.constexpr, EPS_PER_LAYER: gl.constexpr, POOL: gl.constexpr,
         PAGE: gl.constexpr, TABLE: gl.constexpr, LAST_MMA: gl.constexpr):  # fmt: skip
    """The MMA warpgroups: each tile's k-steps by wgmma as the ring's slots fill, the products rounded to the
    storage dtype (kv as a GEMM would store it: V's final values, bit for bit) into the staging tile and
    handed over to `_epilogue`, so the next tile's products start at once.

    With ``LAST_MMA`` the program's last tile stays here: nothing is left to multiply, and these warps
    run its epilogue (`_tile_epilogue`) a quarter of the passes the epilogue warps would take.
    """
    out_ty: gl.constexpr = a_bufs.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BN // WARPS_N, 16]
    )
    it = 0
    n = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        acc, it = _products(acc, a_bufs, w_bufs, ready, empty, it, 0, k_steps, STAGES)
        out = acc.to(out_ty)
        # The epilogue warps are done with the last tile (on the first pass the wait's parity 1 passes at once).
        free_phase = (n & 1) ^ 1
        # Two branches, each handing over: folding LAST_MMA into a run-time test (a Python False set in a
        # constexpr branch, then tested) does not build when it is off (Triton 3.6).
        if LAST_MMA:
            if tile + gl.num_programs(0) >= num_tiles:
                _tile_epilogue(c_smem, c_free, free_phase, out, tile, dst, norm, rope, num_tokens, tiles_m, tiles_n,
                               HD, D, BM, BN, GROUP_M, GROUP_N, NORM, EPS_PER_LAYER, POOL, PAGE, TABLE,
                               WARPS_M * WARPS_N)  # fmt: skip
            else:
                _hand_over(c_smem, out, c_full, c_free, free_phase)
        else:
            _hand_over(c_smem, out, c_full, c_free, free_phase)
        n += 1


@_jit
def _row_positions(rope, rows, num_tokens):
    """Rows ``rows``' positions (int64; 0 past ``num_tokens``)."""
    positions_ptr, positions_stride = rope[0], rope[1]
    return gl.load(positions_ptr + rows * positions_stride, mask=rows < num_tokens, other=0).to(gl.int64)


@_jit
def _cos_sin(rope, pos, HALF: gl.constexpr, row_half: gl.constexpr):
    """The rows' cos and sin ``[R, 1, HALF]`` (float32) at positions ``pos`` (the slice of ``row_half``'s dim 1),
    and ``[R, 1, 1]`` to add to every K dim: NaN for a position outside ``[0, P)``, -0.0 (which changes no
    bits) otherwise."""
    _, _, num_positions, cos_sin_ptr, stride_p, stride_r = rope
    pos_ok = (pos >= 0) & (pos < num_positions)
    pair = gl.arange(0, HALF, layout=gl.SliceLayout(0, row_half))
    cs_row = gl.expand_dims(cos_sin_ptr + pos * stride_p, 1)
    cs_mask = gl.expand_dims(pos_ok, 1) & gl.expand_dims(pair < HALF, 0)
    cos = gl.load(cs_row + gl.expand_dims(pair * stride_r, 0), mask=cs_mask, other=1.0).to(gl.float32)
    sin = gl.load(cs_row + gl.expand_dims((pair + HALF) * stride_r, 0), mask=cs_mask, other=0.0).to(gl.float32)
    bad = gl.expand_dims(gl.expand_dims(gl.where(pos_ok, -0.0, float("nan")), 1), 1)
    return gl.expand_dims(cos, 1), gl.expand_dims(sin, 1), bad


@_jit
def _norm_weights(norm, layer, HALF: gl.constexpr, EPS_PER_LAYER: gl.constexpr, half_layout: gl.constexpr):
    """Layer ``layer``'s eps and K norm weights' two halves ``[1, 1, HALF]`` (float32, ``half_layout``)."""
    eps, eps_ptr, eps_stride, weight_ptr, weight_stride_l, weight_stride_d = norm
    if EPS_PER_LAYER:
        eps = gl.load(eps_ptr + layer * eps_stride).to(gl.float32)
    j = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(0, half_layout)))
    w_row = weight_ptr + layer * weight_stride_l
    w1 = gl.expand_dims(gl.expand_dims(gl.load(w_row + j * weight_stride_d).to(gl.float32), 0), 0)
    w2 = gl.expand_dims(gl.expand_dims(gl.load(w_row + (j + HALF) * weight_stride_d).to(gl.float32), 0), 0)
    return eps, w1, w2


@_jit
def _k_rows(x, eps, w1, w2, cos, sin, bad, out_ty: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
            NORM: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """``R`` rows of a K tile, in the storage dtype's values (float32, ``layout``): RMS-normed per head and rounded,
    NeoX-roped (`_norm_weights`' and `_cos_sin`'s operands); float32 in ``layout``. The rows are seen as
    ``[R, heads, 2, D/2]`` with each rotary pair ``(j, j + D/2)`` in one thread's registers, split into
    its halves."""
    x1, x2 = gl.split(gl.permute(gl.reshape(x, [R, BN // D, 2, D // 2]), (0, 1, 3, 2)))
    if NORM:
        rstd = gl.expand_dims(gl.rsqrt(gl.sum(x1 * x1 + x2 * x2, axis=2) / D + eps), 2)
        # Rounded to the storage dtype, as the unfused path stores the norm's output.
        y1 = (x1 * rstd * w1).to(out_ty).to(gl.float32)
        y2 = (x2 * rstd * w2).to(out_ty).to(gl.float32)
    else:
        y1 = x1
        y2 = x2
    o1 = y1 * cos - y2 * sin + bad
    o2 = y2 * cos + y1 * sin + bad
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(o1, o2), (0, 1, 3, 2)), [R, BN]), layout)


@_jit
def _take(c_smem, bar, phase, staged):
    """Wait for the staging tile (``bar``'s phase ``phase``); ``staged`` (the tile's values, or None where another
    partition has staged them) goes into it first."""
    mbarrier.wait(bar, phase)
    if staged is not None:
        c_smem.store(staged)


@_jit
def _tile_epilogue(c_smem, bar, phase, staged, tile, dst, norm, rope, num_tokens, tiles_m, tiles_n, HD: gl.constexpr,
                   D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                   GROUP_N: gl.constexpr, NORM: gl.constexpr, EPS_PER_LAYER: gl.constexpr, POOL: gl.constexpr,
                   PAGE: gl.constexpr, TABLE: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Tile ``tile``'s epilogue by ``WARPS`` warps, ``4 * WARPS`` rows at a time (a row a thread) from the staging
    tile once `_take` has it: K's rows normed and roped (`_k_rows`) in place, then stored, by TMA into dense
    outputs (the store waited for) or (``POOL``) straight from registers into the pools' rows (`_pool_store`).

    A K tile's positions, cos/sin rows and norm weights load ahead: the first rows' before the tile is
    taken, the next rows' positions two passes ahead and their cos/sin one ahead, so a pass waits on no
    load issued in it.
    """
    HALF: gl.constexpr = D // 2
    ROWS: gl.constexpr = 4 * WARPS  # `_epilogue_layout`'s rows
    PASSES: gl.constexpr = BM // ROWS
    out_ty: gl.constexpr = c_smem.dtype
    layout: gl.constexpr = _epilogue_layout(WARPS)
    probe, _ = gl.split(gl.permute(gl.reshape(gl.zeros([ROWS, BN], gl.float32, layout),
                                              [ROWS, BN // D, 2, HALF]), (0, 1, 3, 2)))  # fmt: skip
    half_layout: gl.constexpr = probe.type.layout  # [rows, heads, HALF]
    row_half: gl.constexpr = gl.SliceLayout(1, half_layout)  # [rows, HALF]
    pos_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, row_half))
    store_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    off_m, off_n = _tile_coords(tile, tiles_m, tiles_n, BM, BN, GROUP_M, GROUP_N)
    layer = off_n // (2 * HD)
    col = off_n - layer * (2 * HD)
    part = (col >= HD).to(gl.int32)
    first = col - part * HD
    cols = first + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    if POOL:
        target = _pool_part(dst, part, layer, TABLE)
    if col < HD:
        eps, w1, w2 = _norm_weights(norm, layer, HALF, EPS_PER_LAYER, half_layout)
        pos_next = _row_positions(rope, off_m + pos_rows, num_tokens)
        cos, sin, bad = _cos_sin(rope, pos_next, HALF, row_half)
        if PASSES > 1:
            pos_next = _row_positions(rope, off_m + ROWS + pos_rows, num_tokens)
        _take(c_smem, bar, phase, staged)
        for c in gl.static_range(PASSES):
            if c + 1 < PASSES:
                cos_next, sin_next, bad_next = _cos_sin(rope, pos_next, HALF, row_half)
                if c + 2 < PASSES:
                    pos_next = _row_positions(rope, off_m + (c + 2) * ROWS + pos_rows, num_tokens)
            chunk = c_smem.slice(c * ROWS, ROWS)
            x = chunk.load(layout).to(gl.float32)
            vals = _k_rows(x, eps, w1, w2, cos, sin, bad, out_ty, ROWS, BN, D, NORM, layout).to(out_ty)
            if POOL:
                _pool_store(vals, target, off_m + c * ROWS + store_rows, cols, num_tokens, D, PAGE)
            else:
                chunk.store(vals)
            if c + 1 < PASSES:
                cos, sin, bad = cos_next, sin_next, bad_next
    else:
        _take(c_smem, bar, phase, staged)
        if POOL:
            for c in gl.static_range(PASSES):
                _pool_store(c_smem.slice(c * ROWS, ROWS).load(layout), target, off_m + c * ROWS + store_rows, cols,
                            num_tokens, D, PAGE)  # fmt: skip
    if not POOL:
        fence_async_shared()  # K's rows written here (or the tile staged), read by the TMA store
        if col < HD:
            tma.async_copy_shared_to_global(dst[0], [layer, off_m, first], c_smem.reshape([1, BM, BN]))
        else:
            tma.async_copy_shared_to_global(dst[1], [layer, off_m, first], c_smem.reshape([1, BM, BN]))
        tma.store_wait(0)  # the store has read the tile


@_jit
def _epilogue(c_smem, c_full, c_free, dst, norm, rope, num_tokens, tiles_m, tiles_n, num_tiles, HD: gl.constexpr,
              D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, GROUP_N: gl.constexpr,
              NORM: gl.constexpr, EPS_PER_LAYER: gl.constexpr, POOL: gl.constexpr, PAGE: gl.constexpr,
              TABLE: gl.constexpr, EPI_WARPS: gl.constexpr, LAST_MMA: gl.constexpr):  # fmt: skip
    """The epilogue warps: `_tile_epilogue` on each tile `_mma` hands over (all but the program's last with
    ``LAST_MMA``), the tile given back to `_mma` once stored."""
    end = num_tiles
    if LAST_MMA:
        end = num_tiles - gl.num_programs(0)
    n = 0
    for tile in range(gl.program_id(0), end, gl.num_programs(0)):
        _tile_epilogue(c_smem, c_full, n & 1, None, tile, dst, norm, rope, num_tokens, tiles_m, tiles_n, HD, D, BM,
                       BN, GROUP_M, GROUP_N, NORM, EPS_PER_LAYER, POOL, PAGE, TABLE, EPI_WARPS)  # fmt: skip
        mbarrier.arrive(c_free)
        n += 1


@_jit(do_not_specialize=_PER_CALL)
def project_kv_ws_kernel(a_desc, w_desc, k_desc, v_desc, k_ptr, v_ptr, offsets_ptr, offsets_stride_part,
                         offsets_stride_layer, k_stride_l, k_stride_page, k_stride_slot, k_stride_h, v_stride_l,
                         v_stride_page, v_stride_slot, v_stride_h, slots_ptr, slots_stride, num_rows,
                         eps, eps_ptr, eps_stride, weight_ptr, weight_stride_l, weight_stride_d,
                         positions_ptr, positions_stride, num_positions, cos_sin_ptr, stride_p, stride_r,
                         num_tokens, tiles_m, tiles_n, num_tiles, k_steps,
                         HD: gl.constexpr, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                         STAGES: gl.constexpr, GROUP_M: gl.constexpr, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
                         NORM: gl.constexpr, EPS_PER_LAYER: gl.constexpr, POOL: gl.constexpr = False,
                         PAGE: gl.constexpr = 1, TABLE: gl.constexpr = 0, GROUP_N: gl.constexpr = 0,
                         LAST_MMA: gl.constexpr = True):  # fmt: skip
    """K and V of ``hidden`` (``a_desc``, ``[T, hidden]``) by the weight (``w_desc``, ``[L*2*H*D, hidden]``).

    ``k_desc``/``v_desc``: the dense outputs as ``[L, T, H*D]``, blocks ``[1, BM, BN]``; or, with
    ``POOL``, the pools from ``k_ptr`` on (`_pool_part`; the descriptors None). The tiles
    ``program_id, program_id + num_programs, ...`` (one program per SM, or per tile where there
    are fewer).
    """
    if POOL:
        dst = (k_ptr, v_ptr, offsets_ptr, offsets_stride_part, offsets_stride_layer,
               (k_stride_l, k_stride_page, k_stride_slot, k_stride_h),
               (v_stride_l, v_stride_page, v_stride_slot, v_stride_h), slots_ptr, slots_stride, num_rows)  # fmt: skip
    else:
        dst = (k_desc, v_desc)
    dtype: gl.constexpr = a_desc.block_type.element_ty
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], gl.NVMMASharedLayout(128, 16, rank=2))
    norm = (eps, eps_ptr, eps_stride, weight_ptr, weight_stride_l, weight_stride_d)
    rope = (positions_ptr, positions_stride, num_positions, cos_sin_ptr, stride_p, stride_r)
    # Two epilogue warps: with the load warp one warpgroup, so the kernel keeps 12 warps and 168 registers
    # a thread at launch, which the MMA warps' 128 x 256 float32 products need (16 warps would give 128).
    EPI_WARPS: gl.constexpr = 2
    # The staging tile's hand-over: `_mma` -> `_epilogue` (full), and back (free).
    c_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(c_full, count=1)
    mbarrier.init(c_free, count=1)
    fence_async_shared()
    # The partitions' arguments spelt out in the call: a tuple held in a variable turns its
    # constexprs into tensors.
    gl.warp_specialize(
        [
            (_mma, (a_bufs, w_bufs, ready, empty, c_smem, c_full, c_free, dst, norm, rope, num_tokens, tiles_m,
                    tiles_n, num_tiles, k_steps, HD, D, BM, BN, STAGES, GROUP_M, GROUP_N, WARPS_M, WARPS_N, NORM,
                    EPS_PER_LAYER, POOL, PAGE, TABLE, LAST_MMA)),
            (_epilogue, (c_smem, c_full, c_free, dst, norm, rope, num_tokens, tiles_m, tiles_n, num_tiles, HD, D, BM,
                         BN, GROUP_M, GROUP_N, NORM, EPS_PER_LAYER, POOL, PAGE, TABLE, EPI_WARPS, LAST_MMA)),
            (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tiles_m, tiles_n, num_tiles, k_steps,
                         BM, BN, BK, STAGES, GROUP_M, GROUP_N)),
        ],
        [EPI_WARPS, 1],
        # The epilogue and load warps share a warpgroup, which takes 128 registers a thread: with
        # Triton's share-out the MMA warps keep 184 (sm_90, 2 epilogue warps: no spills but for
        # per-layer pools whose layers do not start on 16 bytes).
        [128, 24],
    )  # fmt: skip
    mbarrier.invalidate(c_full)
    mbarrier.invalidate(c_free)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
