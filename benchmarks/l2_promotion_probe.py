"""Does the TMA descriptors' L2 promotion change the fused path's time (a developer script for the H200)?

Not part of the package. Usage: ``python benchmarks/l2_promotion_probe.py [T ...]`` (16 48 64 128
2048 16384 unless given).

Triton 3.6 encodes every host-side TMA descriptor with ``CU_TENSOR_MAP_L2_PROMOTION_L2_128B``
(``fill_tma_descriptor`` in its NVIDIA driver): a load that misses L2 brings 128 bytes of a row.
The fused path streams each weight row 128 or 256 bytes a step (64 or 128 bf16 columns, the Triton
kernel at T <= 128) or 128 bytes of a row of a box (the warp-specialised kernel), so the next
step's bytes of a row are another request to memory each time. This wraps the driver's ``fill_tma_descriptor``: each
map it makes is encoded again through ``cuTensorMapEncodeTiled`` (ctypes, libcuda) with the same
arguments and another promotion, in place. First it checks that encoding again with 128 bytes
gives Triton's bytes exactly (so the map's place and the arguments are right); any difference
stops the script.

Per T: ``torch.mm`` alone, GEMM + kernel, and the materializer pinned to its fused path (at
T <= 128 the Triton kernel, above 1536 the warp-specialised one) with each promotion, all
alternated in seven rounds (`typedkv._bench.paired_gpu_time_us`). Each call sets its promotion
before it launches, so each captured graph keeps its own descriptors. K and V of every promotion
are checked equal to the default's first. Prints each / ``torch.mm`` (median, range).

Run on the H200 (2026-12-04): 256 bytes 1.08-1.09 at T = 16-64 against 1.03-1.05 with Triton's 128;
64 bytes and none as 128; at 2048 and 16384 all within the rounds' spread. Not adopted.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
from placement_probe import _fused, _mm  # the same calls, timed the same way

from typedkv import KVMaterializer, _bench, _bench_e2e

PROMOTIONS = {"none": 0, "64B": 1, "128B": 2, "256B": 3}  # CUtensorMapL2promotion
TRITONS = "128B"  # what Triton 3.6 encodes


class Promotion:
    """Wraps Triton's ``fill_tma_descriptor`` so every map it makes can be encoded again with another promotion."""

    def __init__(self) -> None:
        self.utils = triton.runtime.driver.active.utils
        self.original = self.utils.fill_tma_descriptor
        lib = ctypes.CDLL("libcuda.so.1")
        self.encode = lib.cuTensorMapEncodeTiled
        self.encode.restype = ctypes.c_int
        self.maps: list[tuple[Any, tuple[Any, ...]]] = []  # (map object, its fill arguments), kept alive
        self.mode = TRITONS
        self.checked = 0
        self.utils.fill_tma_descriptor = self._fill

    def _fill(self, *args: Any) -> Any:
        made = self.original(*args)
        place = _map_address(made)
        before = ctypes.string_at(place, 128)
        self._encode_at(place, args, PROMOTIONS[TRITONS])
        if ctypes.string_at(place, 128) != before:
            raise SystemExit(f"encoding again with {TRITONS} changed the map: arguments {args}")
        self.checked += 1
        if self.mode != TRITONS:
            self._encode_at(place, args, PROMOTIONS[self.mode])
        self.maps.append((made, args))
        return made

    def set(self, mode: str) -> None:
        """Encode every map made so far with ``mode`` (and the maps made from now on)."""
        if mode == self.mode:
            return
        self.mode = mode
        for made, args in self.maps:
            self._encode_at(_map_address(made), args, PROMOTIONS[mode])

    def _encode_at(self, place: int, args: tuple[Any, ...], promotion: int) -> None:
        address, swizzle, elem_size, elem_type, block, shape, strides, padding = args
        rank = len(block)
        dims = (ctypes.c_uint64 * rank)(*reversed([int(s) for s in shape]))
        box = (ctypes.c_uint32 * rank)(*reversed([int(b) for b in block]))
        # The driver's: strides in bytes, innermost dropped, reversed.
        byte_strides = (ctypes.c_uint64 * max(rank - 1, 1))(
            *reversed([elem_size * int(s) for s in list(strides)[: rank - 1]])
        )
        ones = (ctypes.c_uint32 * rank)(*([1] * rank))
        fill = 1 if padding == 1 else 0
        res = self.encode(
            ctypes.c_void_p(place), ctypes.c_int(elem_type), ctypes.c_uint32(rank), ctypes.c_void_p(address),
            dims, byte_strides, box, ones, ctypes.c_int(0), ctypes.c_int(swizzle), ctypes.c_int(promotion),
            ctypes.c_int(fill),
        )  # fmt: skip
        if res != 0:
            raise SystemExit(f"cuTensorMapEncodeTiled returned {res} for {args}")


