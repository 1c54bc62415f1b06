"""Developer script for the H200: how far is the kernel from the copy roofline, and which launch configuration is best?

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/explore.py OUT_DIR``.

Measures, in one run and against the copy roofline measured in that run, for every
benchmark case at T = 16384 (and the main case at T = 2048 and 256):

- the product op timed three ways: the bench's CUDA graph of >= 20 calls, a graph of
  one rotation of input sets, and ``triton.testing.do_bench`` (what timing costs);
- a pure copy with the product's bytes and layout (no math): the ceiling of the layout;
- launch configurations (BLOCK_T, warps, K/V split, one-tile K), launched directly:
  the op itself caches one launch per layout, so switching ``_launch`` settings
  between calls of the op would keep measuring the first configuration.

Each configuration's output is checked against the op's: V bit for bit, K within one
step of its dtype (sums in another order may round the norm differently).
Results go to ``OUT_DIR/explore.json``; conclusions to ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing

from typedkv import _bench, _launch


@triton.jit
def copy_pattern_kernel(kv_ptr, k_ptr, v_ptr, num_tokens, L: tl.constexpr, HD: tl.constexpr):
    """kv[T, L, 2HD] -> k[L, T, HD], v[L, T, HD], no math: one program per (token, layer, K or V)."""
    item = tl.program_id(0)
    part = tl.program_id(2)
    layer = item % L
    tok = item // L  # int32 is enough for the benchmarked sizes
    offs = tl.arange(0, HD)  # HD is a power of two in every benchmarked case
    x = tl.load(kv_ptr + tok * (L * 2 * HD) + layer * (2 * HD) + part * HD + offs)
    dst = (layer * num_tokens + tok) * HD + offs
    if part == 0:
        tl.store(k_ptr + dst, x)
    else:
        tl.store(v_ptr + dst, x)


def launch_args(
    case: _bench.Case, x: _bench.Inputs, block_t: int, warps: int, split: bool, full_row: bool | None
) -> tuple[tuple[int, int, int], tuple[Any, ...], int]:
    """``(grid, kernel arguments, warps)`` of the product kernel with a chosen configuration."""
    config = _launch.KVConfig(block_t=block_t, split_kv=split, full_row=full_row)
    if case.pool:
        kd, vd, slots = x.k_pool, x.v_pool, x.slots
        scale = 0.5 if case.pool == "fp8" else None
    else:
        kd, vd, slots, scale = x.k_out, x.v_out, None, None
    grid, params, _ = _launch.launch_params(
        x.kv, x.weight, x.eps, x.cos_sin, x.positions, slots, kd, _strides(kd), vd, _strides(vd), None,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=1, num_rows=kd.shape[1],
        neox=case.rope_style == "neox", scales=(scale, scale), config=config,
    )  # fmt: skip
    # The requested warps, not the launcher's own choice for this shape.
    return grid, params, warps


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return t.stride(0), t.stride(1), 0, t.stride(2)


def check_same(case: _bench.Case, x: _bench.Inputs, variant: Callable[[], None]) -> str:
    """The variant against the product op (poisoned outputs, fresh random inputs)."""
    dst = (x.k_pool, x.v_pool) if case.pool else (x.k_out, x.v_out)
    for t in dst:
        t.view(torch.uint8).fill_(0x55)
    _bench.typedkv_call(case, x)()
    want = [t.clone() for t in dst]
    for t in dst:
        t.view(torch.uint8).fill_(0x55)
    variant()
    torch.cuda.synchronize()
    v_same = torch.equal(want[1].view(torch.uint8), dst[1].view(torch.uint8))
    k_diff = (want[0].float() - dst[0].float()).abs()
    k_ok = bool((k_diff <= want[0].float().abs() * torch.finfo(want[0].dtype).eps + 1e-6).all())
    return "ok" if v_same and k_ok else f"DIFF v_same={v_same} k_max={float(k_diff.max()):.3g}"


def configurations(case: _bench.Case) -> list[tuple[int, int, bool, bool | None]]:
    """(BLOCK_T, warps, split, full_row) to sweep for one case."""
    rows: list[bool | None] = [True, False] if case.rope_style == "neox" and case.rotary_dim < case.head_dim else [None]
    return [
        (bt, w, sp, fr) for bt in (1, 2, 4) for w in (1, 2, 4, 8) for sp in (True, False) for fr in rows
    ]  # fmt: skip


def measure(case: _bench.Case, T: int, roof: float) -> dict[str, Any]:
    """Every measurement of one (case, T)."""
    dev = torch.device("cuda")
    nbytes = _bench.bytes_moved(case, T)
    sets = max(1, min(64, math.ceil((256 << 20) / nbytes)))
    inputs = [_bench.make_inputs(case, T, dev) for _ in range(sets)]
    res: dict[str, Any] = {"case": case.name, "T": T, "MB": nbytes / 1e6}

    def record(name: str, us: float, check: str | None = None) -> None:
        pct = round(100 * nbytes / us / 1e3 / roof, 1)
        res[name] = {"us": round(us, 2), "pct": pct} | ({} if check is None else {"check": check})
        print(f"{case.name:>20} T={T:<6} {name:<24} {us:9.2f} us {pct:6.1f}% {check or ''}", flush=True)

    product = [_bench.typedkv_call(case, x) for x in inputs]
    record("op/graph", _bench.gpu_time_us(product, replays=15))
    record("op/one_rotation", _bench.gpu_time_us(product, replays=15, min_calls=1))
    record("op/do_bench", float(triton.testing.do_bench(product[0], warmup=25, rep=200, return_mode="median")) * 1e3)
    if not case.pool:
        L, HD = case.num_layers, case.num_kv_heads * case.head_dim
        copies = [
            lambda x=x: copy_pattern_kernel[(T * L, 1, 2)](x.kv, x.k_out, x.v_out, T, L, HD, num_warps=4)
            for x in inputs
        ]
        record("copy_pattern", _bench.gpu_time_us(copies, replays=15))
    for block_t, warps, split, full_row in configurations(case):
        name = f"bt{block_t}w{warps}{'s' if split else 'j'}" + {None: "", True: "row", False: "pieces"}[full_row]
        try:
            calls = []
            for x in inputs:
                grid, params, nw = launch_args(case, x, block_t, warps, split, full_row)
                calls.append(lambda g=grid, p=params, w=nw: _launch.materialize_kv_kernel[g](*p, num_warps=w))
            check = check_same(case, inputs[0], calls[0])
            record(name, _bench.gpu_time_us(calls, replays=15), check)
        except Exception as err:  # a configuration that fails to build is reported, not fatal
            res[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(name, "failed", res[name], flush=True)
    return res


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    roof = _bench.copy_roofline_gbps(torch.device("cuda"))
    print(f"copy {roof:.0f} GB/s", flush=True)
    report: dict[str, Any] = {"copy_GBps": roof, "triton": triton.__version__, "torch": torch.__version__, "rows": []}
    cases = [(_bench.MAIN, t) for t in (16384, 2048, 256)] + [(c, 16384) for c in _bench.GPU_CASES[1:]]
    for case, T in cases:
        report["rows"].append(measure(case, T, roof))
        (out_dir / "explore.json").write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
