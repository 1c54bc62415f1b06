"""Compile the warp-specialised projection kernel for sm_90 without a GPU (a developer script).

Not part of the package. Usage, with a Triton that has Gluon's 3.6 API on PYTHONPATH
(``pip install --target /tmp/v36 triton==3.6.0``)::

    PYTHONPATH=/tmp/v36:. python benchmarks/gluon_ws_compile.py [block_m=64 warps_m=4 warps_n=2 stages=4]

(the arguments: other tiles than `typedkv._fused_ws.WS_TILES`' last row, field by field).

Compiles `typedkv._fused_ws_kernel.project_kv_ws_kernel` as `typedkv._fused_ws` launches it
(the bench's shape: L = 5, H = 8, D = 128, bf16) for dense outputs and for pools (stacked or
per layer, pages of 1 / 16 / 64, per-layer eps or one), and prints for each: registers, spills,
shared memory, whether it is warp-specialised, and how many of its global stores are 16-byte
vectors. TTGIR and PTX go under /tmp/gluon_ws. Exit status 1 if any variant fails to compile.
"""

from __future__ import annotations

import re
import sys

import triton
from sm90_build import dump
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from typedkv import _fused_ws
from typedkv._fused_ws_kernel import project_kv_ws_kernel

HD = 8 * 128
DUMP = "/tmp/gluon_ws"
# The tiles: `_fused_ws.WS_TILES`' last row, fields overridden by arguments as ``block_m=64 warps_n=2``.
TILES = _fused_ws.WS_TILES[-1][1]._replace(**{k: int(v) for k, v in (a.split("=") for a in sys.argv[1:])})


def _desc(block: list[int]) -> str:
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=len(block))
    return f"tensordesc<bf16{block},{layout!r}>"


def _signature(pool: bool, eps_per_layer: bool, table: int) -> tuple[dict[str, str], dict[str, object]]:
    """Each argument's type as the launch gives it, and the constexprs (pointers left None are constexprs)."""
    names = list(project_kv_ws_kernel.arg_names)
    m, n, k = TILES.block_m, TILES.block_n, _fused_ws.BLOCK_K
    types: dict[str, str] = {
        "a_desc": _desc([m, k]),
        "w_desc": _desc([n, k]),
        "eps": "fp32",
        "eps_ptr": "*fp32",
        "weight_ptr": "*bf16",
        "positions_ptr": "*i64",
        "cos_sin_ptr": "*fp32",
    }
    const: dict[str, object] = {
        "HD": HD, "D": 128, "BM": m, "BN": n, "BK": k, "STAGES": TILES.stages, "GROUP_M": TILES.group_m,
        "GROUP_N": TILES.group_n, "LAST_MMA": TILES.last_in_mma,
        "WARPS_M": TILES.warps_m, "WARPS_N": TILES.warps_n, "NORM": True, "EPS_PER_LAYER": eps_per_layer,
        "POOL": pool, "PAGE": 1, "TABLE": table,
        # Ints equal to 1 are constants in Triton's launch (as `triton.compile` is not told here): the norm
        # weights' and cos/sin rows' column strides, a per-layer eps's stride, the layer table's.
        "weight_stride_d": 1, "stride_r": 1,
    }  # fmt: skip
    if eps_per_layer:
        const["eps_stride"] = 1
    if pool:
        const.update(k_desc=None, v_desc=None)
        types.update(k_ptr="*bf16", v_ptr="*bf16", slots_ptr="*i64")
        if table:
            types["offsets_ptr"] = "*i64"
            const["offsets_stride_layer"] = 1
        else:
            const["offsets_ptr"] = None
    else:
        types.update(k_desc=_desc([1, m, n]), v_desc=_desc([1, m, n]))
        const.update(k_ptr=None, v_ptr=None, offsets_ptr=None, slots_ptr=None)
    signature = {name: "constexpr" if name in const else types.get(name, "i32") for name in names}
    return signature, const


def compile_one(label: str, pool: bool, eps_per_layer: bool, table: int, page: int) -> bool:
    signature, const = _signature(pool, eps_per_layer, table)
    const["PAGE"] = page
    names = list(project_kv_ws_kernel.arg_names)
    # As Triton specialises a launch: pointers on 16 bytes, ints (but the per-call ones) divisible by 16
    # (and those equal to 1 constants, above).
    per_call = (
        set(project_kv_ws_kernel.do_not_specialize) if hasattr(project_kv_ws_kernel, "do_not_specialize") else set()
    )
    divisible = [
        name for name, kind in signature.items()
        if kind.startswith("*") or (kind == "i32" and name not in per_call and not name.endswith("stride_d")
                                    and name not in ("num_rows", "num_positions", "tiles_n", "k_steps"))
    ]  # fmt: skip
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    src = GluonASTSource(
        fn=project_kv_ws_kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in const.items()},
        attrs=attrs,
    )
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": TILES.num_warps})
    except Exception as e:  # a variant that does not compile
        print(f"{label:<34} FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
        return False
    built = dump(kernel, DUMP, label)
    ttgir, ptx = built.ttgir, built.ptx
    stores = re.findall(r"st\.global(?:\.\w+)*?(\.v[248])?\.(?:b|u|f)(\d+)", ptx)
    wide = sum(1 for vec, bits in stores if vec and int(vec[2:]) * int(bits) == 128)
    print(
        f"{label:<34} ok  regs {built.regs}  local {built.local}  stack {built.stack}  "
        f"shared {kernel.metadata.shared / 1024:.1f} KB  warp_specialize {'ttg.warp_specialize' in ttgir}  "
        f"global stores {len(stores)} ({wide} of 16 bytes)  TMA copies {ptx.count('cp.async.bulk.tensor')}",
        flush=True,
    )
    return True


def main() -> int:
    variants = [("dense", False, False, 0, 1), ("dense_eps_per_layer", False, True, 0, 1)]
    for page in (1, 16, 64):
        variants.append((f"pool_stacked_page{page}", True, False, 0, page))
        variants.append((f"pool_per_layer_page{page}", True, False, 8, page))
    variants.append(("pool_per_layer_unaligned", True, False, 1, 16))
    ok = [compile_one(*v) for v in variants]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
