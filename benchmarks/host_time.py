"""Host microseconds per call at decode size (T=16) of whichever ``typedkv`` is imported.

Run it from two checkouts to compare versions (benchmarks/NOTES.md): the
production ``materialize_kv`` (as ``typedkv bench``'s host figure), the pool op
with stacked and with per-layer pools, and a ``KVMaterializer`` call. The device
is kept busy asynchronously; the figure is wall-clock time per call.
"""

from __future__ import annotations

import json
import sys

import torch

import typedkv
from typedkv._bench import MAIN, host_time_us, make_inputs


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
    hidden = torch.randn(16, 1024, dtype=x.kv.dtype, device=device)
    calls = {
        "materialize_kv": lambda: typedkv.materialize_kv(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=H, k_out=x.k_out, v_out=x.v_out
        ),
        "pool_stacked": lambda: typedkv.materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, slots, k_pool, v_pool, num_kv_heads=H
        ),
        "pool_per_layer": lambda: typedkv.materialize_kv_into_pool(
            x.kv, x.weight, x.eps, x.cos_sin, x.positions, slots, k_layers, v_layers, num_kv_heads=H
        ),
        "materializer_call": lambda: m(hidden, x.positions),
    }
    result = {name: round(host_time_us(fn), 2) for name, fn in calls.items()}
    print(json.dumps({"typedkv": typedkv.__file__, **result}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
