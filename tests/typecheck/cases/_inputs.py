"""Well-formed inputs shared by the case files (never run: mypy reads them only).

L=2 layers, T=4 tokens, H=2 kv heads, D=64, R=64, P=32 positions, S=16 pool slots.
"""

import torch

L, T, H, D, P, S = 2, 4, 2, 64, 32, 16

kv = torch.empty(T, L, 2 * H * D, dtype=torch.bfloat16)
k_norm_weight = torch.ones(L, D)
eps_per_layer = torch.full((L,), 1e-6)
cos_sin_cache = torch.empty(P, D)
positions = torch.arange(T)
cache_loc = torch.arange(T)
k_out = torch.empty(L, T, H, D, dtype=torch.bfloat16)
v_out = torch.empty(L, T, H, D, dtype=torch.bfloat16)
k_pool = torch.empty(L, S, H, D, dtype=torch.bfloat16)
v_pool = torch.empty(L, S, H, D, dtype=torch.bfloat16)
k_pool_layers = [torch.empty(S, H, D, dtype=torch.float8_e4m3fn) for _ in range(L)]
v_pool_layers = [torch.empty(S, H, D, dtype=torch.float8_e4m3fn) for _ in range(L)]
