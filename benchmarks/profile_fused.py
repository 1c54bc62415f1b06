"""Run the fused projection a few times at one T (for ncu), on the end-to-end bench's draft.

Not part of the package. Usage: ``python benchmarks/profile_fused.py T``; profile with
``ncu -k regex:project_kv_kernel --launch-skip 3 --launch-count 1 ...``.
"""

from __future__ import annotations

import sys

import torch

from typedkv import KVMaterializer
from typedkv._bench_e2e import Draft


def main() -> None:
    num_tokens = int(sys.argv[1])
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
    for _ in range(6):
        m(hidden, positions)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
