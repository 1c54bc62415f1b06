"""Developer script for the H200: the fused projection between kernels that are not programmatic launches.

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/neighbours_probe.py [T ...]``.

``typedkv bench`` times a materializer's calls back to back, each one a programmatic
dependent launch after the one before. There the fused kernel's two overlaps
(`typedkv._launch.ProjectionConfig`): ``signal_next`` lets the next call launch once
a program's weight loop is done, and ``l2_before_wait`` asks L2 for each head's first
weight columns before the program waits for the prior kernel. An engine's kernels
around the call may not be programmatic launches; then the next one launches when this
one ends, whatever it signals, and this one when the prior ends. This probe puts a
plain copy kernel before every call (``hidden`` copied from one of four sources, as an
engine's prior op writes it), for the fused kernel with both overlaps (the default),
with neither (the kernel before them), and for ``torch.mm``; and the same three back
to back, as the bench times them. For the bench's draft (5 layers, 8 KV heads, head
dim 128, hidden 4096, bf16), dense outputs, every variant of a T in one
`typedkv._bench.paired_gpu_time_us` (seven rounds). Each line: the variant's
microseconds (the rounds' median) and the median of its per-round ratios to
``torch.mm`` timed the same way (their range); the lines with the copy also give
(variant - copy) / (``torch.mm`` - copy), the copy timed alone in the same rounds.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
from fused_sweep import _fused, _paired_ratio, draft_tensors

from typedkv import _bench, _launch
from typedkv._bench_e2e import Draft

TOKENS = (16, 32, 48, 64, 128)


def main() -> None:
    device = torch.device("cuda")
    draft = Draft()
    weight, norm, cos_sin = draft_tensors(draft, device)
    for num_tokens in [int(t) for t in sys.argv[1:]] or TOKENS:
        _probe(num_tokens, draft, weight, norm, cos_sin)
        torch.cuda.empty_cache()


def _probe(num_tokens: int, draft: Draft, weight: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Every variant at ``num_tokens``, timed together; one line each."""
    device = weight.device
    L, H, D = draft.num_layers, draft.num_kv_heads, draft.head_dim
    flat = weight.reshape(L * 2 * H * D, draft.hidden)
    sources = [torch.randn(num_tokens, draft.hidden, device=device, dtype=draft.dtype) for _ in range(4)]
    hidden = torch.empty_like(sources[0])
    positions = torch.randint(0, draft.max_position, (num_tokens,), device=device)
    k_out, v_out = torch.empty(2, L, num_tokens, H, D, device=device, dtype=draft.dtype)
    gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)

    def mm() -> None:
        torch.mm(hidden, flat.t(), out=gemm_out)

    configs = {
        "fused": _launch.ProjectionConfig(),
        "fused, no overlap": _launch.ProjectionConfig(l2_before_wait=0, signal_next=False),
    }
    calls: dict[str, Callable[[], None]] = {"mm": mm}
    for name, config in configs.items():
        calls[name] = _fused(hidden, positions, weight, norm, cos_sin, k_out, v_out, config)
        calls[name]()
    torch.cuda.synchronize()

    def after_copy(call: Callable[[], None] | None, source: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            hidden.copy_(source)
            if call is not None:
                call()

        return step

    variants = {f"{name} back to back": [call] for name, call in calls.items()}
    variants["copy"] = [after_copy(None, s) for s in sources]
    variants.update({f"copy + {name}": [after_copy(call, s) for s in sources] for name, call in calls.items()})
    rounds = _bench.paired_gpu_time_us(variants)
    copy = statistics.median(rounds["copy"])
    mm_diff = [t - c for t, c in zip(rounds["copy + mm"], rounds["copy"], strict=True)]
    for label, times in rounds.items():
        base = "mm back to back" if label.endswith("back to back") else "copy + mm"
        line = f"T={num_tokens:<5} {label:28} {statistics.median(times):8.2f} us  / {base}: {_paired_ratio(times, rounds[base])}"
        if label.startswith("copy + "):
            diff = [t - c for t, c in zip(times, rounds["copy"], strict=True)]
            line += f"  less the copy ({copy:.2f} us): {_paired_ratio(diff, mm_diff)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
