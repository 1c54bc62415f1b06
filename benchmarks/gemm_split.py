"""Whether the projection GEMM can write V straight into dense outputs (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/gemm_split.py [T ...]``. V passes through
the K/V step unchanged, so a GEMM that wrote V into ``v_out`` itself would leave the kernel only
K to read and write. ``v_out`` is ``[L, T, H*D]`` while the weight's rows are layer-major with
each layer's K rows before its V rows, so the V part is a batched GEMM over layers (the weight's
V rows of layer ``l`` at a batch stride, ``hidden`` broadcast). Times per call, CUDA-graph
replays, in one process, each row alternated within a round:

- ``mm``: ``torch.mm`` of all rows into ``kv`` (today's GEMM);
- ``mm+kernel``: today's GEMM + kernel path (`typedkv.materialize_kv` on ``kv``);
- ``bmm_k+bmm_v``: the K part and the V part as two batched GEMMs (V into ``v_out``);
- ``kernel``: the K/V kernel alone on ``kv``; a K-only kernel would move half its bytes.

Also checked: the V written by the batched GEMM equals the V of ``torch.mm`` (bitwise, or the
largest difference), and whether the batched GEMM allocates (a copy of the broadcast hidden).
"""

from __future__ import annotations

import statistics
import sys

import torch

import typedkv
from typedkv import _bench, _launch


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [256, 2048, 16384, 65536]
    device = torch.device("cuda")
    L, H, D, hidden_size = 5, 8, 128, 4096
    HD = H * D
    weight = torch.randn(L, 2 * HD, hidden_size, device=device, dtype=torch.bfloat16) / 64
    flat = weight.view(L * 2 * HD, hidden_size)
    k_rows, v_rows = weight[:, :HD], weight[:, HD:]  # [L, HD, hidden], batch stride 2*HD*hidden
    norm = torch.rand(L, D, device=device) + 0.5
    cos_sin = torch.randn(32768, D, device=device)
    for T in tokens:
        _one(T, flat, k_rows, v_rows, norm, cos_sin)
        torch.cuda.empty_cache()


def _one(
    T: int, flat: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """One T's line: the variants alternated, 3 rounds, medians."""
    device = flat.device
    L, HD, hidden_size = k_rows.shape
    H, D = 8, norm.shape[1]
    hidden = torch.randn(T, hidden_size, device=device, dtype=torch.bfloat16)
    positions = torch.randint(0, 32768, (T,), device=device)
    kv = torch.empty(T, L * 2 * HD, device=device, dtype=torch.bfloat16)
    k_work = torch.empty(L, T, HD, device=device, dtype=torch.bfloat16)
    v_out = torch.empty(L, T, HD, device=device, dtype=torch.bfloat16)
    k_out = torch.empty(L, T, H, D, device=device, dtype=torch.bfloat16)
    v_dense = torch.empty(L, T, H, D, device=device, dtype=torch.bfloat16)
    wide = hidden.expand(L, T, hidden_size)

    def mm() -> None:
        torch.mm(hidden, flat.t(), out=kv)

    def kernel() -> None:
        typedkv.materialize_kv(
            kv.view(T, L, 2 * HD), norm, 1e-6, cos_sin, positions, num_kv_heads=H, k_out=k_out, v_out=v_dense
        )

    def mm_kernel() -> None:
        mm()
        kernel()

    def split() -> None:
        torch.bmm(wide, k_rows.transpose(1, 2), out=k_work)
        torch.bmm(wide, v_rows.transpose(1, 2), out=v_out)

    # K alone: the K/V kernel's split launch (K programs on grid axis 2 = 0) with only K's programs,
    # reading K from k_work ([L, T, H*D], as [T, L, H*D] strides (H*D, T*H*D, 1)).
    k_view = k_work.permute(1, 0, 2)
    k_split = torch.empty(L, T, H, D, device=device, dtype=torch.bfloat16)
    v_split = v_out.view(L, T, H, D)
    k_args = (k_view, norm, 1e-6, cos_sin, positions, None)
    launch = _launch.Launch(
        *k_args, k_split, (k_split.stride(0), k_split.stride(1), 0, k_split.stride(2)),
        v_split, (v_split.stride(0), v_split.stride(1), 0, v_split.stride(2)), None,
        num_kv_heads=H, head_dim=D, page_size=1, num_rows=T, neox=True, config=_launch.KVConfig(split_kv=True),
    )  # fmt: skip
    launch.grid = (launch.grid[0], 1, 1)

    def k_only() -> None:
        launch(_launch.varying(*k_args, k_split, v_split, None))

    def split_k_only() -> None:
        split()
        k_only()

    mm()
    split()
    torch.cuda.synchronize()
    ref_v = kv.view(T, L, 2, HD)[:, :, 1].transpose(0, 1)
    diff = (ref_v.float() - v_out.float()).abs().max().item()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    split()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    mm_kernel()
    split_k_only()
    torch.cuda.synchronize()
    k_diff = (k_split.float() - k_out.float()).abs().max().item()
    variants = {
        "mm": mm, "mm+kernel": mm_kernel, "bmm_k+bmm_v": split, "kernel": kernel, "k_only": k_only,
        "split+k_only": split_k_only,
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(3):
        for name, fn in variants.items():
            times[name].append(_bench.gpu_time_us([fn], replays=15, min_calls=4 if T >= 16384 else 20))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"T={T:<6} "
        + " ".join(f"{k} {v:9.2f}" for k, v in med.items())
        + f" | (mm+kernel)/mm {med['mm+kernel'] / med['mm']:.3f}"
        + f" (split+kernel/2)/mm {(med['bmm_k+bmm_v'] + med['kernel'] / 2) / med['mm']:.3f}"
        + f" split/mm {med['bmm_k+bmm_v'] / med['mm']:.3f} (split+k_only)/mm {med['split+k_only'] / med['mm']:.3f}"
        + f" | V max diff {diff:g} K max diff {k_diff:g} bmm extra bytes {extra}",
        flush=True,
    )


if __name__ == "__main__":
    main()
