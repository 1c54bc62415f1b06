"""GEMM + kernel in chunks of tokens small enough for L2 (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/chunk_probe.py [--check] [T ...]``.

At large T the GEMM + kernel path writes ``kv`` (``[T, L*2*H*D]``, 335 MB at T = 16384 for the
bench's draft: 5 layers, 8 KV heads, D = 128, hidden 4096, bf16), and the K/V kernel reads it
back from memory: about 8% of the GEMM's time there, where the target is 5%. Run in chunks of
``C`` tokens on one stream, each chunk's GEMM then its kernel, the kernel reads a ``kv`` chunk
that the GEMM has just written and that L2 (50 MB on the H200) may still hold. (Splitting T
over two streams, to overlap GEMM and kernel, was measured slower before: issue 18.)

Variants, each / ``torch.mm`` over all T (CUDA-graph replays, alternated, 3 rounds, medians):
``whole`` (one GEMM, one `typedkv.materialize_kv`), ``chunks<C>`` for C in 1024 / 2048 / 4096
(a GEMM and a kernel a chunk into ``k_out``/``v_out``'s rows of that chunk), and the same into
sglang-style per-layer pools (`typedkv.materialize_kv_into_pool`). The kernel is the public
call's, launched as a programmatic dependent launch (the materializer's own launch after its
GEMM is a plain one).

``--check``: no timing; on CPU unless CUDA is there, small sizes, each chunked variant's K and V
against the whole call's (the GEMM of a chunk may sum in another order: within a few storage ulps).
On the H200 (2026-12-02, benchmarks/NOTES.md) every chunked variant was slower than the whole
call: at T = 16384 1.109-1.137x torch.mm against 1.066x, at 65536 1.100-1.113x against 1.077x.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from probe_timing import DraftWeights, check_against_whole, outputs_left

import typedkv

Variants = dict[str, list[Callable[[], object]]]


class Draft(DraftWeights):
    """The weights (`probe_timing.DraftWeights`) and per-T buffers of one draft shape."""

    def calls(self, num_tokens: int, chunks: list[int]) -> tuple[Variants, Callable[[str], tuple[torch.Tensor, ...]]]:
        """``(variants, results)``: each variant's calls (one input set), and what a variant leaves behind."""
        L, H, D, dev, dt = self.L, self.H, self.D, self.device, self.dtype
        width = L * 2 * H * D
        hidden = torch.randn(num_tokens, self.hidden, device=dev).to(dt)
        positions = torch.randint(0, 4096, (num_tokens,), device=dev)
        cache_loc = torch.randperm(2 * num_tokens, device=dev)[:num_tokens]
        kv = torch.empty(num_tokens, width, device=dev, dtype=dt)
        k_out, v_out = torch.empty(2, L, num_tokens, H, D, device=dev, dtype=dt)
        k_layers = [torch.zeros(2 * num_tokens, H, D, device=dev, dtype=dt) for _ in range(L)]
        v_layers = [torch.zeros(2 * num_tokens, H, D, device=dev, dtype=dt) for _ in range(L)]
        w_t = self.weight.t()

        def span(start: int, end: int, pools: bool, buffer: torch.Tensor) -> None:
            rows = buffer[: end - start]
            torch.mm(hidden[start:end], w_t, out=rows)
            chunk = rows.view(end - start, L, 2 * H * D)
            if pools:
                typedkv.materialize_kv_into_pool(
                    chunk, self.norm, 1e-6, self.cos_sin, positions[start:end], cache_loc[start:end], k_layers,
                    v_layers, num_kv_heads=H,
                )  # fmt: skip
            else:
                typedkv.materialize_kv(
                    chunk, self.norm, 1e-6, self.cos_sin, positions[start:end], num_kv_heads=H,
                    k_out=k_out[:, start:end], v_out=v_out[:, start:end],
                )  # fmt: skip

        def chunked(size: int, pools: bool) -> Callable[[], None]:
            buffer = torch.empty(min(size, num_tokens), width, device=dev, dtype=dt)

            def run() -> None:
                for start in range(0, num_tokens, size):
                    span(start, min(start + size, num_tokens), pools, buffer)

            return run

        variants: Variants = {"mm": [lambda: torch.mm(hidden, w_t, out=kv)]}
        for pools in (False, True):
            tag = "_pools" if pools else ""
            variants[f"whole{tag}"] = [lambda p=pools: span(0, num_tokens, p, kv)]
            for size in chunks:
                if size < num_tokens:
                    variants[f"chunks{size}{tag}"] = [chunked(size, pools)]

        def results(name: str) -> tuple[torch.Tensor, ...]:
            pools = name.endswith("_pools")
            return outputs_left(variants[name][0], pools, k_out, v_out, k_layers, v_layers, cache_loc)

        return variants, results


def check() -> int:
    """Each chunked variant's K and V against the whole call's, at small sizes."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    draft = Draft(2, 2, 32, 64, device)
    variants, results = draft.calls(64, [16, 24])
    return 1 if check_against_whole(variants, results, ("chunks",), draft.dtype, "chunked") else 0


def main() -> int:
    if "--check" in sys.argv:
        return check()
    from probe_timing import measure, report

    device = torch.device("cuda")
    draft = Draft(5, 8, 128, 4096, device)
    for num_tokens in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [2048, 16384, 65536]:
        variants, _ = draft.calls(num_tokens, [1024, 2048, 4096])
        med, _ = measure(f"T={num_tokens}", variants, lambda name, calls: str(calls[0]()))
        report(f"T={num_tokens}", med)
        del variants
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
