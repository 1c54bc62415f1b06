"""The PTX that the kernels compile to for Hopper (sm_90), for many real launches, without a GPU.

A refactor of a kernel that must not change its speed (grouped arguments,
shared `@triton.jit` pieces, renamed locals) is checked here first: compile
before and after, compare. Identical PTX runs identically; a difference is
worth a GPU A/B (benchmarks/ab_time.py) before it lands.

Each case is a public call on small CPU tensors; the launch it would make on a
GPU (grid, every kernel argument, warps) is captured instead of run, and
compiled ahead of time for sm_90 with the specialisation Triton's launcher
would apply (ints equal to 1 become constants, multiples of 16 and 16-byte
aligned pointers get divisibility hints). `.loc`/`.file` lines and debug
sections are dropped, so moving code between functions or files does not count
as a difference.

    python benchmarks/ptx_snapshot.py /tmp/before      # on the old code
    python benchmarks/ptx_snapshot.py /tmp/after       # on the new code
    diff -r /tmp/before /tmp/after                      # nothing: the same machine code

With ``--hopper`` the fused projection's launches are those of an H200 (weight tiles by TMA,
deeper pipelines): the configurations it runs up to T = 256 there.

Run it without TRITON_INTERPRET (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("ptx_snapshot.py compiles kernels: run it without TRITON_INTERPRET=1")

import typedkv
from typedkv.core import launcher
from typedkv.projection import launch as fused_launch

_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}

Captured = tuple[Any, tuple[int, int, int], tuple[Any, ...], int]


def capture(call: Callable[[], object]) -> list[Captured]:
    """The launches ``call`` makes, as ``(kernel, grid, arguments, num_warps)``, none of them run."""
    seen: list[Captured] = []
    use_kernel, run = launcher.use_kernel, launcher.KernelLaunch.__call__

    def record(self: Any, values: tuple[Any, ...], after_gemm: bool = False) -> None:
        seen.append((self.kernel, self.grid, self.arguments(values), self.num_warps))

    launcher.use_kernel = lambda device: True  # type: ignore[assignment]
    launcher.KernelLaunch.__call__ = record  # type: ignore[method-assign]
    try:
        call()
    finally:
        launcher.use_kernel = use_kernel  # type: ignore[assignment]
        launcher.KernelLaunch.__call__ = run  # type: ignore[method-assign]
    return seen


def compile_ptx(kernel: Any, params: tuple[Any, ...], num_warps: int) -> str:
    """``kernel``'s PTX for sm_90 with ``params`` specialised as Triton's launcher would."""
    compiler: Any = importlib.import_module("triton.compiler")
    backends: Any = importlib.import_module("triton.backends.compiler")
    names = list(inspect.signature(kernel.fn).parameters)
    constexpr_at = launcher._constexpr_indices(kernel)
    unspecialised = set(getattr(kernel, "do_not_specialize", ()) or ())
    signature: dict[str, Any] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}

    def describe(path: tuple[int, ...], name: str, value: Any, free: bool) -> Any:
        """Triton's type of one argument (a tuple's, by its leaves), recording constexprs and attributes."""
        if isinstance(value, tuple):
            return tuple(describe((*path, j), name, item, free) for j, item in enumerate(value))
        if value is None or (isinstance(value, int) and value == 1 and free):
            constexprs[path] = value
            return "constexpr"
        if isinstance(value, torch.Tensor):
            attrs[path] = [["tt.divisibility", 16]]
            return "*" + _TYPES[value.dtype]
        if type(value).__name__ == "TensorDescriptor":  # the weight's TMA tiles (`weight_descriptors`)
            return f"tensordesc<{_TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            if free and value % 16 == 0:
                attrs[path] = [["tt.divisibility", 16]]
            return "i32" if -(2**31) <= value < 2**31 else "i64"
        if isinstance(value, float):
            return "fp32"
        raise TypeError(f"{name}: no Triton type for {value!r}")

    for i, (name, value) in enumerate(zip(names, params, strict=True)):
        if i in constexpr_at:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[name] = describe((i,), name, value, name not in unspecialised and i not in unspecialised)
    source = compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = compiler.compile(source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return normalise(str(compiled.asm["ptx"]))


def normalise(ptx: str) -> str:
    """PTX without source locations and debug sections (moved code compiles alike)."""
    kept = []
    skipping = False
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            skipping = True
        if skipping:
            if stripped == "}":
                skipping = False
            continue
        # Source locations, and the labels that only debug information refers to.
        if stripped.startswith((".loc", ".file")) or re.fullmatch(r"\$L__tmp\d+:", stripped):
            continue
        kept.append(re.sub(r"\s+//.*$", "", line))
    return "\n".join(kept) + "\n"


def _kv(t: int, layers: int, heads: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(t, layers, 2 * heads * dim).to(dtype)


def cases() -> dict[str, Callable[[], object]]:
    """Public calls covering the kernels' compile-time branches."""
    out: dict[str, Callable[[], object]] = {}
    for t in (16, 8192):
        for rope_style in ("neox", "gptj"):
            for rotary in (128, 64):
                out[f"dense-T{t}-{rope_style}-R{rotary}"] = _dense(t, 5, 8, 128, rotary, rope_style)
        out[f"dense-T{t}-ropeonly"] = _dense(t, 5, 8, 128, 128, "neox", norm=False)
        out[f"dense-T{t}-eps-per-layer"] = _dense(t, 5, 8, 128, 128, "neox", eps=[1e-6, 1e-5, 1e-6, 1e-5, 1e-6])
        out[f"dense-T{t}-fp16-D64"] = _dense(t, 2, 4, 64, 64, "neox", dtype=torch.float16)
        out[f"dense-T{t}-D256-R64"] = _dense(t, 2, 8, 256, 64, "neox")
        out[f"dense-T{t}-L1"] = _dense(t, 1, 8, 128, 128, "neox")
        for layout in ("flat", "NHD16", "HND16", "NHD64", "list", "list-NHD16"):
            for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                for scale in (None, "float", "tensor") if pool_dtype != torch.bfloat16 else (None,):
                    name = f"pool-T{t}-{layout}-{_TYPES[pool_dtype]}" + (f"-{scale}" if scale else "")
                    out[name] = _pool(t, layout, pool_dtype, scale)
        # Scales written per row (k_scale_out, v_scale_out): FP8 and int8 pools.
        for layout in ("flat", "NHD16", "HND16", "list", "list-NHD16"):
            for pool_dtype in (torch.int8, torch.float8_e4m3fn):
                out[f"pool-T{t}-{layout}-{_TYPES[pool_dtype]}-written"] = _pool(t, layout, pool_dtype, "written")
        out[f"pool-T{t}-flat-i8-written-gptj-R64"] = _pool(t, "flat", torch.int8, "written", "gptj", 64)
        out[f"pool-T{t}-flat-fp8e4nv-written-R64"] = _pool(t, "flat", torch.float8_e4m3fn, "written", rotary=64)
        for layout in ("dense", "flat", "paged64", "list", "singleton"):
            # uint8: DeepSeek's FP8 rows (cache_format="fp8_ds_mla").
            for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
                if layout == "dense" and pool_dtype != torch.bfloat16:
                    continue
                out[f"mla-T{t}-{layout}-{_TYPES[pool_dtype]}"] = _mla(t, layout, pool_dtype)
    # The projection fused with K/V (KVMaterializer.projection_path = "fused").
    for t in (16, 8192):
        for rope_style in ("neox", "gptj"):
            for rotary in (128, 64):
                out[f"fused-T{t}-dense-{rope_style}-R{rotary}"] = _fused(t, rotary=rotary, rope_style=rope_style)
        out[f"fused-T{t}-dense-ropeonly-bias"] = _fused(t, norm=False, bias=True)
        out[f"fused-T{t}-dense-eps-per-layer"] = _fused(t, eps=[1e-6, 1e-5, 1e-6, 1e-5, 1e-6])
        out[f"fused-T{t}-dense-fp16-D64-hidden1000"] = _fused(t, dim=64, rotary=64, hidden=1000, dtype=torch.float16)
        out[f"fused-T{t}-dense-fp32"] = _fused(t, dtype=torch.float32)
        out[f"fused-T{t}-dense-D256-R64"] = _fused(t, dim=256, rotary=64)
        for layout in ("flat", "NHD16", "HND16", "list"):
            for pool_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                for scale in (None, "float", "tensor") if pool_dtype != torch.bfloat16 else (None,):
                    name = f"fused-T{t}-{layout}-{_TYPES[pool_dtype]}" + (f"-{scale}" if scale else "")
                    out[name] = _fused(t, pool=_pool_alloc(t, layout, pool_dtype, scale))
        for layout in ("flat", "HND16", "list"):
            for pool_dtype in (torch.int8, torch.float8_e4m3fn):
                name = f"fused-T{t}-{layout}-{_TYPES[pool_dtype]}-written"
                out[name] = _fused(t, pool=_pool_alloc(t, layout, pool_dtype, "written"))
        out[f"fused-T{t}-flat-i8-written-R64"] = _fused(
            t, rotary=64, pool=_pool_alloc(t, "flat", torch.int8, "written")
        )
    # V normed as K (v_norm_weight) and a RoPE table per layer ([L, P, R]): their own compiled kernels.
    for t in (16, 8192):
        out[f"dense-T{t}-vnorm"] = _dense(t, 5, 8, 128, 128, "neox", v_norm=True)
        out[f"dense-T{t}-R64-layer-tables"] = _dense(t, 5, 8, 128, 64, "neox", per_layer=True)
        out[f"dense-T{t}-gptj-vnorm-layer-tables"] = _dense(t, 5, 8, 128, 128, "gptj", v_norm=True, per_layer=True)
        out[f"pool-T{t}-NHD16-fp8e4nv-tensor-vnorm"] = _pool(t, "NHD16", torch.float8_e4m3fn, "tensor", v_norm=True)
        out[f"mla-T{t}-flat-bf16-layer-tables"] = _mla(t, "flat", torch.bfloat16, per_layer=True)
        out[f"fused-T{t}-dense-vnorm-layer-tables"] = _fused(t, rotary=64, v_norm=True, per_layer=True)
        out[f"fused-T{t}-flat-fp8e4nv-float-vnorm"] = _fused(
            t, v_norm=True, pool=_pool_alloc(t, "flat", torch.float8_e4m3fn, "float")
        )
        # With scales written per row: V normed, then quantized per row; a RoPE table per layer.
        out[f"pool-T{t}-NHD16-i8-written-vnorm"] = _pool(t, "NHD16", torch.int8, "written", v_norm=True)
        out[f"pool-T{t}-list-fp8e4nv-written-layer-tables"] = _pool(
            t, "list", torch.float8_e4m3fn, "written", per_layer=True
        )
        out[f"fused-T{t}-flat-i8-written-vnorm-layer-tables"] = _fused(
            t, v_norm=True, per_layer=True, pool=_pool_alloc(t, "flat", torch.int8, "written")
        )
    return out


