"""Developer script for the H200: how fast can the MLA pool case's rows be scattered at all?

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/scatter_bound.py``. The
bench's MLA pages-of-64 case (L = 5 rows of C + R = 576 bf16 per token, sent to random slots of a
pool of 2T slots, as ``typedkv bench`` draws them) is timed in one process, as the bench times
(CUDA-graph replays over rotating inputs), beside copies of the same bytes with no math at all:

- ``typedkv``: the MLA kernel through the public op (the bench's figure);
- ``torch``: one ``index_copy_`` of every (token, layer) row into the pool viewed as rows;
- ``copy rows=N warps=W``: a minimal Triton kernel reading N tokens' rows of one layer and
  storing them to their slots (typedkv's program shape without the norm and the rotation),
  with the row as 512 + 64 columns (as typedkv loads it) or as 128-byte chunks;
- each again with the slots sorted (the same rows, destinations in order): the dense bound.

Printed as % of the copy roofline measured in the same run. Results feed benchmarks/NOTES.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from typedkv import _bench

C_PLUS_R = 576


@triton.jit
def _copy_rows(src_ptr, slots_ptr, dst_ptr, num_tokens, dst_stride_l, L: tl.constexpr, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]
    """ROWS tokens' rows of one layer to their slots, as 512 + 64 columns."""
    pid = tl.program_id(0)
    layer = pid % L
    tok = (pid // L) * ROWS + tl.arange(0, ROWS)
    ok = tok < num_tokens
    slot = tl.load(slots_ptr + tok, mask=ok, other=0).to(tl.int64)
    src = src_ptr + tok.to(tl.int64) * (L * 576) + layer * 576
    dst = dst_ptr + layer.to(tl.int64) * dst_stride_l + slot * 576
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


def main() -> None:
    device = torch.device("cuda")
    roof = _bench.copy_roofline_gbps(device)
    print(f"copy: {roof:.0f} GB/s")
    case = _bench.MLA_POOL
    for num_tokens in (16384, 65536):
        nbytes = _bench.bytes_moved(case, num_tokens)
        sets = max(1, min(64, math.ceil(_bench._L2_SPAN / nbytes)))
        inputs = [_bench.make_inputs(case, num_tokens, device) for _ in range(sets)]
        for order in ("random", "sorted"):
            if order == "sorted":
                inputs = [dataclasses.replace(x, slots=x.slots.sort().values) for x in inputs]
            variants: dict[str, list[Callable[[], None]]] = {
                "typedkv": [_bench._mla_call(case, x) for x in inputs],
                "torch index_copy_": [_torch_copy(x) for x in inputs],
            }
            for kernel, rows, warps in (
                (_copy_rows, 2, 1), (_copy_rows, 2, 2), (_copy_rows, 4, 2), (_copy_rows, 4, 4), (_copy_rows, 1, 1),
                (_copy_chunks, 3, 1), (_copy_chunks, 7, 2), (_copy_chunks, 7, 4), (_copy_chunks, 14, 4),
            ):  # fmt: skip
                name = f"{'rows' if kernel is _copy_rows else 'chunks'} rows={rows} warps={warps}"
                variants[name] = [_triton_copy(kernel, x, rows, warps) for x in inputs]
            for name, calls in variants.items():
                if name != "typedkv":
                    _check(calls[0], inputs[0])
                us = _bench.gpu_time_us(calls)
                print(
                    f"T={num_tokens:<6} {order:<6} {name:<26} {us:8.1f} us  {100 * nbytes / us / 1e3 / roof:5.1f}% of copy",
                    flush=True,
                )
        del inputs
        torch.cuda.empty_cache()


def _check(call: Callable[[], None], x: _bench.Inputs) -> None:
    """One call copies every (token, layer) row of ckv to its slot, bit for bit."""
    pool = x.k_pool.view(x.k_pool.shape[0], -1, C_PLUS_R)
    pool.zero_()
    call()
    assert torch.equal(pool[:, x.slots], x.kv.transpose(0, 1)), "rows differ"


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
    pool = x.k_pool
    num_tokens, layers = x.kv.shape[0], x.kv.shape[1]
    grid = (triton.cdiv(num_tokens, rows) * layers,)
    jit: triton.JITFunction = kernel  # type: ignore[assignment]
    return lambda: jit[grid](x.kv, x.slots, pool, num_tokens, pool.stride(0), L=layers, ROWS=rows, num_warps=warps)


if __name__ == "__main__":
    main()
