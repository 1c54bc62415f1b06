"""Developer script for the H200: how fast can the MLA pool case's rows be scattered at all?

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/scatter_bound.py``. The
bench's MLA pages-of-64 case (L = 5 rows of C + R = 576 bf16 per token, sent to random slots of a
pool of 2T slots, as ``typedkv bench`` draws them) is timed in one process, as the bench times
(CUDA-graph replays over rotating inputs), beside copies of the same rows:

- ``typedkv``: the MLA kernel through the public op (the bench's figure);
- ``torch index_copy_``: every (token, layer) row into the pool viewed as rows, no math;
- ``rows`` / ``chunks``: a minimal Triton copy of a few tokens' rows of one layer to their slots,
  no math (the row as 512 + 64 columns, as typedkv loads it, or as 128-byte chunks);
- ``rotate``: that copy with the rope part rotated: a position load, then its cos/sin row.

Each with the bench's inputs, then changed in one way: the slots sorted; positions below 64 (their
cos/sin rows stay in L2); a bf16 cos/sin cache. Printed as % of the copy roofline measured in the
same run, for the bytes the bench counts (the rows read and written). Results feed
benchmarks/NOTES.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from typedkv import _bench

C_PLUS_R = 576


@triton.jit
def _block_rows(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L: tl.constexpr, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's ROWS tokens of one layer (a token's layers on neighbouring programs):
    ``(tok, ok, src, dst)``, the rows' ckv and pool addresses (the slots loaded)."""
    pid = tl.program_id(0)
    layer = pid % L
    tok = (pid // L) * ROWS + tl.arange(0, ROWS)
    ok = tok < num_tokens
    slot = tl.load(slots_ptr + tok, mask=ok, other=0).to(tl.int64)
    src = src_ptr + tok.to(tl.int64) * (L * 576) + layer * 576
    dst = dst_ptr + layer.to(tl.int64) * dst_stride_l + slot * 576
    return tok, ok, src, dst


@triton.jit
def _copy_rows(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L: tl.constexpr, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]
    """ROWS tokens' rows of one layer to their slots, as 512 + 64 columns."""
    _, ok, src, dst = _block_rows(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L, ROWS)
    wide = tl.arange(0, 512)
    rope = 512 + tl.arange(0, 64)
    x = tl.load(src[:, None] + wide[None, :], mask=ok[:, None])
    y = tl.load(src[:, None] + rope[None, :], mask=ok[:, None])
    tl.store(dst[:, None] + rope[None, :], y, mask=ok[:, None])
    tl.store(dst[:, None] + wide[None, :], x, mask=ok[:, None])


@triton.jit
def _copy_chunks(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L: tl.constexpr, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]
    """ROWS tokens' rows of one layer to their slots, as 9 chunks of 64 columns each (rows * 9 < 2**k)."""
    pid = tl.program_id(0)
    layer = pid % L
    CHUNKS: tl.constexpr = triton.next_power_of_2(ROWS * 9)
    chunk = tl.arange(0, CHUNKS)
    tok = (pid // L) * ROWS + chunk // 9
    ok = (chunk < ROWS * 9) & (tok < num_tokens)
    slot = tl.load(slots_ptr + tok, mask=ok, other=0).to(tl.int64)
    col = (chunk % 9) * 64
    src = src_ptr + tok.to(tl.int64) * (L * 576) + layer * 576 + col
    dst = dst_ptr + layer.to(tl.int64) * dst_stride_l + slot * 576 + col
    lane = tl.arange(0, 64)
    x = tl.load(src[:, None] + lane[None, :], mask=ok[:, None])
    tl.store(dst[:, None] + lane[None, :], x, mask=ok[:, None])


@triton.jit
def _rotate_rows(src, dst, ok, pos, cs_ptr, num_positions):  # type: ignore[no-untyped-def]
    """The rope part (64 dims, NeoX halves) of rows whose cos/sin rows are looked up at ``pos``."""
    pair = tl.arange(0, 32)
    pos_ok = ok & (pos >= 0) & (pos < num_positions)
    cs = cs_ptr + pos.to(tl.int64) * 64
    cos = tl.load(cs[:, None] + pair[None, :], mask=pos_ok[:, None], other=1.0)
    sin = tl.load(cs[:, None] + 32 + pair[None, :], mask=pos_ok[:, None], other=0.0)
    x1 = tl.load(src[:, None] + 512 + pair[None, :], mask=ok[:, None]).to(tl.float32)
    x2 = tl.load(src[:, None] + 544 + pair[None, :], mask=ok[:, None]).to(tl.float32)
    tl.store(dst[:, None] + 512 + pair[None, :], (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=ok[:, None])
    tl.store(dst[:, None] + 544 + pair[None, :], (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _copy_rotate(
    src_ptr,
    slots_ptr,
    dst_ptr,
    num_tokens,
    dst_stride_l,
    pos_ptr,
    cs_ptr,
    num_positions,
    L: tl.constexpr,
    ROWS: tl.constexpr,
):  # type: ignore[no-untyped-def]
    """As `_copy_rows`, the rope part rotated: a position load, then its cos/sin row, before that store."""
    tok, ok, src, dst = _block_rows(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L, ROWS)
    wide = tl.arange(0, 512)
    x = tl.load(src[:, None] + wide[None, :], mask=ok[:, None])
    pos = tl.load(pos_ptr + tok, mask=ok, other=0)
    _rotate_rows(src, dst, ok, pos, cs_ptr, num_positions)
    tl.store(dst[:, None] + wide[None, :], x, mask=ok[:, None])


def main() -> None:
    device = torch.device("cuda")
    roof = _bench.copy_roofline_gbps(device)
    print(f"copy: {roof:.0f} GB/s")
    case = _bench.MLA_POOL
    for num_tokens in (16384, 65536):
        nbytes = _bench.bytes_moved(case, num_tokens)
        sets = _bench.rotating_sets(nbytes)
        inputs = [_bench.make_inputs(case, num_tokens, device) for _ in range(sets)]
        for variant in ("random", "sorted", "positions < 64", "bf16 cos/sin"):
            # Each variant changes the bench's inputs in one way: the slots in order; positions
            # whose cos/sin rows stay in L2; the cos/sin cache in bf16 (half its bytes).
            if variant == "sorted":
                inputs = [dataclasses.replace(x, slots=x.slots.sort().values) for x in inputs]
            elif variant == "positions < 64":
                inputs = [
                    dataclasses.replace(
                        x, slots=x.slots[torch.randperm(num_tokens, device=device)], positions=x.positions % 64
                    )
                    for x in inputs
                ]
            elif variant == "bf16 cos/sin":
                positions = [torch.randint(0, x.cos_sin.shape[0], (num_tokens,), device=device) for x in inputs]
                inputs = [
                    dataclasses.replace(x, positions=p, cos_sin=x.cos_sin.bfloat16())
                    for x, p in zip(inputs, positions, strict=True)
                ]
            variants: dict[str, list[Callable[[], None]]] = {
                "typedkv": [_bench._mla_call(case, x) for x in inputs],
                "torch index_copy_": [_torch_copy(x) for x in inputs],
                "rows rows=2 warps=1": [_triton_copy(_copy_rows, x, 2, 1) for x in inputs],
                "chunks rows=3 warps=1": [_triton_copy(_copy_chunks, x, 3, 1) for x in inputs],
                "rotate rows=2 warps=1": [_triton_copy(_copy_rotate, x, 2, 1) for x in inputs],
            }
            for name, calls in variants.items():
                if name.startswith("rotate"):
                    _check_rotated(calls[0], inputs[0])
                elif name != "typedkv":
                    _check(calls[0], inputs[0])
                us = _bench.gpu_time_us(calls)
                print(
                    f"T={num_tokens:<6} {variant:<14} {name:<22} {us:8.1f} us  "
                    f"{100 * nbytes / us / 1e3 / roof:5.1f}% of copy",
                    flush=True,
                )
        del inputs
        torch.cuda.empty_cache()


def _rows_written(call: Callable[[], None], x: _bench.Inputs) -> torch.Tensor:
    """The pool rows ``x.slots`` name, ``[L, T, C+R]``, after one call into a zeroed pool."""
    pool = x.k_pool.view(x.k_pool.shape[0], -1, C_PLUS_R)
    pool.zero_()
    call()
    return pool[:, x.slots]


def _check(call: Callable[[], None], x: _bench.Inputs) -> None:
    """One call copies every (token, layer) row of ckv to its slot, bit for bit."""
    assert torch.equal(_rows_written(call, x), x.kv.transpose(0, 1)), "rows differ"


def _check_rotated(call: Callable[[], None], x: _bench.Inputs) -> None:
    """One call writes every row: the latent copied, the rope part rotated (NeoX halves)."""
    got = _rows_written(call, x)
    src = x.kv.transpose(0, 1)
    assert torch.equal(got[..., :512], src[..., :512]), "latent differs"
    cos, sin = x.cos_sin[x.positions, :32], x.cos_sin[x.positions, 32:]
    x1, x2 = src[..., 512:544].float(), src[..., 544:].float()
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(src.dtype)
    assert torch.allclose(got[..., 512:].float(), want.float(), atol=2e-2, rtol=2e-2), "rope part differs"


def _torch_copy(x: _bench.Inputs) -> Callable[[], None]:
    """Every (token, layer) row to its slot in one ``index_copy_``, ckv read front to back."""
    pool = x.k_pool
    layers, num_slots = pool.shape[0], pool.shape[1] * pool.shape[2]
    rows = pool.view(layers * num_slots, C_PLUS_R)
    index = (x.slots[:, None] + num_slots * torch.arange(layers, device=pool.device)[None, :]).reshape(-1)
    src = x.kv.reshape(-1, C_PLUS_R)

    def call() -> None:
        rows.index_copy_(0, index, src)

    return call


def _triton_copy(kernel: object, x: _bench.Inputs, rows: int, warps: int) -> Callable[[], None]:
    """One launch of a copy kernel above; `_copy_rotate` also takes the positions and the cos/sin cache."""
    pool = x.k_pool
    num_tokens, layers = x.kv.shape[0], x.kv.shape[1]
    grid = (triton.cdiv(num_tokens, rows) * layers,)
    jit: triton.JITFunction = kernel  # type: ignore[assignment]
    args: tuple[object, ...] = (x.kv, x.slots, pool, num_tokens, pool.stride(0))
    if kernel is _copy_rotate:
        args += (x.positions, x.cos_sin, x.cos_sin.shape[0])
    return lambda: jit[grid](*args, L=layers, ROWS=rows, num_warps=warps)


if __name__ == "__main__":
    main()
