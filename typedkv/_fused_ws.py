"""The warp-specialised fused projection (Hopper, Gluon): where it may run, and its launch.

`typedkv._fused_ws_kernel` computes a materializer's K and V into dense outputs or
pool rows in one persistent, warp-specialised kernel. End to end on the H200
(2026-12-04, third run; "fused", which "auto" was then at T = 1024 too, and is from
T = 1537 on: `PROJECTION_WS_FASTER`): 1.10x ``torch.mm`` alone at T = 1024,
1.06-1.07x at 2048, 1.03-1.05x at 16384, 1.02x at 65536 (into per-layer pools 1.10x,
1.03-1.04x, 1.02-1.03x, 1.01x), where GEMM + kernel reads 1.10x, 1.08x, 1.07x and 1.04x
(1.07x into pools; docs/performance.md, "The last tile in the MMA warps; tiles of one
head"). "auto" takes it where `PROJECTION_WS_FASTER` says, per device: on the H200 at
T = 736-768 and from 1537 on, on the H100 80GB HBM3 at 736-768 and from 1024 on, both but
in bands of T where it was measured slower (on the H100 2026-12-06: 1.03x at
16384 and 1.04x at 65536 end to end, where GEMM + kernel reads 1.10-1.12x and 1.09-1.10x;
docs/performance.md, "The warp-specialised kernel on the H100"). It is written in Gluon
(Triton 3.6's API, sm_90), so it runs where all of these hold (`launchable`, `aligned`),
and the fused path takes it in the T ranges where it was measured faster (`faster`);
everywhere else the fused path launches `typedkv._fused_kernel` as before:

- a CUDA device of compute capability 9.0, not Triton's interpreter, and a Triton
  release whose Gluon this kernel is written against (`available`: 3.6);
- ``hidden``, the weight and the outputs bfloat16 or float16, all one dtype; no bias;
- NeoX RoPE over the whole head, of ``D`` = 128 dims; ``H*D`` a multiple of 256
  (a tile is one head or two by T, `WS_TILES`, never across K and V);
- TMA's layout rules: ``hidden``'s and the weight's rows contiguous and on 16
  bytes; each output ``[L, T, H, D]`` with its heads contiguous (strides
  ``(., ., D, 1)``) and its other strides on 16 bytes; every base address on 16
  bytes (checked per call).

The call's checks are the fused path's (`typedkv._fused_impl`): this module only
says where the kernel may run and launches it.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, NamedTuple

import torch
import triton

from . import _launch
from ._fused_ws_kernel import project_kv_ws_kernel
from ._types import strided

try:  # Gluon and its host-side TMA descriptors (Triton 3.6; imported by name: they ship no types)
    gl: Any = importlib.import_module("triton.experimental.gluon.language")
    GluonDescriptor: Any = importlib.import_module("triton.experimental.gluon.nvidia.hopper").TensorDescriptor
except (ImportError, AttributeError):
    gl = GluonDescriptor = None

HEAD_DIM = 128
# A tile is two heads' weight rows (never across K and V; `Tiles.block_n`), 64 hidden columns a step.
BLOCK_N, BLOCK_K = 256, 64


class Tiles(NamedTuple):
    """A launch's tiles: ``block_m`` tokens, ``stages`` ring slots, bands of ``group_m`` token blocks, and
    the consumer warps as ``warps_m`` along the tokens by ``warps_n`` along the columns (a warpgroup's
    wgmma takes 64 rows); ``block_n`` weight rows (two heads, or one); ``group_n`` > 0 takes the tiles
    in bands of ``group_n`` weight tiles over every token block instead of ``group_m``'s bands;
    ``last_in_mma``: each program's last tile's epilogue runs in the MMA warps (idle by then, and four
    times the epilogue warps) instead of the epilogue warps."""

    block_m: int
    stages: int
    group_m: int
    warps_m: int
    warps_n: int
    block_n: int = BLOCK_N
    group_n: int = 0
    last_in_mma: bool = True

    @property
    def num_warps(self) -> int:
        """The MMA warps (the load warp and the epilogue warps are the kernel's own)."""
        return self.warps_m * self.warps_n


# Two heads a tile (128 x 256) and one (128 x 128): a persistent kernel's time goes by its busiest
# program's tiles, so where T's token blocks make 128 x 256 tiles fill the last wave of programs
# poorly, the tiles of one head fill it better (H200, 132 SMs, 80 heads: at T = 1280, 800 one-head
# tiles are 7 waves of 6.06, 400 two-head ones 4 of 3.03, which is 8 one-head waves of work).
_TWO_HEADS = Tiles(128, 3, 8, 8, 1)
_ONE_HEAD = Tiles(128, 5, 8, 8, 1, 128)
_ONE_HEAD_LAST_EPI = _ONE_HEAD._replace(last_in_mma=False)

# (most tokens, tiles), measured on the H200 (L=5, H=8, D=128, hidden 4096, bf16; benchmarks/NOTES.md).
# 128 tokens by two heads, 3 slots, bands of 8 token blocks, the two warpgroups one above the other
# (benchmarks/gluon_probe.py: the fastest of 128 x 128 / 128 x 256 / 64 x 256 tiles at T = 2048-65536,
# with the epilogue in the MMA warps). From T = 65536 on, bands of 8 weight tiles over every token
# block (`ws_sweep.py --weight-bands`, 2026-12-03, three rounds, each / torch.mm: 1.023-1.036 dense
# and 1.057-1.061 into per-layer pools against 1.038-1.039 and 1.065-1.068; at 16384 and 32768 not
# faster in every round, at 2048 slower). Below 2048, tiles of one head where T's 128-token blocks
# fill the waves better (`ws_sweep.py --last-tile`, 2026-12-04, one to three runs, each / torch.mm,
# dense / per-layer pools): at 704-768 0.99-1.04 / 1.02-1.06 (two heads 1.07-1.10 / 1.06-1.10), 896
# 1.06 / 1.09 (1.31 / 1.26), 1024 0.96-1.01 / 0.98-1.03 (1.18-1.26 / 1.11-1.18), 1280-1408 0.97 /
# 1.02-1.03 (1.15-1.16 / 1.09-1.15), 1792 0.95 / 1.03 (1.08 / 1.03); two heads at 1152 1.04 / 1.03
# (one 1.05 / 1.06) and 1536 1.03-1.08 / 1.02-1.07 (1.02-1.09 / 1.07-1.13). GEMM + kernel at
# 704-1792: 1.05-1.11. The last tile's epilogue in the MMA warps: faster with two heads at every T
# up to 4096 (0.98-1.00 against 1.03-1.05 at 2048, 1.18-1.26 against 1.30-1.35 at 1024), alike at
# 16384 and 65536 (three rounds); with one head faster up to 768 (0.99-1.04 against 1.04-1.06 at
# 768), slower from 896 on (1.04 against 0.97 at 1408).
WS_TILES: tuple[tuple[float, Tiles], ...] = (
    (768, _ONE_HEAD),
    (1024, _ONE_HEAD_LAST_EPI),
    (1152, _TWO_HEADS),
    (1408, _ONE_HEAD_LAST_EPI),
    (1664, _TWO_HEADS),
    (1792, _ONE_HEAD_LAST_EPI),
    (65535, _TWO_HEADS),
    (math.inf, _TWO_HEADS._replace(group_n=8)),
)


def tiles(num_tokens: int) -> Tiles:
    """The tiles `WS_TILES` gives ``num_tokens``."""
    return next(t for most, t in WS_TILES if num_tokens <= most)


# Where it beats GEMM + kernel, per device (torch.cuda.get_device_name): [low, high) token
# counts. H200, L=5, H=8, D=128, hidden 4096, bf16, each / torch.mm alone
# (benchmarks/gluon_probe.py, the kernel's GEMM with K's epilogue, 2026-12-02): 1.021x at
# T = 2048, 1.047x at 16384 and 65536, where GEMM + kernel reads 1.05-1.10x; 1.51x at 256.
# With the epilogue in warps of its own and `WS_TILES`' tiles by T (2026-12-04), each / torch.mm,
# dense / per-layer pools, this kernel against GEMM + kernel, as the end-to-end bench times them (one
# input set; `ws_sweep.py --tiles` and its default mode, two rounds each, and `typedkv bench --only
# e2e`): at T = 1024 1.083-1.099 / 1.098-1.099 against 1.088-1.114 / 1.092-1.114; 1664 1.057-1.089 /
# 1.060-1.079 against 1.095-1.111 / 1.107-1.116; 1792 1.069-1.071 / 1.058-1.059 against
# 1.069-1.101 / 1.091-1.111 (1.086-1.101 in the kernel's own rounds); 1920 1.034-1.059 /
# 1.046-1.048 against 1.062-1.080 / 1.070-1.072; 2048 1.058 / 1.040 against 1.075 / 1.080. Not
# faster at 648 (1.29-1.31 against 1.09-1.11), 704 (1.087-1.098 against 1.092-1.100), 896
# (1.116-1.122 against 1.079-1.109), 1152 (1.086-1.098 against 1.076-1.086), 1280 (1.087-1.089
# against 1.081-1.119) and 1536 (1.131 against 1.082-1.102). (`ws_sweep.py --last-tile`, four input
# sets in turn, reads this kernel 4-7% faster against torch.mm at 1024-1920 and GEMM + kernel alike:
# 0.96-1.01 at 1024.) At 897-1024 the kernel first took the call on that tie; five later measurements
# at T = 1024 (2026-12-04: `ws_sweep.py --rotation`, `typedkv bench --only e2e`, and
# `benchmarks/clock_probe.py` at full clock and held at the power limit on two machines) put it 0.5-1.5
# points behind GEMM + kernel (1.095-1.109 against 1.087-1.095 at full clock, 1.085-1.094 against
# 1.073-1.082 at the power limit), so it takes the call from 1537 on only. H100 80GB HBM3
# (2026-12-06, `ws_sweep.py`, two rounds each, this kernel against GEMM + kernel, dense / per-layer
# pools): 1.097-1.106 / 1.095-1.103 against 1.112-1.122 / 1.113-1.129 at T = 1024 (two sweeps);
# 1.086-1.091 / 1.103-1.119 against 1.106-1.108 / 1.104-1.114 at 1280; 0.972-0.989 / 0.973-0.992
# against 1.098-1.104 / 1.100-1.112 at 1408; 1.115-1.127 / 1.117-1.125 against 1.112-1.133 /
# 1.115-1.127 at 1536 (a tie); 1.055-1.065 / 1.063-1.065 against 1.112-1.117 at 1664; 1.084-1.089 /
# 1.053-1.061 against 1.104-1.109 / 1.103-1.111 at 1792; 1.048-1.058 / 1.043-1.057 against
# 1.109-1.123 / 1.111-1.145 at 1920; 1.043-1.062 / 1.036-1.042 against 1.109-1.120 / 1.111-1.120 at
# 2048; 1.104-1.134 / 1.096-1.106 against 1.099-1.122 / 1.117-1.137 at 3072 (dense a tie); 1.031-1.037 /
# 1.016-1.018 against 1.100-1.103 / 1.099-1.106 at 16384; 1.047-1.050 / 1.003-1.006 against 1.099-1.100 /
# 1.100-1.104 at 65536. Not faster at 512 (1.281-1.289 against 1.124-1.130) nor 896 (1.123-1.125 /
# 1.156-1.159 against 1.104-1.105 / 1.108-1.112); faster at 768 (1.060-1.072 against 1.109-1.124),
# a band between those two not taken (one point measured in it). So on the H100 from 1024 on.
# Again in balanced rounds (2026-12-06, `typedkv._bench.round_order`; up to three calls, two rounds
# each): at 736 1.084-1.097 / 1.070-1.076 against 1.096-1.121 / 1.116-1.152; 752 1.075-1.077 /
# 1.065-1.070 against 1.109-1.139 / 1.117-1.138; 768 1.061-1.071 / 1.064-1.073 against 1.106-1.114 /
# 1.114-1.125; but 704 1.162-1.175 / 1.088-1.118 against 1.100-1.101 / 1.112-1.119 and 784
# 1.58-1.61 (a seventh row of 128-token tiles), 640 1.22-1.24, 896 1.136-1.144. Hence 736-768 as
# well. From 1024 on as before: 1024 1.107-1.114 / 1.097-1.103
# against 1.114-1.132 / 1.120-1.124; 1152 1.105-1.109 / 1.098-1.099 against 1.109-1.111 / 1.109;
# 1280 1.092-1.093 / 1.124-1.126 against 1.102-1.111 / 1.108-1.112 (a tie); 1536 1.128-1.140 /
# 1.123-1.124 against 1.123-1.126 / 1.116-1.120 (a tie); 1792 1.070-1.077 / 1.059-1.063 against
# 1.095-1.105 / 1.103; 2048 1.052-1.067 / 1.041-1.049 against 1.120-1.125 / 1.116-1.119; 3072
# 1.126-1.139 / 1.103-1.119 against 1.120-1.131 / 1.118-1.120.
# The kernel's tiles are 128 tokens by one head or two (`WS_TILES`), so their count is set by the
# rows of tokens ``m = ceil(T / 128)``; within one ``m`` the kernel's time does not fall with T (the
# H100 at 704: 113 us, at 768: 108) while GEMM + kernel's does. So a loss measured at ``T = 128 m``
# holds for all ``128 (m - 1) < T <= 128 m``, and those bands are left out. Which ``m`` lose is
# measured, not derived: how full the last wave of tiles is does not tell. Balanced rounds,
# 2026-12-06, two rounds each, dense / pools: the H200 at 736 1.071-1.073 / 1.071-1.074
# against 1.091-1.097 / 1.101-1.109; 768 1.081 / 1.079 against 1.097-1.102 / 1.109-1.111; 1024
# 1.105-1.109 / 1.109-1.110 against 1.090 / 1.091-1.092; 1280-1536 1.090-1.147 / 1.113-1.148
# against 1.081-1.114 / 1.078-1.106; 1600 1.067-1.072 / 1.062-1.065 against 1.093-1.095 /
# 1.084-1.096; 1664 1.072-1.084 / 1.065-1.067 against 1.098-1.101 / 1.102-1.104; 1792 1.064-1.068
# / 1.058-1.062 against 1.082 / 1.085-1.086; 2048 1.054-1.071 / 1.041-1.059 against 1.093-1.116 /
# 1.102-1.103; 2304 1.145-1.157 / 1.125 against 1.094-1.106 / 1.082-1.095 (m = 18 out); 2560
# 1.192-1.205 / 1.155-1.158 against 1.108-1.112 / 1.098-1.124 (m = 20 out); 2816 1.032-1.062 /
# 1.036-1.037 against
# 1.082-1.090 / 1.087-1.088; 3072 1.134-1.161 / 1.112-1.115 against 1.087-1.098 / 1.065-1.104
# (m = 24 out); 3328 1.041-1.051 / 1.026-1.034 against 1.083-1.091 / 1.063-1.083; 3584 1.080-1.093
# / 1.052-1.054 against 1.080-1.085 / 1.091-1.104; 4096 1.029-1.035 / 1.018-1.020 against
# 1.093-1.101 / 1.071-1.095. The H100 at 2304 1.127-1.139 / 1.121-1.122 against 1.125-1.134 /
# 1.104-1.119 (a tie); 2560 1.163-1.171 / 1.120-1.128 against 1.115-1.117 / 1.122-1.124 (m = 20
# out); 2816 1.045-1.056 / 1.036 against 1.108-1.129 / 1.110-1.121; 3072 1.109-1.127 / 1.097-1.102
# against 1.113-1.132 / 1.116-1.117 (a tie); 3328 1.059-1.084 / 1.041-1.049 against 1.113-1.120 /
# 1.116-1.122; 3584 1.061-1.079 / 1.047-1.056 against 1.120-1.122 / 1.140-1.155; 4096 0.998-1.026 /
# 1.008-1.019 against 1.122-1.127 / 1.089-1.127. The H100 again at the rows between (2026-12-06,
# later; two calls, two rounds each): m = 17 loses, 2112 1.174-1.188 / 1.132-1.143 against
# 1.112-1.142 / 1.112-1.116 and 2176 1.220-1.255 / 1.156-1.203 against 1.141-1.157 / 1.133-1.146
# (out); 2432 1.048-1.049 / 1.035-1.037 against 1.110-1.133 / 1.109-1.122; 2944 1.037-1.050 /
# 1.029-1.033 against 1.116-1.145 / 1.103-1.149; 3200 1.073-1.086 / 1.055-1.066 against
# 1.121-1.136 / 1.103-1.111; 3456 1.066-1.079 / 1.054-1.056 against 1.104-1.111 / 1.112; 3712
# 1.041-1.048 / 1.007-1.028 against 1.112-1.117 / 1.113-1.125; 3968 1.041-1.044 / 1.005-1.011
# against 1.125-1.139 / 1.111-1.113; 4224 1.030-1.032 / 1.013-1.046 against 1.111-1.121 /
# 1.124-1.136; 4480 0.994-1.004 / 0.973-0.977 against 1.100 / 1.099-1.108.
PROJECTION_WS_FASTER: dict[str, tuple[tuple[float, float], ...]] = {
    "NVIDIA H200": ((736, 769), (1537, 2177), (2305, 2433), (2561, 2945), (3073, math.inf)),
    "NVIDIA H100 80GB HBM3": ((736, 769), (1024, 2049), (2177, 2433), (2561, math.inf)),
}


# The Triton releases whose Gluon the kernel is written against and was run on (major, minor).
# Gluon is experimental and its API changes between releases: under Triton 3.9 the kernel does
# not compile (its TMA copies are `async_load` / `async_store` there), although
# `warp_specialize`'s signature is 3.6's. Elsewhere the fused path keeps its other kernel.
GLUON_RELEASES = ((3, 6),)


@functools.cache
def available() -> bool:
    """Whether this Triton is a release the kernel is written for (`GLUON_RELEASES`), with Gluon importable."""
    if gl is None or GluonDescriptor is None:
        return False
    release = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    return release in GLUON_RELEASES


@functools.cache
def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and not _launch.INTERPRETED and torch.cuda.get_device_capability(device) == (9, 0)


def faster(device: torch.device, num_tokens: int) -> bool:
    """Whether the measured table (`PROJECTION_WS_FASTER`) says this kernel is faster at ``num_tokens``."""
    return device.type == "cuda" and _launch._measured_faster(PROJECTION_WS_FASTER, device, num_tokens)


def _rows_ok(t: Any, dtype: torch.dtype) -> bool:
    """A ``[rows, width]`` tensor of ``dtype`` whose rows TMA can load: contiguous rows, strides and width on 16 bytes."""
    if not isinstance(t, torch.Tensor) or not strided(t) or t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1:
        return False
    size = t.element_size()
    return (t.stride(0) * size) % 16 == 0 and (t.shape[1] * size) % 16 == 0


def _output_ok(t: Any, dtype: torch.dtype, head_dim: int) -> bool:
    """None (the call allocates it, contiguous), or an ``[L, T, H, D]`` output TMA can store as ``[L, T, H*D]``."""
    if t is None:
        return True
    if not isinstance(t, torch.Tensor) or not strided(t) or t.dtype != dtype or t.dim() != 4:
        return False
    size = t.element_size()
    return t.stride(3) == 1 and t.stride(2) == head_dim and all((s * size) % 16 == 0 for s in t.stride()[:2])


def launchable(
    hidden: Any,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    cos_sin_cache: Any,
    k_out: Any,
    v_out: Any,
    *,
    num_kv_heads: int,
    head_dim: int,
    neox: bool,
) -> bool:
    """Whether this kernel can compute a dense call of this layout (the module's list; addresses aside, `aligned`)."""
    if not isinstance(hidden, torch.Tensor) or not available() or not _hopper(hidden.device):
        return False
    dtype = hidden.dtype
    return (
        dtype in (torch.bfloat16, torch.float16)
        and kv_bias is None
        and neox
        and head_dim == HEAD_DIM
        and isinstance(cos_sin_cache, torch.Tensor)
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] == head_dim
        and (num_kv_heads * head_dim) % BLOCK_N == 0
        and _rows_ok(hidden, dtype)
        and _rows_ok(kv_weight, dtype)
        and _output_ok(k_out, dtype, head_dim)
        and _output_ok(v_out, dtype, head_dim)
    )


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every one of ``tensors`` starts on 16 bytes, as TMA requires."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


