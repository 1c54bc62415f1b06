"""The MLA kernel compiles for Hopper (sm_90) without a GPU, with the latent moved in 16-byte vectors.

Triton compiles ahead of time for a named target with its bundled ``ptxas``, so a
kernel that only the GPU compiler rejects fails here, in the CPU suite, before a
device run. The divisibility hints are those Triton derives on the GPU for
16-byte aligned tensors with the bench's strides.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import triton

from typedkv.core import launcher
from typedkv.mla import kernel as mla_kernel

pytestmark = pytest.mark.skipif(launcher.INTERPRETED, reason="the interpreter runs the kernel's Python, not a compiler")

_DIVISIBLE = (
    "ckv_stride_t",
    "ckv_stride_l",
    "dst_stride_page",
    "dst_stride_slot",
    "weight_stride_l",
    "cos_sin_stride_p",
)
_UNIT = ("weight_stride_d", "cos_sin_stride_r", "positions_stride", "slots_stride", "eps_stride")
# The FP8 scale is one tuple argument, (tensor, its stride, float): its leaves typed one by one,
# the stride a unit one, as Triton specialises a contiguous [L] scale.
_SCALE = ("*fp32", "constexpr", "fp32")


def compile_for_hopper(*, dtype: str = "bf16", dst: str = "bf16", scale: int = 0, **constexprs: Any) -> str:
    """The kernel's PTX for sm_90, one configuration (the MLA bench case's by default)."""
    # Triton's compiler API, untyped in stubs/ (typedkv itself never calls it).
    compiler: Any = importlib.import_module("triton.compiler")
    backends: Any = importlib.import_module("triton.backends.compiler")
    kernel = mla_kernel.materialize_mla_kv_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    fp8 = {"fp8e4nv": (448.0, 3, -6), "fp8e5": (57344.0, 2, -14)}.get(dst, (0.0, 0, 0))
    const = {
        "C": 512, "R": 64, "NEOX": False, "NORM": True, "EPS_PER_LAYER": True, "INDEXED": True, "PAGE": 64,
        "LAYER_TABLE": False, "SCALE": scale, "DS_MLA": False, "FP8_MAX": fp8[0], "FP8_MANT": fp8[1], "FP8_MIN_EXP": fp8[2],
        "LAYER_VEC": 16, "BLOCK_T": 4, "BLOCK_C": 512, "BLOCK_HALF": 32, "SOFT_ROUND": False, "NUM_LAYERS": 5,
        "WIDE": False, **dict.fromkeys(_UNIT, 1), **constexprs,
    }  # fmt: skip
    pointers = {
        "ckv_ptr": f"*{dtype}", "dst_ptr": f"*{dst}", "positions_ptr": "*i64", "slots_ptr": "*i64",
        "layer_offsets_ptr": "*i64",
    }  # fmt: skip
    signature: dict[str, Any] = {
        n: "constexpr"
        if n in const
        else _SCALE
        if n == "kv_scale"
        else pointers.get(n, "*fp32" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32")
        for n in names
    }
    hints = [(names.index(n),) for n in names if n.endswith("_ptr") or n in _DIVISIBLE]
    scale_at = names.index("kv_scale")
    try:
        source = compiler.ASTSource(
            fn=kernel,
            signature=signature,
            constexprs={(names.index(n),): v for n, v in const.items()} | {(scale_at, 1): 1},
            attrs={path: [["tt.divisibility", 16]] for path in [*hints, (scale_at, 0)]},
        )
    except TypeError as err:  # the ahead-of-time API's shape moves between Triton releases
        pytest.skip(f"Triton {triton.__version__}'s ASTSource takes other arguments: {err}")
    compiled = compiler.compile(source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return str(compiled.asm["ptx"])


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"NEOX": True},
        {"NORM": False, "INDEXED": False, "PAGE": 1},
        {"LAYER_TABLE": 8, "EPS_PER_LAYER": False},
        {"LAYER_TABLE": 1},
        {"dst": "fp8e4nv", "scale": 2},
        {"dst": "fp8e5", "scale": 1, "NEOX": True},
        {"dst": "fp8e4nv", "scale": 1, "DS_MLA": True},
        {"dst": "fp8e4nv", "scale": 1, "DS_MLA": True, "NORM": False, "NEOX": True, "LAYER_TABLE": 16},
        {"dtype": "fp16", "dst": "fp16", "C": 96, "BLOCK_C": 128, "R": 32, "BLOCK_HALF": 16},
        {"dtype": "fp32", "dst": "fp32", "C": 0, "BLOCK_C": 1, "R": 16, "BLOCK_HALF": 8, "NORM": False},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "bench",
)
def test_compiles_for_hopper(config: dict[str, Any]) -> None:
    pytest.importorskip("triton.backends.nvidia")
    ptx = compile_for_hopper(**config)
    assert ".entry materialize_mla_kv_kernel" in ptx
    if config.get("dtype", "bf16") == "bf16":
        # The latent row, 16 bytes a thread at a time.
        assert "ld.global.v4" in ptx
        if "scale" not in config and config.get("LAYER_TABLE") != 1:
            assert "st.global.v4" in ptx


def test_ds_mla_divides_once_a_tile() -> None:
    """fp8_ds_mla's values are divided by their tile's scale as one reciprocal a tile and fused multiply-adds
    (`typedkv.mla.kernel._quotient`), not a division an element (a special-function unit's reciprocal each)."""
    pytest.importorskip("triton.backends.nvidia")
    ptx = compile_for_hopper(dst="fp8e4nv", scale=1, DS_MLA=True)
    assert ptx.count("div.rn.f32") <= 4 and "fma.rn.f32" in ptx
