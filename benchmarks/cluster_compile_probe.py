"""Whether this Triton compiles a GEMM tile for a cluster of CTAs on sm_90, and with TMA multicast (no GPU needed).

Not part of the package. Usage (without TRITON_INTERPRET)::

    python benchmarks/cluster_compile_probe.py                    # the installed Triton (3.9 on the CPU machine)
    PYTHONPATH=/tmp/v36 python benchmarks/cluster_compile_probe.py  # Triton 3.6, the GPU machine's

cuBLAS runs the bench's GEMM at T = 256-2048 in clusters of two CTAs whose weight tile is loaded
once and multicast to both (docs/performance.md, "What cuBLAS runs"); a fused kernel would need
the same to reach it there. This compiles one 256 x 128 x 4096 bf16 tile (8 warps, 3 stages),
its operands loaded by pointer and by tensor descriptor, for one CTA and for clusters of two
(``num_ctas``), and prints for each whether it compiled, whether its PTX holds a multicast copy
(``.multicast::cluster``) and how many wgmma it issues. Gluon's explicit multicast
(``tma.async_load(..., multicast=True)``) is reported as present in the API or not.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

import triton
import triton.language as tl

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
    """Whether Gluon's Hopper TMA load takes a ``multicast`` argument in this Triton."""
    try:
        tma = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper.tma")
    except ImportError:
        return "no Gluon"
    load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    if load is None:
        return "no TMA load found"
    return f"{load.__name__} takes multicast: {'multicast' in inspect.signature(load).parameters}"


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, a {BM} x {BN} x {HIDDEN} bf16 tile")
    for name, kernel in (("by pointer", _tile_by_pointer), ("by descriptor", _tile_by_descriptor)):
        for num_ctas in (1, 2):
            print(f"{name}, {num_ctas} CTA a cluster: {compile_tile(kernel, num_ctas)}")
    print(f"Gluon: {gluon_multicast()}")


if __name__ == "__main__":
    main()
