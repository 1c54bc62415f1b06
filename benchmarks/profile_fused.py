"""Run the fused projection a few times at one T (for ncu), on the end-to-end bench's draft.

Not part of the package. Usage: ``python benchmarks/profile_fused.py T [--pools]``; profile with
``ncu --clock-control none -k regex:project_kv --launch-skip 3 --launch-count 1 ...`` (``project_kv_kernel`` is the Triton
kernel, ``project_kv_ws_kernel`` the warp-specialised one, taken from T = 2048 on the H200). With
``--pools``: `KVMaterializer.into_pool` into per-layer pools of 2T slots, the tokens to consecutive
slots, so that the pool rows lie as the dense outputs' rows do and only the way of storing them differs.
With ``--mm``: ``torch.mm`` of the same hidden states and weights alone (profile cuBLAS's kernel with
``-k 'regex:nvjet|gemm|xmma|cutlass'``: cuBLAS 13's kernels are named nvjet), the baseline the fused kernel is measured against.
With ``--group-n N`` (dense outputs, or with ``--pools``): the warp-specialised kernel's tiles in bands of
``N`` weight tiles over every token block (`typedkv._fused_ws.Tiles.group_n`) instead of the default's bands.
"""

from __future__ import annotations

import sys

import torch

from typedkv import KVMaterializer, _fused_ws
from typedkv._bench_e2e import Draft


def main() -> None:
    args = sys.argv[1:]
    if "--group-n" in args:
        at = args.index("--group-n")
        group_n = int(args.pop(at + 1))
        args.pop(at)
        _fused_ws.WS_TILES = tuple((most, t._replace(group_n=group_n)) for most, t in _fused_ws.WS_TILES)
    num_tokens = int(next(a for a in args if not a.startswith("--")))
    device = torch.device("cuda")
    draft = Draft()
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    weight = torch.randn(L, 2 * H * D, draft.hidden, device=device, dtype=draft.dtype) / draft.hidden**0.5
    norm = torch.rand(L, D, device=device, dtype=draft.dtype) + 0.5
    half = D // 2
    inv = 1.0 / 1e6 ** (torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(draft.max_position, dtype=torch.float32, device=device), inv)
    m = KVMaterializer(weight, norm, 1e-6, torch.cat((angles.cos(), angles.sin()), dim=-1), num_kv_heads=H)
    m.projection_path = "fused"
    hidden = torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype)
    positions = torch.randint(0, draft.max_position, (num_tokens,), device=device)
    if "--mm" in sys.argv:
        for _ in range(6):
            torch.mm(hidden, weight.reshape(-1, draft.hidden).t())
    elif "--pools" in sys.argv:
        pools = [torch.empty(2 * num_tokens, H, D, device=device, dtype=draft.dtype) for _ in range(2 * L)]
        cache_loc = torch.arange(num_tokens, device=device)
        for _ in range(6):
            m.into_pool(hidden, positions, cache_loc, pools[:L], pools[L:])
    else:
        for _ in range(6):
            m(hidden, positions)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
