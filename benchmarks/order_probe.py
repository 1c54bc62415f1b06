"""Developer script for the GPU: does the order of the bench's rounds move its ratios?

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/order_probe.py [T ...]``
(default 256 1024 2048: where the GPU runs at its power limit).

The end-to-end section's implementations at each T (sglang's helper too when its wheel is in
``.sglang/``), with two of them timed twice under other names: ``torch.mm`` as ``mm_b`` and
"auto" as ``typedkv_b``, each copy placed elsewhere in the list, so that an implementation over its
copy reads 1 but for where it runs in the rounds. Timed by `typedkv._bench.paired_gpu_time_us`
with its rounds in a plain rotation (each implementation always after the same one unless it runs
first: the order before) and in `typedkv._bench.round_order`'s balanced rows, the two alternated,
``ROUNDS_EACH`` times each. Each line: the median of a ratio's per-round values and their range.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from typedkv import _bench, _bench_e2e

ROUNDS_EACH = 2
RATIOS = (
    ("mm_b", "mm"),
    ("typedkv_b", "typedkv"),
    ("typedkv", "mm"),
    ("typedkv_b", "mm_b"),
    ("typedkv_gemm", "typedkv"),
    ("typedkv_fused", "typedkv"),
)
BALANCED = _bench.round_order


def rotated(impls: Sequence[str], round_index: int) -> list[str]:
    """The order before: round ``r`` starts at ``impls[r % n]``, the list otherwise as it is."""
    start = round_index % len(impls)
    return [*impls[start:], *impls[:start]]


def main() -> None:
    device = torch.device("cuda")
    tokens = [int(t) for t in sys.argv[1:]] or [256, 1024, 2048]
    bench = _bench_e2e.bench_draft(device)
    draft, layers, rotary, _, _, flat = bench
    materializers = _bench_e2e.path_materializers(bench)
    sglang, where = _bench_e2e.load_sglang()
    theirs = None
    if sglang is not None:
        theirs = sglang.FusedKVMaterializeHelper(
            layers, rotary, draft.num_kv_heads, draft.head_dim, device, max_position_hint=draft.max_position
        )
    print(f"{torch.cuda.get_device_name(device)}; sglang: {where if theirs is not None else 'not loaded'}", flush=True)
    for num_tokens in tokens:
        sets = 4 if num_tokens <= _bench_e2e.ROTATE_UP_TO else 1
        inputs = [_bench_e2e._inputs(draft, num_tokens, device) for _ in range(sets)]
        gemm_out = torch.empty(num_tokens, flat.shape[0], device=device, dtype=draft.dtype)
        calls = _bench_e2e._calls(inputs, flat, gemm_out, materializers, theirs)
        # The bench's list, each copy after another neighbour than its original's.
        ordered: dict[str, list[Callable[[], None]]] = {}
        for name, fns in calls.items():
            ordered[name] = fns
            if name == "typedkv_pool_gemm":
                ordered["mm_b"] = calls["mm"]
            if name == "typedkv_pool_fused":
                ordered["typedkv_b"] = calls["typedkv"]
        for arm in range(2 * ROUNDS_EACH):
            label, order = ("rotated", rotated) if arm % 2 == 0 else ("balanced", BALANCED)
            _bench.round_order = order  # what paired_gpu_time_us reads
            try:
                times = _bench.paired_gpu_time_us(ordered)
            finally:
                _bench.round_order = BALANCED
            parts = []
            for a, b in RATIOS:
                r = _bench_e2e.paired_ratio(times[a], times[b])
                parts.append(f"{a}/{b} {r.median:.3f} ({r.low:.3f}-{r.high:.3f})")
            print(f"T={num_tokens:<6} {label:<9} " + "  ".join(parts), flush=True)
            torch.cuda.empty_cache()
        del calls, ordered, inputs, gemm_out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