def _map_address(made: Any) -> int:
    # PyCUtensorMapObject: PyObject_HEAD, then the map aligned to 128 bytes (Triton 3.6's driver.c).
    offset = type(made).__basicsize__ - 128
    if offset != 128:
        raise SystemExit(f"unexpected PyCUtensorMap size {type(made).__basicsize__}")
    return id(made) + offset


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [16, 48, 64, 128, 2048, 16384]
    device = torch.device("cuda")
    promotion = Promotion()
    bench = _bench_e2e.bench_draft(device)
    for num_tokens in tokens:
        _one(bench, promotion, num_tokens)
        promotion.maps.clear()
        torch.cuda.empty_cache()
    print(f"maps checked against Triton's encoding: {promotion.checked}", flush=True)


def _one(bench: _bench_e2e.BenchDraft, promotion: Promotion, num_tokens: int) -> None:
    draft, device = bench.draft, bench.flat.device
    inputs = [_bench_e2e._inputs(draft, num_tokens, device) for _ in range(4)]
    out = torch.empty(num_tokens, bench.flat.shape[0], device=device, dtype=draft.dtype)
    fused = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
    fused.projection_path = "fused" if num_tokens <= 128 else "auto"
    gemm = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
    gemm.projection_path = "gemm"
    flat = bench.weight.flatten(0, 1)

    # K and V of each promotion against Triton's own, on the first input set.
    x = inputs[0]
    promotion.set(TRITONS)
    want = [t.clone() for t in fused(x.hidden, x.positions)]
    for mode in PROMOTIONS:
        promotion.set(mode)
        got = fused(x.hidden, x.positions)
        torch.cuda.synchronize()
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise SystemExit(f"T={num_tokens}: K/V with promotion {mode} differ from {TRITONS}'s")
    promotion.set(TRITONS)

    calls: dict[str, list[Callable[[], None]]] = {
        "mm": [_mm(x.hidden, flat, out) for x in inputs],
        "gemm": [_fused(gemm, x.hidden, x.positions) for x in inputs],
    }
    for mode in PROMOTIONS:
        calls[f"fused {mode}"] = [_promoted(fused, x.hidden, x.positions, promotion, mode) for x in inputs]
    rounds = _bench.paired_gpu_time_us(calls, rounds=7)
    mm = statistics.median(rounds["mm"])
    line = [f"T={num_tokens} mm {mm:.2f} us"]
    for name in calls:
        if name == "mm":
            continue
        ratio = _bench_e2e.paired_ratio(rounds[name], rounds["mm"])
        line.append(f"{name} {ratio.median:.3f} ({ratio.low:.3f}-{ratio.high:.3f})")
    print(" | ".join(line), flush=True)


def _promoted(
    m: KVMaterializer, hidden: torch.Tensor, positions: torch.Tensor, promotion: Promotion, mode: str
) -> Callable[[], None]:
    def call() -> None:
        promotion.set(mode)  # before the launch reads the maps: the captured graph keeps this encoding
        m(hidden, positions)

    return call


if __name__ == "__main__":
    main()
