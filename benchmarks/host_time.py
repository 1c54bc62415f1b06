"""Host microseconds per call at decode size (T=16) of whichever ``typedkv`` is imported.

Run it from two checkouts to compare versions (benchmarks/NOTES.md): the
production ``materialize_kv`` (as ``typedkv bench``'s host figure), the pool op
with stacked and with per-layer pools, and a ``KVMaterializer`` call. The device
is kept busy asynchronously; the figure is wall-clock time per call. Beside each
call, a bare launch of a one-line Triton kernel defined here (the same in every
version) is timed in the same process, and each call is also given as a ratio to
it (``<call>_vs_bare``): this host's processes differ by a third in speed, so an
A/B compares the ratios.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

import typedkv
from typedkv._bench import MAIN, host_time_us, make_inputs


@triton.jit
def _touch(x_ptr):  # type: ignore[no-untyped-def]  # Triton reads parameter annotations: none here
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def main() -> None:
    device = torch.device("cuda")
    x = make_inputs(MAIN, 16, device)
    H, L, D = MAIN.num_kv_heads, MAIN.num_layers, MAIN.head_dim
    slots = torch.randperm(4096, device=device)[:16]
    k_pool = torch.empty(L, 4096, H, D, dtype=x.kv.dtype, device=device)
    v_pool = torch.empty_like(k_pool)
    k_layers, v_layers = list(k_pool.unbind(0)), [torch.empty_like(t) for t in k_pool.unbind(0)]
    weight = torch.randn(L, 2 * H * D, 1024, dtype=x.kv.dtype, device=device)
    m = typedkv.KVMaterializer(weight, x.weight, 1e-6, x.cos_sin, num_kv_heads=H)
    fused = typedkv.KVMaterializer(weight, x.weight, 1e-6, x.cos_sin, num_kv_heads=H)
    if hasattr(m, "projection_path"):
        # GEMM + kernel, as versions without the fused path compute it; the fused path on its own line.
        m.projection_path = "gemm"
        fused.projection_path = "fused"
    hidden = torch.randn(16, 1024, dtype=x.kv.dtype, device=device)
    calls = {
        "materialize_kv": lambda: _discard(
            typedkv.materialize_kv(
                x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out
            )
        ),
        "pool_stacked": lambda: typedkv.materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, slots, k_pool, v_pool, num_kv_heads=H
        ),
        "pool_per_layer": lambda: typedkv.materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, slots, k_layers, v_layers, num_kv_heads=H
        ),
        "materializer_call": lambda: _discard(m(hidden, x.positions)),
    }
    if hasattr(m, "into_pool"):
        calls["materializer_into_per_layer"] = lambda: m.into_pool(hidden, x.positions, slots, k_layers, v_layers)
    if hasattr(fused, "projection_path"):
        calls["materializer_call_fused"] = lambda: _discard(fused(hidden, x.positions))
        calls["materializer_into_per_layer_fused"] = lambda: fused.into_pool(
            hidden, x.positions, slots, k_layers, v_layers
        )
    cell = torch.zeros(1, device=device)
    result: dict[str, float] = {}
    for name, fn in calls.items():
        us = host_time_us(fn)
        bare = host_time_us(lambda: _discard(_touch[(1,)](cell)))
        result[name] = round(us, 2)
        result[f"{name}_vs_bare"] = round(us / bare, 3)
    print(json.dumps({"typedkv": typedkv.__file__, **result}))
    sys.stdout.flush()


def _discard(_: object) -> None:
    return None


if __name__ == "__main__":
    main()
