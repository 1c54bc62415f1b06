"""typedkv's own host time per call, without a GPU: everything but the kernel launch itself.

Kernel launches (and the materializer's GEMM) are skipped and the calls take
CPU tensors, so what is timed is the Python between the public call and Triton:
checks, plan lookup, call bundles, argument lists. Run it for
two checkouts, alternated, to compare versions before a GPU run (on a GPU,
``typedkv bench --only e2e`` prints each call's host time over a bare launch;
docs/decisions/011-host-time.md says what was done about it):

    for i in 1 2 3; do
        PYTHONPATH=/tmp/old python benchmarks/host_overhead.py
        PYTHONPATH=.        python benchmarks/host_overhead.py
    done

Prints one JSON line: the fastest of 7 rounds of 2000 calls, microseconds per call.
"""

from __future__ import annotations

import importlib
import json
import os
import timeit
from collections.abc import Callable
from typing import Any

import torch

os.environ.pop("TRITON_INTERPRET", None)

import typedkv
from typedkv.core import launcher
from typedkv.kv import launch as kv_launch


def _no_launch() -> None:
    """Kernel launches and the materializers' GEMM become no-ops; CPU tensors take the kernel's path."""
    launcher.use_kernel = lambda device: True  # type: ignore[assignment]
    # The GEMM is looked up in _projection now, in the materializer module in older versions.
    for name in ("typedkv.projection.layers", "typedkv.projection.materializer"):
        try:
            module: Any = importlib.import_module(name)
        except ModuleNotFoundError:  # a version without that module
            continue
        module.gemm = lambda *args: None
    # The launch object is KernelLaunch now, Launch in older versions.
    launch: Any = getattr(launcher, "KernelLaunch", None) or kv_launch.Launch
    launch.__call__ = lambda self, values, after_gemm=False: None


def calls() -> dict[str, Callable[[], object]]:
    """The bench's main shape at T = 16 (L = 5, H = 8, D = 128, bf16), each public call."""
    t, layers, heads, dim, hidden_size = 16, 5, 8, 128, 16
    kv = torch.randn(t, layers, 2 * heads * dim).to(torch.bfloat16)
    weight = torch.randn(layers, dim).to(torch.bfloat16)
    cos_sin = torch.randn(4096, dim)
    positions = torch.randint(0, 4096, (t,))
    slots = torch.randperm(4096)[:t]
    k_out = torch.empty(layers, t, heads, dim, dtype=torch.bfloat16)
    v_out = torch.empty_like(k_out)
    k_pool = torch.empty(layers, 4096, heads, dim, dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    k_layers = [torch.empty(4096, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    v_layers = [torch.empty(4096, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    proj = torch.randn(layers, 2 * heads * dim, hidden_size).to(torch.bfloat16)
    m = typedkv.KVMaterializer(proj, weight, 1e-6, cos_sin, num_kv_heads=heads)
    fused = typedkv.KVMaterializer(proj, weight, 1e-6, cos_sin, num_kv_heads=heads)
    if hasattr(fused, "projection_path"):  # versions with the fused projection path
        fused.projection_path = "fused"
    hidden = torch.randn(t, hidden_size).to(torch.bfloat16)
    return {
        "materialize_kv": lambda: typedkv.materialize_kv(
            kv, weight, 1e-6, cos_sin, positions, num_kv_heads=heads, k_out=k_out, v_out=v_out
        ),
        "pool_stacked": lambda: typedkv.materialize_kv_into_pool(
            kv, weight, 1e-6, cos_sin, positions, slots, k_pool, v_pool, num_kv_heads=heads
        ),
        "pool_per_layer": lambda: typedkv.materialize_kv_into_pool(
            kv, weight, 1e-6, cos_sin, positions, slots, k_layers, v_layers, num_kv_heads=heads
        ),
        "materializer_call": lambda: m(hidden, positions),
        "materializer_into_pool": lambda: m.into_pool(hidden, positions, slots, k_layers, v_layers),
        "materializer_call_fused": lambda: fused(hidden, positions),
        "materializer_into_pool_fused": lambda: fused.into_pool(hidden, positions, slots, k_layers, v_layers),
        **_mla_calls(t, layers, hidden, positions, slots),
    }


def _mla_calls(
    t: int, layers: int, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """The MLA ops and `MLAKVMaterializer` at DeepSeek's geometry (C = 512, R = 64), paged pools of 64."""
    c, r = 512, 64
    ckv = torch.randn(t, layers, c + r).to(torch.bfloat16)
    weight = torch.randn(layers, c).to(torch.bfloat16)
    cos_sin = torch.randn(4096, r)
    pool = torch.empty(layers, 64, 64, c + r, dtype=torch.bfloat16)
    out = torch.empty(layers, t, c + r, dtype=torch.bfloat16)
    proj = torch.randn(layers, c + r, hidden.shape[1]).to(torch.bfloat16)
    mla = typedkv.MLAKVMaterializer(proj, weight, 1e-6, cos_sin, rope_style="gptj")
    return {
        "mla_kv": lambda: typedkv.materialize_mla_kv(ckv, weight, 1e-6, cos_sin, positions, rope_style="gptj", out=out),
        "mla_pool_paged": lambda: typedkv.materialize_mla_kv_into_pool(
            ckv, weight, 1e-6, cos_sin, positions, slots, pool, rope_style="gptj"
        ),
        "mla_materializer_call": lambda: mla(hidden, positions, out=out),
        "mla_materializer_into_pool": lambda: mla.into_pool(hidden, positions, slots, pool),
    }


def main() -> None:
    _no_launch()
    typedkv.set_debug(False)
    result: dict[str, Any] = {"typedkv": typedkv.__file__}
    for name, fn in calls().items():
        fn()  # the layout's first call checks and plans
        rounds = timeit.repeat(fn, number=2000, repeat=7)
        result[name] = round(min(rounds) / 2000 * 1e6, 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
