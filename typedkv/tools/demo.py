"""``typedkv demo``: a small draft model's KV, materialized, checked, misused once, timed."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from typedkv.core.errors import InputError
from typedkv.core.launcher import INTERPRETED
from typedkv.kv.api import materialize_kv
from typedkv.rope import cos_sin_cache as cos_sin_cache_table


def unfused_kv(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a draft model computes layer by layer without typedkv (NeoX RoPE).

    Returns K and V as ``[L, T, H, D]`` in kv's dtype.
    """
    _, num_layers, _ = kv.shape
    head_dim = k_norm_weight.shape[1]
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    ks, vs = [], []
    for layer in range(num_layers):
        k, v = kv[:, layer].unflatten(-1, (2, num_kv_heads, head_dim)).unbind(1)
        k = F.rms_norm(k.float(), (head_dim,), k_norm_weight[layer].float(), eps).to(kv.dtype).float()
        x1, x2 = k[..., :half], k[..., half : 2 * half]
        rotated = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), -1)
        ks.append(torch.cat((rotated, k[..., 2 * half :]), -1).to(kv.dtype))
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def main() -> int:
    """Run the demo on the best available device; return a process exit code."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        path = "Triton kernel"
    elif INTERPRETED:
        path = "Triton kernel under Triton's CPU interpreter"
    else:
        path = "PyTorch reference path; TRITON_INTERPRET=1 runs the Triton kernel interpreted"
    num_layers, num_kv_heads, head_dim, num_tokens, max_pos = 5, 8, 128, 64, 4096
    print(f"typedkv demo: {num_layers} draft layers, {num_kv_heads} kv heads x {head_dim}, {num_tokens} tokens, bf16")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'} ({path})")

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(num_tokens, num_layers, 2 * num_kv_heads * head_dim, generator=gen).to(device, torch.bfloat16)
    k_norm_weight = (torch.rand(num_layers, head_dim, generator=gen) + 0.5).to(device)
    cos_sin_cache = cos_sin_cache_table(max_pos, head_dim, base=1e6, device=device)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)

    k, v = materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=num_kv_heads)
    k_ref, v_ref = unfused_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads)
    rel = ((k.double() - k_ref.double()).norm() / k_ref.double().norm()).item()
    # Two bf16 roundings (after the norm, at the store) bound the error at a few 2**-8.
    ok = rel < 1e-2 and torch.equal(v, v_ref)
    print(f"check against the unfused model path: K rel. error {rel:.1e}, V bit-equal: {torch.equal(v, v_ref)}")

    bad_k_out = torch.empty(num_tokens, num_layers, num_kv_heads, head_dim, dtype=kv.dtype, device=device)
    try:
        materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=num_kv_heads, k_out=bad_k_out)
    except InputError as err:
        print(f"caught misuse (k_out allocated tokens-first):\n  InputError: {err}")
    else:
        print("misuse was NOT caught")
        ok = False

    times = []
    repeats = 3 if INTERPRETED and not cuda else 30  # the interpreter takes seconds a call
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=num_kv_heads)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    print(f"time per call (median of {repeats}, synchronised): {statistics.median(times):.1f} us")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1