def _tables(rotary: int, dtype: torch.dtype = torch.float32, layers: int = 0) -> torch.Tensor:
    """A cos/sin cache of 4096 positions: one table, or one per layer (``layers``)."""
    return torch.randn(*((layers,) if layers else ()), 4096, rotary).to(dtype)


def _dense(
    t: int,
    layers: int,
    heads: int,
    dim: int,
    rotary: int,
    rope_style: str,
    *,
    norm: bool = True,
    eps: Any = 1e-6,
    dtype: torch.dtype = torch.bfloat16,
    v_norm: bool = False,
    per_layer: bool = False,
) -> Callable[[], object]:
    def call() -> object:
        kv = _kv(t, layers, heads, dim, dtype)
        weight = torch.randn(layers, dim).to(dtype) if norm else None
        positions = torch.randint(0, 4096, (t,))
        return typedkv.materialize_kv(
            kv, weight, eps, _tables(rotary, layers=layers if per_layer else 0), positions, num_kv_heads=heads,
            rope_style=rope_style, v_norm_weight=torch.randn(layers, dim) if v_norm else None,
        )  # fmt: skip

    return call


def _pool(
    t: int,
    layout: str,
    dtype: torch.dtype,
    scale: str | None,
    rope_style: str = "neox",
    rotary: int = 128,
    *,
    v_norm: bool = False,
    per_layer: bool = False,
) -> Callable[[], object]:
    layers, heads, dim = 5, 8, 128
    pools = _pool_alloc(t, layout, dtype, scale)

    def call() -> object:
        k_pool, v_pool, kv_layout, slots, scales = pools()
        return typedkv.materialize_kv_into_pool(
            _kv(t, layers, heads, dim),
            torch.randn(layers, dim).to(torch.bfloat16),
            1e-6,
            _tables(rotary, layers=layers if per_layer else 0),
            torch.randint(0, 4096, (t,)),
            torch.randperm(slots)[:t],
            k_pool,
            v_pool,
            num_kv_heads=heads,
            rope_style=rope_style,
            kv_layout=kv_layout,
            v_norm_weight=torch.randn(layers, dim) if v_norm else None,
            **scales,
        )

    return call


