"""Whether this Triton compiles a GEMM tile for a cluster of CTAs on sm_90, and with TMA multicast (no GPU needed).

Not part of the package. Usage (without TRITON_INTERPRET)::

    python benchmarks/cluster_compile_probe.py                    # the installed Triton (3.9 on the CPU machine)
    PYTHONPATH=/tmp/v36 python benchmarks/cluster_compile_probe.py  # Triton 3.6, the GPU machine's

cuBLAS runs the bench's GEMM at T = 256-2048 in clusters of two CTAs whose weight tile is loaded
once and multicast to both (docs/performance.md, "What cuBLAS runs"); our reading (not a
measurement) is that a fused kernel needs the same to reach it there. This compiles one
256 x 128 x 4096 bf16 tile (8 warps, 3 stages), its operands loaded by pointer and by tensor descriptor, for one CTA and for clusters of two
(``num_ctas``), and prints for each whether it compiled, whether its PTX holds a multicast copy
(``.multicast::cluster``) and how many wgmma it issues. Where Gluon's TMA load takes
``multicast`` (``tma.async_load(..., multicast=True)``), a copy of one weight tile through it is
compiled for a cluster of two (`gluon_multicast`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

import triton
import triton.language as tl

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
except ImportError:  # no Gluon in this Triton
    gluon = None

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("cluster_compile_probe.py compiles kernels: run it without TRITON_INTERPRET=1")

BM, BN, BK, HIDDEN = 256, 128, 64, 4096


@triton.jit
def _tile_by_pointer(a_ptr, b_ptr, c_ptr, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=3):
        a = tl.load(a_ptr + rows[:, None] * K + (k + ks)[None, :])
        b = tl.load(b_ptr + cols[:, None] * K + (k + ks)[None, :])
        acc = tl.dot(a, b.T, acc)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def _tile_by_descriptor(
    a_ptr, b_ptr, c_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=3):
        a = a_desc.load([tl.program_id(0) * BM, k])
        b = b_desc.load([tl.program_id(1) * BN, k])
        acc = tl.dot(a, b.T, acc)
    c_desc.store([tl.program_id(0) * BM, tl.program_id(1) * BN], acc.to(tl.bfloat16))


if gluon is not None:

    @gluon.jit
    def _tile_copy(w_desc, o_desc, BN: gl.constexpr, BK: gl.constexpr, CGA: gl.constexpr):
        # The tile alike in every CTA of the cluster (`gluon_multicast`); Gluon 3.9's API (3.6's lacks `async_load`).
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=CGA)
        tile = gl.allocate_shared_memory(gl.bfloat16, [BN, BK], layout)
        bar = mbarrier.allocate_mbarrier()
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, BN * BK * 2)
        tma.async_load(w_desc, [gl.program_id(1) * BN, 0], bar, tile, multicast=True)
        mbarrier.wait(bar, 0)
        tma.async_store(o_desc, [gl.program_id(0) * BN, 0], tile)
        tma.store_wait(0)


def compile_tile(kernel: Any, num_ctas: int) -> str:
    """One line: the kernel compiled for sm_90 with ``num_ctas`` CTAs a cluster, or why it did not."""
    compiler: Any = importlib.import_module("triton.compiler")
    backends: Any = importlib.import_module("triton.backends.compiler")
    signature = {name: "*bf16" if name.endswith("_ptr") else "i32" for name in ("a_ptr", "b_ptr", "c_ptr", "M", "N")}
    if "M" not in inspect.signature(kernel.fn).parameters:
        del signature["M"]
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    source = compiler.ASTSource(
        fn=kernel, signature=signature, constexprs={"K": HIDDEN, "BM": BM, "BN": BN, "BK": BK}, attrs=aligned
    )
    try:
        compiled = compiler.compile(
            source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_ctas": num_ctas}
        )
    except Exception as error:  # a failed lowering is the answer here, not a crash of the probe
        return f"does not compile ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
    ptx = str(compiled.asm["ptx"])
    return f"compiles; multicast copies: {'.multicast::cluster' in ptx}; wgmma: {ptx.count('wgmma.mma_async')}"


def gluon_multicast() -> str:
    """Whether Gluon's Hopper TMA load takes ``multicast``, and where it does, what a cluster of two makes of it.

    `_tile_copy` loads one weight tile (64 x 64 bf16) into shared memory laid out alike in both CTAs of the
    cluster (``cga_layout`` ``[[0, 0]]``: the CTA bit moves no element) with ``multicast=True``, waits on its
    mbarrier and stores the tile back: whether the PTX's TMA load is a multicast copy to the cluster.
    """
    if gluon is None:
        return "no Gluon"
    load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    if load is None or "multicast" not in inspect.signature(load).parameters:
        return "its TMA load takes no multicast argument"
    runtime = importlib.import_module("triton.experimental.gluon._runtime")
    compiler: Any = importlib.import_module("triton.compiler")
    backends: Any = importlib.import_module("triton.backends.compiler")
    broadcast = [[0, 0]]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=broadcast)
    desc = f"tensordesc<bf16[{BN // 2}, {BK}],{layout!r}>"
    signature = {"w_desc": desc, "o_desc": desc, "BN": "constexpr", "BK": "constexpr", "CGA": "constexpr"}
    constexprs = {(2,): BN // 2, (3,): BK, (4,): broadcast}
    source = runtime.GluonASTSource(fn=_tile_copy, signature=signature, constexprs=constexprs, attrs={})
    try:
        compiled = compiler.compile(
            source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2}
        )
    except Exception as error:  # a failed lowering is the answer here
        return f"{load.__name__} takes multicast; a cluster of two does not compile ({type(error).__name__})"
    ptx = str(compiled.asm["ptx"])
    return f"{load.__name__} takes multicast; in a cluster of two its PTX multicasts: {'.multicast::cluster' in ptx}"


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, a {BM} x {BN} x {HIDDEN} bf16 tile")
    for name, kernel in (("by pointer", _tile_by_pointer), ("by descriptor", _tile_by_descriptor)):
        for num_ctas in (1, 2):
            print(f"{name}, {num_ctas} CTA a cluster: {compile_tile(kernel, num_ctas)}")
    print(f"Gluon: {gluon_multicast()}")


if __name__ == "__main__":
    main()
