"""Developer script for a CUDA machine: where a public call's host time goes, on the host that runs it.

Not part of the package. Usage: ``python benchmarks/host_profile.py [NAME ...]`` (names of
`typedkv._bench.public_calls`, at T = 16; default: the materializer's calls and the per-layer
pool op). For each call: its wall-clock microseconds and a bare one-line-kernel launch's, timed
alternately as the bench does, then cProfile's top functions by their own time over 3000 calls
(the profiler's overhead inflates every figure; compare shares, not microseconds). Beside them,
the primitives a call pays for on this host: a CUDA ``torch.empty``, a direct launch of the
compiled one-line kernel, ``torch.cuda.is_current_stream_capturing``, the current device
(through ``torch.cuda`` and directly), a tensor's dtype, shape, strides and device; and what a
TMA descriptor costs where it is made and encoded per launch: making one for the bench's weight,
and a direct launch, through Triton's launcher, of a one-tile kernel that takes one (the launcher
encodes it at every launch; the fused kernel's launches now encode theirs once per weight
address, `typedkv._launch.ProjectionLaunch`). (The TMA lines were added on 2026-12-01 and not run.)
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from host_time import _touch  # the one-line kernel whose bare launch host_time.py times too

from typedkv import _bench
from typedkv._launch import TensorDescriptor


@triton.jit
def _touch_tile(desc, out_ptr):  # type: ignore[no-untyped-def]  # Triton reads parameter annotations: none here
    """One 16 x 16 tile loaded through a TMA descriptor and stored."""
    rows = tl.arange(0, 16)
    tl.store(out_ptr + rows[:, None] * 16 + rows[None, :], desc.load([0, 0]))


def main() -> None:
    device = torch.device("cuda")
    calls = _bench.public_calls(device)
    names = sys.argv[1:] or ["materializer_call", "materializer_into_pool_per_layer", "into_pool_per_layer"]
    x = torch.zeros(1, device=device)
    compiled = _touch[(1,)](x)
    stream = torch.cuda.current_stream().cuda_stream

    def bare() -> None:
        _touch[(1,)](x)

    def direct() -> None:
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, x)

    primitives: dict[str, Callable[[], object]] = {
        "bare_launch": bare,
        "direct_launch": direct,
        "cuda_empty_16x5x8x128": lambda: torch.empty((5, 16, 8, 128), dtype=torch.bfloat16, device=device),
        "is_capturing": torch.cuda.is_current_stream_capturing,
        "current_device": torch.cuda.current_device,
        "cuda_getDevice": torch._C._cuda_getDevice,
        "tensor_layout_facts": lambda: (x.dtype, x.shape, x.stride(), x.device),
        # Each fact alone, and cheaper stand-ins for the device (the fingerprint's share on this host).
        "tensor_dtype": lambda: x.dtype,
        "tensor_shape": lambda: x.shape,
        "tensor_stride": x.stride,
        "tensor_device": lambda: x.device,
        "tensor_get_device": x.get_device,
        "tensor_is_cuda": lambda: x.is_cuda,
        "tensor_data_ptr": x.data_ptr,
        "tensor_version": lambda: x._version,
        "facts_get_device": lambda: (x.dtype, x.shape, x.stride(), x.get_device()),
    }
    if TensorDescriptor is not None and torch.cuda.get_device_capability(device)[0] >= 9:
        # The bench draft's weight (5 layers x 2 x 8 heads x 128 rows, hidden 4096) and a head's tile.
        weight = torch.zeros(5 * 2 * 8 * 128, 4096, device=device, dtype=torch.bfloat16)
        shape, strides = list(weight.shape), list(weight.stride())
        tile = TensorDescriptor(weight, shape, strides, [16, 16])
        out = torch.empty(16, 16, device=device, dtype=torch.bfloat16)
        compiled_tile = _touch_tile[(1,)](tile, out)

        def direct_tma() -> None:
            compiled_tile.run(
                1, 1, 1, stream, compiled_tile.function, compiled_tile.packed_metadata, None, None, None, tile, out
            )

        primitives["tma_descriptor_made"] = lambda: TensorDescriptor(weight, shape, strides, [128, 64])
        primitives["direct_launch_tma_tile"] = direct_tma
    for name, fn in primitives.items():
        print(f"{name:>40}: {_bench.host_time_us(functools.partial(_returns_none, fn)):8.2f} us", flush=True)
    for name in names:
        fn = calls[name]
        for _ in range(2):
            print(
                f"{name:>40}: {_bench.host_time_us(fn):8.2f} us  bare {_bench.host_time_us(bare):8.2f} us", flush=True
            )
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3000):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        print(text.getvalue().split("\n", 6)[-1], flush=True)


def _returns_none(fn: Callable[[], object]) -> None:
    fn()


if __name__ == "__main__":
    main()