Pools = Callable[[], tuple[Any, Any, "str | None", int, dict[str, Any]]]


def _pool_alloc(t: int, layout: str, dtype: torch.dtype, scale: str | None) -> Pools:
    """``(k_pool, v_pool, kv_layout, slots, scales)`` of a pool of 5 layers, 8 heads of 128, ``t + 64`` slots."""
    layers, heads, dim, slots = 5, 8, 128, t + 64

    def alloc() -> tuple[Any, Any, str | None]:
        if layout == "flat":
            return torch.empty(layers, slots, heads, dim, dtype=dtype), None, None
        if layout.startswith(("NHD", "HND")):
            page = int(layout[3:])
            pages = -(-slots // page)
            shape = (layers, pages, page, heads, dim) if layout[:3] == "NHD" else (layers, pages, heads, page, dim)
            return torch.empty(shape, dtype=dtype), None, layout[:3]
        page = int(layout[8:]) if "NHD" in layout else 0
        shape = (-(-slots // page), page, heads, dim) if page else (slots, heads, dim)
        return [torch.empty(shape, dtype=dtype) for _ in range(layers)], None, "NHD" if page else None

    def pools() -> tuple[Any, Any, str | None, int, dict[str, Any]]:
        k_pool, _, kv_layout = alloc()
        v_pool, _, _ = alloc()
        scales: dict[str, Any] = {}
        if scale == "float":
            scales = {"k_scale": 0.5, "v_scale": 2.0}
        elif scale == "tensor":
            scales = {"k_scale": torch.rand(layers) + 0.5, "v_scale": torch.rand(layers) + 0.5}
        elif scale == "written":  # float32, the pools' shape without their last dim
            scales = {name: _rows_of(pool) for name, pool in (("k_scale_out", k_pool), ("v_scale_out", v_pool))}
        return k_pool, v_pool, kv_layout, slots, scales

    return pools


def _rows_of(pool: Any) -> Any:
    """A float32 tensor (or per-layer tensors) with one element per row of ``pool``."""
    if isinstance(pool, torch.Tensor):
        return torch.empty(pool.shape[:-1])
    return [torch.empty(layer.shape[:-1]) for layer in pool]


def _fused(
    t: int,
    *,
    dim: int = 128,
    rotary: int = 128,
    rope_style: str = "neox",
    norm: bool = True,
    bias: bool = False,
    eps: Any = 1e-6,
    hidden: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    pool: Pools | None = None,
    v_norm: bool = False,
    per_layer: bool = False,
) -> Callable[[], object]:
    """A `KVMaterializer` call (5 layers, 8 heads) with the fused projection pinned: dense, or into ``pool``."""
    layers, heads = 5, 8

    def call() -> object:
        m = typedkv.KVMaterializer(
            torch.randn(layers, 2 * heads * dim, hidden).to(dtype),
            torch.randn(layers, dim).to(dtype) if norm else None,
            eps,
            _tables(rotary, layers=layers if per_layer else 0),
            num_kv_heads=heads,
            rope_style=rope_style,  # type: ignore[arg-type]
            kv_bias=torch.randn(layers, 2 * heads * dim).to(dtype) if bias else None,
            v_norm_weight=torch.randn(layers, dim).to(dtype) if v_norm else None,
        )
        m.projection_path = "fused"
        x, positions = torch.randn(t, hidden).to(dtype), torch.randint(0, 4096, (t,))
        if pool is None:
            return m(x, positions)
        k_pool, v_pool, kv_layout, slots, scales = pool()
        return m.into_pool(x, positions, torch.randperm(slots)[:t], k_pool, v_pool, kv_layout=kv_layout, **scales)

    return call


def _mla(t: int, layout: str, dtype: torch.dtype, *, per_layer: bool = False) -> Callable[[], object]:
    layers, latent, rotary, slots = 5, 512, 64, t + 64
    ds_mla = dtype == torch.uint8
    width = 656 if ds_mla else latent + rotary

    def call() -> object:
        tables = _tables(rotary, layers=layers if per_layer else 0)
        ckv = torch.randn(t, layers, latent + rotary).to(torch.bfloat16)
        weight = torch.randn(layers, latent).to(torch.bfloat16)
        positions = torch.randint(0, 4096, (t,))
        if layout == "dense":
            return typedkv.materialize_mla_kv(ckv, weight, 1e-6, tables, positions, rope_style="gptj")
        pool: Any
        if layout == "flat":
            pool = torch.empty(layers, slots, width, dtype=dtype)
        elif layout == "paged64":
            pool = torch.empty(layers, -(-slots // 64), 64, width, dtype=dtype)
        elif layout == "list":
            pool = [torch.empty(slots, width, dtype=dtype) for _ in range(layers)]
        else:
            pool = [torch.empty(slots, 1, width, dtype=dtype) for _ in range(layers)]
        scale = 0.5 if dtype == torch.float8_e4m3fn else None
        return typedkv.materialize_mla_kv_into_pool(
            ckv, weight, 1e-6, tables, positions, torch.randperm(slots)[:t], pool,
            rope_style="gptj", kv_scale=scale, cache_format="fp8_ds_mla" if ds_mla else "plain",
        )  # fmt: skip

    return call


def as_on_hopper(set_attribute: Callable[[Any, str, Any], object]) -> None:
    """Launch the fused kernel as on an H200: weight tiles by TMA where they can be, pipelines sized to its
    227 KB of shared memory. ``set_attribute``: ``setattr``, or a test's ``monkeypatch.setattr``."""
    set_attribute(fused_launch, "_tma_device", lambda device: True)
    set_attribute(fused_launch, "_shared_memory", lambda device: 232448)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for one .ptx file per launch (created)")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument(
        "--hopper",
        action="store_true",
        help="launch as on an H200: the fused kernel's weight tiles by TMA where they can be, its"
        " pipelines sized to 227 KB of shared memory (by default the CPU tensors' launch: by pointer)",
    )
    args = parser.parse_args()
    if args.hopper:
        as_on_hopper(setattr)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for name, call in cases().items():
        if args.only not in name:
            continue
        ((kernel, grid, params, num_warps),) = capture(call)
        ptx = compile_ptx(kernel, params, num_warps)
        (args.out / f"{name}.ptx").write_text(ptx)
        digest = hashlib.sha256(ptx.encode()).hexdigest()[:12]
        print(f"{name:40} grid={grid} warps={num_warps} lines={ptx.count(chr(10)):5} {digest}", flush=True)


if __name__ == "__main__":
    main()
