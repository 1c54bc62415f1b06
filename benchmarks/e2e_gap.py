"""Where the end-to-end bench's GEMM + kernel time goes beyond the GEMM and the kernel (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/e2e_gap.py [T ...]``. The bench's end-to-end
section measured the materializer's GEMM + kernel path at T = 2048 about 50 us over ``torch.mm``
alone (1.21-1.24x), while the K/V kernel alone on that ``kv`` takes about 23 us and a harness with
outputs reused (``gemm_split.py``) measured mm + kernel 1.09x. Same draft, weights and timer as
the bench (`typedkv._bench_e2e`), each variant alternated within a round, 3 rounds, medians (us):

- ``mm``: ``torch.mm`` into a reused buffer (the bench's floor); ``mm_new``: allocating its output;
- ``mm_rnd``: ``torch.mm`` with another weight of the same shape (randn / 64): does the data move it;
- ``kv``: `typedkv.materialize_kv` alone on the GEMM's ``kv``, outputs reused; ``kv_new``: allocating;
- ``mm+kv``: the two, outputs reused; ``mm+kv_new``: allocating (what the materializer does);
- ``gemm``: the materializer pinned to GEMM + kernel (dense); ``auto``: its default.
"""

from __future__ import annotations

import statistics
import sys

import torch

import typedkv
from typedkv import _bench, _bench_e2e


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [64, 256, 2048, 16384]
    device = torch.device("cuda")
    draft, _, rotary, weight, norm, flat = _bench_e2e.bench_draft(device)
    H = draft.num_kv_heads
    other = torch.randn_like(flat) / 64
    cos_sin = rotary.cos_sin_cache
    gemm_m = typedkv.KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=H)
    gemm_m.projection_path = "gemm"
    auto_m = typedkv.KVMaterializer(weight, norm, 1e-6, cos_sin, num_kv_heads=H)
    for T in tokens:
        _one(T, draft, flat, other, norm, cos_sin, (gemm_m, auto_m))
        torch.cuda.empty_cache()


def _one(T, draft, flat, other, norm, cos_sin, materializers):  # type: ignore[no-untyped-def]
    """One T's line."""
    device = flat.device
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    gemm_m, auto_m = materializers
    sets = 4 if T <= 256 else 1
    hiddens = [torch.randn(T, draft.hidden, device=device, dtype=draft.dtype) for _ in range(sets)]
    positions = [torch.randint(0, draft.max_position, (T,), device=device) for _ in range(sets)]
    kv = torch.empty(T, L * 2 * H * D, device=device, dtype=draft.dtype)
    k_out = torch.empty(L, T, H, D, device=device, dtype=draft.dtype)
    v_out = torch.empty_like(k_out)

    def each(make):  # type: ignore[no-untyped-def]
        return [make(h, p) for h, p in zip(hiddens, positions, strict=True)]

    def kernel(p, new):  # type: ignore[no-untyped-def]
        outs = {} if new else {"k_out": k_out, "v_out": v_out}
        typedkv.materialize_kv(kv.view(T, L, 2 * H * D), norm, 1e-6, cos_sin, p, num_kv_heads=H, **outs)

    variants = {
        "mm": each(lambda h, p: lambda: torch.mm(h, flat.t(), out=kv)),
        "mm_new": each(lambda h, p: lambda: torch.mm(h, flat.t())),
        "mm_rnd": each(lambda h, p: lambda: torch.mm(h, other.t(), out=kv)),
        "kv": each(lambda h, p: lambda: kernel(p, False)),
        "kv_new": each(lambda h, p: lambda: kernel(p, True)),
        "mm+kv": each(lambda h, p: lambda: (torch.mm(h, flat.t(), out=kv), kernel(p, False))),
        "mm+kv_new": each(lambda h, p: lambda: (torch.mm(h, flat.t(), out=kv), kernel(p, True))),
        "gemm": each(lambda h, p: lambda: gemm_m(h, p)),
        "auto": each(lambda h, p: lambda: auto_m(h, p)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(3):
        for name, fns in variants.items():
            times[name].append(_bench.gpu_time_us(fns, replays=15, min_calls=4 if T >= 16384 else 20))
    med = {k: statistics.median(v) for k, v in times.items()}
    mm = med["mm"]
    print(f"T={T:<6} " + " ".join(f"{k} {v:.2f} ({v / mm:.3f})" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
