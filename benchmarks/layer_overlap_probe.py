"""GEMM + kernel by groups of layers, each group's kernel beside the next group's GEMM (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/layer_overlap_probe.py [--check] [T ...]``.

From T = 256 to 2048 the materializer's best path (GEMM + kernel) runs at 1.06-1.12x ``torch.mm``
alone (issue 18; target 1.05): the K/V kernel runs after the whole GEMM, reading ``kv`` back. The
GEMM's rows are layer-major (``[L*2*H*D, hidden]``), so the GEMM can be cut by layers at no extra
weight traffic: a GEMM per group of layers on the current stream, and each group's K/V kernel on a
side stream as soon as its GEMM is done, beside the next group's GEMM. Only the last group's kernel
is left after the last GEMM. Where the GEMM is compute-bound (T >= 1024) and the kernel
memory-bound, the two could share the SMs; where cuBLAS leaves SMs idle (a smaller N fills fewer
tiles) the kernel takes them. Cutting T into chunks over two streams was measured slower before
(issue 18): this cuts N.

Variants, each / ``torch.mm`` over the whole weight (CUDA-graph replays, 3 rounds, medians):
``whole`` (one GEMM, one `typedkv.materialize_kv`), ``mm_g<G>`` (the GEMM alone in G groups),
``serial_g<G>`` (each group's GEMM then its kernel, one stream), ``pipe_g<G>`` (kernels on a side
stream, as above), each dense and into sglang-style per-layer pools (``_pools``).

``--check``: no timing; each variant's K and V against ``whole``'s, small sizes (CPU unless CUDA
is there; a group's GEMM may sum in another order: within a few storage ulps).
On the H200 (2026-12-04, docs/performance.md) every grouped variant was slower than the whole
call but at T = 1024 (kernels beside, two groups: 1.082x torch.mm, against whole 1.091-1.175 in
rounds not interleaved): the GEMM alone in two groups costs 4-24% more than in one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
from probe_timing import DraftWeights, check_against_whole, outputs_left

import typedkv

Variants = dict[str, list[Callable[[], object]]]


def groups_of(num_layers: int, count: int) -> list[tuple[int, int]]:
    """``count`` spans of consecutive layers covering ``num_layers``, the larger first."""
    base, extra = divmod(num_layers, count)
    spans, start = [], 0
    for g in range(count):
        end = start + base + (g < extra)
        spans.append((start, end))
        start = end
    return spans


class Draft(DraftWeights):
    """The weights (`probe_timing.DraftWeights`) and per-T buffers of one draft shape."""

    def calls(self, num_tokens: int, counts: list[int]) -> tuple[Variants, Callable[[str], tuple[torch.Tensor, ...]]]:
        """``(variants, results)``: each variant's calls (one input set), and what a variant leaves behind."""
        L, H, D, dev, dt = self.L, self.H, self.D, self.device, self.dtype
        width = 2 * H * D
        hidden = torch.randn(num_tokens, self.hidden, device=dev).to(dt)
        positions = torch.randint(0, 4096, (num_tokens,), device=dev)
        cache_loc = torch.randperm(2 * num_tokens, device=dev)[:num_tokens]
        kv = torch.empty(num_tokens * L * width, device=dev, dtype=dt)
        k_out, v_out = torch.empty(2, L, num_tokens, H, D, device=dev, dtype=dt)
        k_layers = [torch.zeros(2 * num_tokens, H, D, device=dev, dtype=dt) for _ in range(L)]
        v_layers = [torch.zeros(2 * num_tokens, H, D, device=dev, dtype=dt) for _ in range(L)]
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

        def gemm(start: int, end: int) -> torch.Tensor:
            # The group's rows of kv, [T, (end - start) * 2*H*D], after the groups before it.
            rows = kv[num_tokens * start * width : num_tokens * end * width].view(num_tokens, (end - start) * width)
            torch.mm(hidden, self.weight[start * width : end * width].t(), out=rows)
            return rows.view(num_tokens, end - start, width)

        def kernel(start: int, end: int, rows: torch.Tensor, pools: bool) -> None:
            if pools:
                typedkv.materialize_kv_into_pool(
                    rows, self.norm[start:end], 1e-6, self.cos_sin, positions, cache_loc, k_layers[start:end],
                    v_layers[start:end], num_kv_heads=H,
                )  # fmt: skip
            else:
                typedkv.materialize_kv(
                    rows, self.norm[start:end], 1e-6, self.cos_sin, positions, num_kv_heads=H,
                    k_out=k_out[start:end], v_out=v_out[start:end],
                )  # fmt: skip

        def serial(spans: list[tuple[int, int]], pools: bool) -> Callable[[], None]:
            def run() -> None:
                for start, end in spans:
                    kernel(start, end, gemm(start, end), pools)

            return run

        def gemms(spans: list[tuple[int, int]]) -> Callable[[], None]:
            def run() -> None:
                for start, end in spans:
                    gemm(start, end)

            return run

        def pipe(spans: list[tuple[int, int]], pools: bool) -> Callable[[], None]:
            def run() -> None:
                if side is None:
                    return serial(spans, pools)()
                main = torch.cuda.current_stream(dev)
                for start, end in spans:
                    rows = gemm(start, end)
                    side.wait_stream(main)  # this group's GEMM is done
                    with torch.cuda.stream(side):
                        kernel(start, end, rows, pools)
                main.wait_stream(side)  # every kernel done before the call returns

            return run

        variants: Variants = {"mm": [lambda: torch.mm(hidden, self.weight.t(), out=kv.view(num_tokens, L * width))]}
        for pools in (False, True):
            tag = "_pools" if pools else ""
            variants[f"whole{tag}"] = [serial([(0, L)], pools)]
            for count in counts:
                spans = groups_of(L, count)
                if not pools:
                    variants[f"mm_g{count}"] = [gemms(spans)]
                variants[f"serial_g{count}{tag}"] = [serial(spans, pools)]
                variants[f"pipe_g{count}{tag}"] = [pipe(spans, pools)]

        def results(name: str) -> tuple[torch.Tensor, ...]:
            pools = name.endswith("_pools")
            return outputs_left(variants[name][0], pools, k_out, v_out, k_layers, v_layers, cache_loc)

        return variants, results


def check() -> int:
    """Each grouped variant's K and V against the whole call's, at small sizes."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    draft = Draft(5, 2, 64, 128, device)
    variants, results = draft.calls(48, [2, 5])
    return 1 if check_against_whole(variants, results, ("serial", "pipe"), draft.dtype, "grouped") else 0


def against_whole(
    results: Callable[[str], tuple[torch.Tensor, ...]],
) -> Callable[[str, Sequence[Callable[[], object]]], str]:
    """A `probe_timing.measure` check: a grouped variant's largest difference from the whole call's K and V."""
    wants = {"": results("whole"), "_pools": results("whole_pools")}

    def verdict(name: str, calls: Sequence[Callable[[], object]]) -> str:
        if name.startswith("mm"):
            calls[0]()
            return "-"
        want = wants["_pools" if name.endswith("_pools") else ""]
        got = results(name)
        return f"{max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True)):.3g}"

    return verdict


def main() -> int:
    if "--check" in sys.argv:
        return check()
    from probe_timing import measure, report

    device = torch.device("cuda")
    if check():
        return 1
    draft = Draft(5, 8, 128, 4096, device)
    for num_tokens in [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 256, 512, 1024, 2048, 4096]:
        variants, results = draft.calls(num_tokens, [2, 5])
        verdict = against_whole(results)
        med, errors = measure(f"T={num_tokens}", variants, verdict)
        report(f"T={num_tokens}", med, errors)
        del variants
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