@functools.cache
def _smem_layout(rank: int) -> Any:
    """The shared-memory layout of a 16-bit tile whose rows are 64 elements or more: 128-byte swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def launch(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    num_layers: int,
) -> None:
    """K and V of ``hidden`` ``[T, hidden]`` into ``k_out``/``v_out`` ``[L, T, H, D]``, the call checked and `launchable`.

    ``eps``: a float, or an ``[L]`` tensor (`typedkv._device_tables.layer_eps`). The
    descriptors hold this call's addresses, so they are made per call: the kernel takes the
    path from T = 1537 on, where a call's GPU time is over 150 us.
    """
    num_tokens = hidden.shape[0]
    hd = k_out.shape[2] * k_out.shape[3]
    cube = _smem_layout(3)
    shape = tiles(num_tokens)
    outs = [
        GluonDescriptor(
            out,
            [num_layers, num_tokens, hd],
            [out.stride(0), out.stride(1), 1],
            [1, shape.block_m, shape.block_n],
            cube,
        )
        for out in (k_out, v_out)
    ]
    # The pools' arguments unused: None (constexprs to Triton) and zeros.
    pools: tuple[Any, ...] = (None, None, None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None, 0, 0)
    _launch_kernel(hidden, kv_weight, k_norm_weight, eps, cos_sin_cache, positions, (*outs, *pools), hd, {})


def launchable_pool(
    hidden: Any,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    cos_sin_cache: Any,
    k_pool: Any,
    scales: tuple[Any, Any],
    *,
    num_kv_heads: int,
    head_dim: int,
    neox: bool,
) -> bool:
    """Whether this kernel can compute a pool call of this layout: `launchable`'s list with pools of ``hidden``'s
    dtype (not FP8, no scales) in place of the outputs (any page size, NHD or HND, stacked or per layer)."""
    if not launchable(
        hidden, kv_weight, kv_bias, cos_sin_cache, None, None, num_kv_heads=num_kv_heads, head_dim=head_dim,
        neox=neox,
    ):  # fmt: skip
        return False
    first: Any
    if isinstance(k_pool, torch.Tensor):
        first = k_pool
    else:
        first = k_pool[0] if isinstance(k_pool, (list, tuple)) and k_pool else None
    return isinstance(first, torch.Tensor) and first.dtype == hidden.dtype and scales[0] is None and scales[1] is None


def launch_pool(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    destinations: tuple[torch.Tensor, tuple[int, int, int, int], torch.Tensor, tuple[int, int, int, int]],
    table: torch.Tensor | None,
    table_multiple: int,
    page_size: int,
    num_rows: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """K and V of ``hidden`` into pool rows at ``cache_loc``'s slots, the call checked and `launchable_pool`.

    ``destinations``: ``(k_dst, k_strides, v_dst, v_strides)`` as `typedkv._impl.pool_destinations` and
    the pool geometry give them (strides ``(layer, page, slot in page, head)`` in elements);
    ``table``: the ``[2, L]`` layer offsets of per-layer pools, or None (stacked); ``table_multiple``
    what every offset is a multiple of (`typedkv._device_tables.layer_table`; 0 without a table).
    """
    k_dst, k_strides, v_dst, v_strides = destinations
    pools = (
        None, None, k_dst, v_dst, table, table.stride(0) if table is not None else 0,
        table.stride(1) if table is not None else 0, *k_strides, *v_strides, cache_loc, cache_loc.stride(0), num_rows,
    )  # fmt: skip
    options = {"POOL": True, "PAGE": page_size, "TABLE": table_multiple}
    _launch_kernel(
        hidden, kv_weight, k_norm_weight, eps, cos_sin_cache, positions, pools, num_kv_heads * head_dim, options
    )


def _launch_kernel(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    destinations: tuple[Any, ...],
    hd: int,
    options: dict[str, Any],
) -> None:
    """One launch: ``destinations`` the kernel's arguments from ``k_desc`` to ``num_rows``, ``options`` its
    constexprs for pools."""
    num_tokens = hidden.shape[0]
    shape = tiles(num_tokens)
    flat = _smem_layout(2)
    a_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [shape.block_m, BLOCK_K], flat)
    w_desc = GluonDescriptor(kv_weight, list(kv_weight.shape), list(kv_weight.stride()), [shape.block_n, BLOCK_K], flat)
    tiles_m = triton.cdiv(num_tokens, shape.block_m)
    tiles_n = kv_weight.shape[0] // shape.block_n
    num_tiles = tiles_m * tiles_n
    per_layer = isinstance(eps, torch.Tensor)
    # Unused pointers (no per-layer eps, no norm) take tensors the call has anyway.
    eps_ptr = eps if isinstance(eps, torch.Tensor) else cos_sin_cache
    eps_stride = eps.stride(0) if isinstance(eps, torch.Tensor) else 0
    norm = k_norm_weight if k_norm_weight is not None else kv_weight
    project_kv_ws_kernel[(min(num_tiles, _sm_count(hidden.device)),)](
        a_desc, w_desc, *destinations, 0.0 if per_layer else float(eps), eps_ptr, eps_stride,
        norm, norm.stride(0), norm.stride(1),
        positions, positions.stride(0), cos_sin_cache.shape[0], cos_sin_cache, cos_sin_cache.stride(0),
        cos_sin_cache.stride(1), num_tokens, tiles_m, tiles_n, num_tiles, triton.cdiv(hidden.shape[1], BLOCK_K),
        HD=hd, D=HEAD_DIM, BM=shape.block_m, BN=shape.block_n, BK=BLOCK_K, STAGES=shape.stages, GROUP_M=shape.group_m,
        GROUP_N=shape.group_n, LAST_MMA=shape.last_in_mma, WARPS_M=shape.warps_m, WARPS_N=shape.warps_n, NORM=k_norm_weight is not None, EPS_PER_LAYER=per_layer,
        num_warps=shape.num_warps, **options,
    )  # fmt: skip
