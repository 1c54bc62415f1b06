"""Launching the fused kernels (K/V and MLA): block sizes, grid, and one launch for all layers.

No math and no argument checking here: the public ops check, this module picks
the launch configuration and calls the kernel (`KernelLaunch`, for either).

Host time matters at decode sizes (a few tokens), where a launch through
``kernel[grid](...)`` costs more than the kernel runs. After Triton has compiled
a kernel for one configuration, later calls with the same configuration call
the compiled kernel directly; the configuration key covers everything Triton
specialises on (dtypes, constexprs, the exact values of the ints it specialises,
pointer alignment), so the direct call runs exactly what ``kernel[grid]`` would.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import operator
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ._fused_kernel import project_kv_kernel as project_kv_kernel
from ._kernel import materialize_kv_kernel as materialize_kv_kernel
from ._mla_kernel import materialize_mla_kv_kernel as materialize_mla_kv_kernel
from ._types import is_fp8

# Triton decides at decoration time whether a kernel runs under its interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # host-side TMA descriptors, Triton 3.4 and later (imported by name: the module ships no types)
    TensorDescriptor: Any = importlib.import_module("triton.tools.tensor_descriptor").TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the fused projection loads its weights by pointer
    TensorDescriptor = None
# Triton's interpreter keeps the grid position of the launch it runs in global
# state: two launches interpreted at once, from two threads, clash. They take turns.
_INTERPRETER_LOCK = threading.Lock()

# Measured on the H200 (benchmarks/NOTES.md, launch-configuration sweep of
# 2026-11-29 evening): about 1024 K elements per program; 4 warps for a token's
# K of >= 1024 elements, 1 warp for several tokens of a narrow K; K and V in
# one program, except for small batches, where separate K and V programs (grid
# axis 2) give the SMs twice as many programs; a token's layers on neighbouring
# programs, so kv is read front to back.
_SPLIT_BELOW_PROGRAMS = 4096
_WIDE_BELOW_PROGRAMS = 1024  # K and V programs (split) below which they take 8 warps, not 4


@dataclass(frozen=True)
class KVConfig:
    """How the K/V kernel is launched: each field ``None`` is chosen by size and shape, as measured.

    The ops always launch with the default; tests and sweeps build launches
    with other configurations (every one computes the same thing).
    """

    block_t: int | None = None  # tokens per program
    split_kv: bool | None = None  # K and V in separate programs (grid axis 2)
    full_row: bool | None = None  # K as one tile (NeoX RoPE over part of the head only)
    # K as one tile: each rotary dim's partner gathered from the normed row in registers
    # (`tl.gather`) instead of loaded again from kv (an L1 hit; the same bits either way).
    # benchmarks/partner_probe.py and peer_design.py --configs time the two.
    partner_gather: bool = True
    layer_fast: bool = True  # a token's layers on neighbouring programs
    num_warps: int | None = None  # warps per program (None: by the tile's size, as measured)
    # K and V in one program (no split_kv): V's loads issued before K's part instead of after
    # K's stores, which the compiler does not move loads across. H200 (benchmarks/ab_time.py,
    # alternated, 2026-12-01): main case 93.6 -> 95.1% of copy at T = 16384, flat pool 89.0 ->
    # 92.1%, FP8 pool 82.8 -> 92.4%, pages of 64 90.2 -> 92.1%.
    v_first: bool = True


@functools.lru_cache(maxsize=1024)
def block_config(num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D, num_warps)`` for a head shape (cached: it runs on every new layout)."""
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    tile = block_h * block_d
    if tile >= 1024:
        return 1, block_h, block_d, 4
    return min(4, 1024 // tile), block_h, block_d, 1


def split_kv(num_tokens: int, num_layers: int, block_t: int, config: KVConfig) -> bool:
    """Whether K and V go to separate programs: only when there are few programs."""
    if config.split_kv is not None:
        return config.split_kv
    return triton.cdiv(num_tokens, block_t) * num_layers < _SPLIT_BELOW_PROGRAMS


def full_row(head_dim: int, rotary_dim: int, neox: bool, config: KVConfig) -> bool:
    """Whether K is handled as one tile (`_k_row`): NeoX RoPE over part of the head."""
    if config.full_row is not None:
        return config.full_row and neox
    return neox and rotary_dim < head_dim


@functools.lru_cache(maxsize=64)
def _piece_blocks(head_dim: int, rotary_dim: int) -> tuple[int, int]:
    """Block sizes of the rotary half and of the pass-through dims."""
    return triton.next_power_of_2(max(rotary_dim // 2, 1)), triton.next_power_of_2(max(head_dim - rotary_dim, 1))


# Programmatic dependent launch (Hopper and later): a kernel is launched while the
# kernel before it on the stream is still running, its programs start as SMs free
# up, and each waits (griddepcontrol.wait, every kernel's WAIT_PRIOR) for that
# kernel's completion before its first load. The launch and the programs' start
# overlap the prior kernel's tail instead of following it. A switch for A/B runs.
PROGRAMMATIC_LAUNCH = True


def programmatic_launch(device: torch.device) -> bool:
    """Whether launches on ``device`` are programmatic dependent launches (each kernel's ``WAIT_PRIOR``)."""
    return PROGRAMMATIC_LAUNCH and device.type == "cuda" and not INTERPRETED and _capability(device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def use_kernel(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (else the reference).

    Meta tensors (a dry run of shapes) have no values for a kernel, interpreted or not: the reference's
    torch ops give their outputs' shapes."""
    return device.type == "cuda" or (INTERPRETED and device.type != "meta")


def launch_params(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    scales: tuple[Scale, Scale] = (None, None),
    config: KVConfig = KVConfig(),
    table_multiple: int = 1,
    k_only: bool = False,
) -> tuple[tuple[int, int, int], tuple[Any, ...], int]:
    """``(grid, kernel arguments in order, num_warps)`` of one launch.

    ``k_strides``/``v_strides`` are ``(layer, page, slot in page, head)`` element
    strides of the destinations (the last dim is contiguous); row ``r`` is page
    ``r // page_size``, slot ``r % page_size`` (``page_size`` 1: one row per
    page). ``slots`` maps tokens to rows (``None``: row = token); rows outside
    ``[0, num_rows)`` are skipped. ``layer_offsets`` is a ``[2, L]`` int64 table
    of element offsets from ``k_dst``/``v_dst`` to each layer's tensor
    (``None``: layer ``l`` starts at ``l * stride``). ``k_norm_weight`` None:
    no K norm. ``scales``: K's and V's FP8 scales (float, ``[L]`` tensor or
    None), for FP8 destinations only. ``config``: the launch configuration (the
    default: chosen by size). ``table_multiple``: every offset in ``layer_offsets``
    is a multiple of this many elements, for every call of the launch (the caller
    checks; 16 bytes' worth lets the kernel store whole vectors). ``k_only``: write
    K only, V being written by the caller (a materializer's GEMM into dense outputs,
    `split_gemm_faster`): the split launch's K programs alone; kv's last dim then
    holds K's ``H*D`` only and ``v_dst`` is not touched.
    """
    num_tokens, num_layers, _ = kv.shape
    rotary_dim = cos_sin_cache.shape[1]
    block_t, block_h, block_d, num_warps = block_config(num_kv_heads, head_dim)
    block_t = config.block_t or block_t
    split = k_only or split_kv(num_tokens, num_layers, block_t, config)
    one_tile_k = full_row(head_dim, rotary_dim, neox, config)
    if one_tile_k and not split:
        # Measured: the one-tile K (`_k_row`) runs best with one warp per 2048
        # elements of a token's K (L=2, H=8, D=256, R=64: 92% of copy vs 81% with 4).
        num_warps = min(8, max(1, block_h * block_d // 2048))
    parts = 1 if k_only else 2 if split else 1  # grid axis 2: K's programs, then V's when split
    if split and num_warps == 4 and triton.cdiv(num_tokens, block_t) * num_layers * parts < _WIDE_BELOW_PROGRAMS:
        # Measured (benchmarks/peer_cases.py --sweep, H200): with this few programs, 8 warps
        # each; T = 16 2.42 -> 2.14 us, T = 64 3.0 -> 2.77 us (L = 5, H = 8, D = 128), one layer
        # at T = 256 3.0 -> 2.76 us; at 2048 programs and more (L = 8 at T = 128) 4 warps are faster.
        num_warps = 8
    num_warps = config.num_warps or num_warps
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(k_dst.dtype)
    destinations, layer_vec = _kv_destination_params(k_dst, k_strides, v_dst, v_strides, layer_offsets, scales)
    wide = wide_offsets(
        (num_layers, kv.stride(1)), (num_kv_heads, k_strides[3]), (num_kv_heads, v_strides[3]),
        *_input_extents(num_layers, k_norm_weight, eps, cos_sin_cache, positions, slots, scales),
    )  # fmt: skip
    params = (
        kv, kv.stride(0), kv.stride(1),
        *_input_params(k_norm_weight, eps, cos_sin_cache, positions, slots),
        *destinations,
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        num_kv_heads, head_dim, rotary_dim, neox, k_norm_weight is not None, isinstance(eps, torch.Tensor),
        slots is not None, page_size, _table_mode(layer_offsets, table_multiple), _scale_mode(scales[0], k_dst),
        _scale_mode(scales[1], v_dst),
        fp8_max, fp8_mant, fp8_min_exp, layer_vec, block_t, block_h, block_d,
        *_piece_blocks(head_dim, rotary_dim), split, INTERPRETED, num_layers, config.layer_fast,
        (2 if config.partner_gather else 1) if one_tile_k else 0,  # FULL_ROW
        config.v_first and not split, programmatic_launch(kv.device), wide,
    )  # fmt: skip
    return (triton.cdiv(num_tokens, block_t) * num_layers, 1, parts), params, num_warps


# The current CUDA stream of a device index as its raw handle (cheaper than a Stream object); None in a
# torch without it. The launches, the materializers' workspace and the device tables read it.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() without its lazy-initialisation check: a direct launch
# follows a kernel[grid] launch, which initialised CUDA (host time at decode sizes).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


Scale = float | torch.Tensor | None
"""An FP8 destination's scale: one float, an ``[L]`` tensor read in the kernel, or None (1.0)."""


def varying(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    scales: tuple[Scale, Scale] = (None, None),
) -> tuple[Any, ...]:
    """The per-call kernel arguments, in kernel order (the slots `KernelLaunch` fills on each call).

    ``scales``: K's and V's, as in `launch_params`.
    """
    if scales[0] is None and scales[1] is None and not isinstance(eps, torch.Tensor):
        # The usual call (no FP8 scales, one eps) without the helpers' calls: host time at decode sizes.
        return (
            kv, k_norm_weight, None, float(eps), cos_sin_cache, positions, slots, k_dst, v_dst, layer_offsets,
            _NO_SCALES,
        )  # fmt: skip
    return (
        kv, k_norm_weight, *_number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, k_dst, v_dst,
        layer_offsets, _scale_pair(scales),
    )  # fmt: skip


def _number_or_tensor(value: float | torch.Tensor | None, default: float) -> tuple[torch.Tensor | None, float]:
    """A kernel's ``(tensor, float)`` argument pair: the tensor when given (read per layer), else the float."""
    if isinstance(value, torch.Tensor):
        return value, default
    return None, default if value is None else float(value)


def _hooks_idle() -> bool:
    """No launch hook registered (a profiler would need Triton's own launch path)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (leave is None or not getattr(leave, "calls", True))


class KernelLaunch:
    """One launch of ``kernel`` prepared from a checked layout, run once per call.

    Built from the first call's full argument list; later calls with the same
    layout (shapes, strides, dtypes, devices) fill in their own tensors and
    floats -- the slots that are not constexprs and hold a tensor, a float or
    ``None`` (an absent tensor), or a tuple holding one (Triton takes tuples
    whole; their ints are the layout's) -- in kernel order. Everything else
    (ints, constexprs) is fixed by the layout. On CUDA the compiled kernel is called
    directly once Triton has built it: every value Triton specialises on is
    fixed by the layout, except pointer alignment, which is checked on each call.
    Under Triton 3.6 the call goes to its launcher's C launch itself (`_unwrapped_launch`).
    """

    def __init__(self, kernel: Any, grid: tuple[int, int, int], params: tuple[Any, ...], num_warps: int) -> None:
        constexprs = _constexpr_indices(kernel)
        self.kernel = kernel
        self.grid = grid
        self.num_warps = num_warps
        self.varying = tuple(i for i, p in enumerate(params) if i not in constexprs and _per_call(p))
        # Where the tensors are among the per-call values (a path into a tuple argument): the
        # layout fixes which slots hold a tensor, and only their alignment is checked per call.
        tensors = [path for j, i in enumerate(self.varying) for path in _tensor_paths(params[i], (j,))]
        self._top_tensors = tuple(path[0] for path in tensors if len(path) == 1)
        self._inner_tensors = tuple(path for path in tensors if len(path) > 1)
        # A call's arguments are one C-level gather from (*values, *fixed): every kernel
        # argument's place in that tuple, in kernel order (host time at decode sizes).
        varying = {i: j for j, i in enumerate(self.varying)}
        fixed = [i for i in range(len(params)) if i not in varying]
        self._fixed = tuple(params[i] for i in fixed)
        at = {i: len(varying) + k for k, i in enumerate(fixed)}
        order = [varying[i] if i in varying else at[i] for i in range(len(params))]
        self._gather = operator.itemgetter(*order) if len(order) > 1 else lambda source: (source[order[0]],)
        self.device = next(p for p in params if isinstance(p, torch.Tensor)).device
        self._index = self.device.index
        self.direct = self.device.type == "cuda" and not INTERPRETED
        # A kernel whose WAIT_PRIOR is set waits for the prior kernel before its first load:
        # calls may launch it as a programmatic dependent launch, a variant compiled apart.
        wait_at = _wait_prior_index(kernel)
        self.programmatic = wait_at is not None and params[wait_at] is True
        self._compiled: list[Any] = [None, None]  # [plain launch, programmatic launch]
        # Per compiled variant: Triton's C launch beneath its launcher's per-launch Python
        # (`_unwrapped_launch`), or False where this Triton's launcher is another.
        self._unwrapped: list[Any] = [None, None]

    @property
    def compiled(self) -> Any:
        """The compiled kernel a default call runs directly (None before the first aligned call)."""
        return self._compiled[self.programmatic]

    def arguments(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """The kernel's arguments, in order, for a call's per-call ``values`` (`varying`'s order)."""
        if len(values) != len(self.varying):
            raise ValueError(f"expected {len(self.varying)} per-call values, got {len(values)}")
        return self._gather(values + self._fixed)

    def __call__(self, values: tuple[Any, ...], after_gemm: bool = False) -> None:
        """Launch with this call's tensors and floats, in kernel order.

        ``after_gemm``: the call's own GEMM was launched just before (a materializer's GEMM
        path): a plain launch. After cuBLAS's GEMM a programmatic one was measured slower at
        small T (H200: 0.2-0.7 us at T = 1-256), its early programs holding SMs the GEMM's
        last ones wait for.
        """
        if not self.direct:
            params = self.arguments(values)
            if INTERPRETED:
                with _INTERPRETER_LOCK:
                    self.kernel[self.grid](*params, num_warps=self.num_warps)
            else:
                self.kernel[self.grid](*params, num_warps=self.num_warps)
            return
        programmatic = self.programmatic and not after_gemm
        if _current_device() != self._index:
            with torch.cuda.device(self.device):
                self._cuda(values, programmatic)
        else:
            self._cuda(values, programmatic)

    def _cuda(self, values: tuple[Any, ...], programmatic: bool) -> None:
        aligned = self._aligned(values)
        compiled = self._compiled[programmatic]
        if compiled is None or not aligned or not _hooks_idle():
            options = _PROGRAMMATIC if programmatic else {}
            compiled = self.kernel[self.grid](*self.arguments(values), num_warps=self.num_warps, **options)
            # Only a kernel compiled for aligned pointers serves later aligned calls.
            if aligned and not hasattr(compiled, "result"):
                self._compiled[programmatic] = compiled
            return
        if current_raw_stream is not None:
            stream = current_raw_stream(self._index)
        else:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        self._direct(compiled, programmatic, stream, self._gather(values + self._fixed))

    # The kernel's TMA descriptor arguments (positions in its argument list; `ProjectionLaunch`).
    _descriptor_slots: tuple[int, ...] = ()

    def _direct(self, compiled: Any, programmatic: bool, stream: int, params: tuple[Any, ...]) -> None:
        """Run ``compiled`` (the ``programmatic`` variant) on ``stream`` with the kernel's arguments ``params``."""
        unwrapped = self._unwrapped[programmatic]
        if unwrapped is None:
            unwrapped = self._unwrapped[programmatic] = _unwrapped_launch(compiled, self._descriptor_slots) or False
        grid = self.grid
        if unwrapped is False:
            compiled.run(
                grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                *self._described(params),
            )  # fmt: skip
            return
        launch, metas, flags = unwrapped
        launch(
            grid[0], grid[1], grid[2], stream, compiled.function, *flags, None, None, compiled.packed_metadata, None,
            None, None, *self._encoded(params, metas),
        )  # fmt: skip

    def _described(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        """``params`` as Triton's launcher takes them (`ProjectionLaunch`: the weight's descriptors made)."""
        return params

    def _encoded(self, params: tuple[Any, ...], metas: list[Any]) -> Sequence[Any]:
        """``params`` as the C launch takes them (`ProjectionLaunch`: each descriptor as its encoding)."""
        return params

    def _aligned(self, values: tuple[Any, ...]) -> bool:
        """Whether this call's tensors start on 16 bytes, as Triton specialises (those inside tuples too)."""
        for j in self._top_tensors:
            if values[j].data_ptr() & 15:
                return False
        return _aligned(values, self._inner_tensors)


_PROGRAMMATIC = {"launch_pdl": True}  # Triton's launch option: a programmatic dependent launch


def _per_call(value: Any) -> bool:
    """Whether a kernel argument changes from call to call: a tensor, a float, None, or a tuple holding one."""
    if isinstance(value, tuple):
        return any(map(_per_call, value))
    return value is None or isinstance(value, (torch.Tensor, float)) or _is_descriptor(value)


def _is_descriptor(value: Any) -> bool:
    """Whether ``value`` is a TMA descriptor (made per call: it holds its tensor's address)."""
    return TensorDescriptor is not None and isinstance(value, TensorDescriptor)


def _tensor_paths(value: Any, path: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The paths of the tensors in ``value`` (itself at ``path``), inside tuples too."""
    if isinstance(value, tuple):
        return [found for k, item in enumerate(value) for found in _tensor_paths(item, (*path, k))]
    return [path] if isinstance(value, torch.Tensor) else []


def _aligned(values: tuple[Any, ...], tensors: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the tensors at ``tensors``' paths in ``values`` start on 16 bytes, as Triton specialises."""
    for path in tensors:
        value: Any = values
        for k in path:
            value = value[k]
        if value.data_ptr() & 15:
            return False
    return True


class Launch(KernelLaunch):
    """The K/V kernel's launch, from `launch_params`' arguments; called with `varying`'s values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grid, params, num_warps = launch_params(*args, **kwargs)
        super().__init__(materialize_kv_kernel, grid, params, num_warps)


@functools.cache
def _wait_prior_index(kernel: Any) -> int | None:
    """The position of ``kernel``'s ``WAIT_PRIOR`` parameter (`programmatic_launch`), or None."""
    names = list(inspect.signature(kernel.fn).parameters)
    return names.index("WAIT_PRIOR") if "WAIT_PRIOR" in names else None


@functools.cache
def _constexpr_indices(kernel: Any) -> frozenset[int]:
    """The positions of ``kernel``'s ``tl.constexpr`` parameters (a jitted or an interpreted kernel)."""
    parameters = inspect.signature(kernel.fn).parameters.values()
    # Annotations are strings under `from __future__ import annotations`.
    return frozenset(i for i, p in enumerate(parameters) if p.annotation in ("tl.constexpr", tl.constexpr))


# ---------------------------------------------------------------------- MLA


@dataclass(frozen=True)
class MLAConfig:
    """How the MLA kernel is launched: about ``tile`` elements of latent rows per program.

    The default is the best of benchmarks/mla_sweep.py on the H200 (2026-12-01,
    L=5, C=512, R=64, bf16): two tokens' latent rows per program on one warp --
    with the kernel's latent-first loads, dense 93.8% of copy at T = 65536 (2048
    elements on 2 warps: the same; 4 warps: 82.5%), pages of 64 86.7%, FP8 86.0%.
    ``num_warps`` None: 4 for a tile of >= 1024 elements, else 1.
    """

    tile: int = 1024
    num_warps: int | None = 1


@functools.lru_cache(maxsize=64)
def mla_block_config(kv_lora_rank: int, rotary_dim: int, config: MLAConfig) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_C, BLOCK_HALF, num_warps)`` of the MLA kernel."""
    block_c = triton.next_power_of_2(max(kv_lora_rank, 1))
    block_half = triton.next_power_of_2(max(rotary_dim // 2, 1))
    block_t = max(1, config.tile // block_c)
    warps = config.num_warps
    if warps is None:
        warps = 4 if block_t * block_c >= 1024 else 1
    return block_t, block_c, block_half, warps


def mla_launch(
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    dst: torch.Tensor,
    strides: tuple[int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    kv_lora_rank: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    kv_scale: float | torch.Tensor | None,
    table_multiple: int = 1,
    config: MLAConfig = MLAConfig(),
) -> KernelLaunch:
    """The MLA kernel's launch; called with `mla_varying`'s values.

    ``strides`` are ``(layer, page, slot in page)`` element strides of ``dst``
    (rows are contiguous); the rest as in `launch_params`, with a ``[L]`` table
    of ``layer_offsets``, each a multiple of ``table_multiple`` elements (for
    every call of the launch: the caller checks). ``config``: the launch
    configuration (the default unless a sweep asks for another).
    """
    num_tokens, num_layers, _ = ckv.shape
    rotary_dim = cos_sin_cache.shape[1]
    block_t, block_c, block_half, num_warps = mla_block_config(kv_lora_rank, rotary_dim, config)
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(dst.dtype)
    stride_l, stride_page, stride_slot = strides
    layer_vec = _pow2_divisor(stride_l, 16)
    params = (
        ckv, ckv.stride(0), ckv.stride(1),
        *_input_params(kv_norm_weight, eps, cos_sin_cache, positions, slots),
        dst, stride_l // layer_vec, stride_page, stride_slot,
        layer_offsets,
        _scale_params(kv_scale),
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        kv_lora_rank, rotary_dim, neox, kv_norm_weight is not None, isinstance(eps, torch.Tensor),
        slots is not None, page_size,
        _table_mode(layer_offsets, table_multiple), _scale_mode(kv_scale, dst), fp8_max, fp8_mant, fp8_min_exp,
        layer_vec,
        block_t, block_c, block_half, INTERPRETED, num_layers, programmatic_launch(ckv.device),
        wide_offsets(
            (num_layers, ckv.stride(1)),
            *_input_extents(num_layers, kv_norm_weight, eps, cos_sin_cache, positions, slots, (kv_scale,)),
        ),
    )  # fmt: skip
    grid = (triton.cdiv(num_tokens, block_t) * num_layers, 1, 1)
    return KernelLaunch(materialize_mla_kv_kernel, grid, params, num_warps)


def mla_varying(
    ckv: torch.Tensor,
    kv_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    kv_scale: float | torch.Tensor | None,
) -> tuple[Any, ...]:
    """The MLA kernel's per-call arguments, in kernel order."""
    return (
        ckv, kv_norm_weight, *_number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, dst, layer_offsets,
        _scale_params(kv_scale),
    )  # fmt: skip


def _input_params(
    norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
) -> tuple[Any, ...]:
    """The arguments every kernel takes after its input: norm weight, eps, cos/sin cache, positions, slots.

    Each tensor with its strides (0 for one that is absent); eps as its ``(tensor, float)`` pair.
    """
    eps_t, eps_f = _number_or_tensor(eps, 0.0)
    return (
        norm_weight, *(norm_weight.stride() if norm_weight is not None else (0, 0)),
        eps_t, eps_t.stride(0) if eps_t is not None else 0, eps_f,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        positions, positions.stride(0),
        slots, slots.stride(0) if slots is not None else 0,
    )  # fmt: skip


# The kernels multiply a layer's, a token's, a head's and a dim's index by a stride in int32 (the
# fastest code) unless their WIDE constexpr is set; the rows of kv, hidden, pools and outputs and
# their layers' starts are int64 always. The room leaves space for the in-row offsets added to a
# product before it meets a 64-bit pointer.
_INT32_ROOM = 2**31 - 2**20


def wide_offsets(*extents: tuple[int, int]) -> bool:
    """Whether a launch needs its kernel's WIDE: some ``(count, stride)``'s last index times its stride passes
    int32 (a layer-major kv's layer stride, a head-major pool's head stride, a column of a large tensor as
    ``positions``, ...)."""
    return any((count - 1) * abs(stride) >= _INT32_ROOM for count, stride in extents)


def _input_extents(
    num_layers: int,
    norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    scales: tuple[Scale, ...],
) -> tuple[tuple[int, int], ...]:
    """The ``(count, stride)`` products a kernel forms over `_input_params`' tensors and the FP8 scales."""
    extents = [(cos_sin_cache.shape[1], cos_sin_cache.stride(1)), (positions.shape[0], positions.stride(0))]
    if norm_weight is not None:
        extents += [(num_layers, norm_weight.stride(0)), (norm_weight.shape[1], norm_weight.stride(1))]
    if slots is not None:
        extents.append((slots.shape[0], slots.stride(0)))
    extents += [(num_layers, t.stride(0)) for t in (eps, *scales) if isinstance(t, torch.Tensor)]
    return tuple(extents)


def projection_wide(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    head_strides: tuple[int, int],
    scales: tuple[Scale, Scale],
    *,
    num_layers: int,
    num_kv_heads: int,
) -> bool:
    """`wide_offsets` of a fused projection's launch: ``head_strides`` are K's and V's destinations' head strides."""
    return wide_offsets(
        (hidden.shape[1], hidden.stride(1)), (hidden.shape[1], kv_weight.stride(1)),
        *((num_kv_heads, stride) for stride in head_strides),
        *_input_extents(num_layers, k_norm_weight, eps, cos_sin_cache, positions, slots, scales),
    )  # fmt: skip


def _kv_destination_params(
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int, int],
    layer_offsets: torch.Tensor | None,
    scales: tuple[Scale, Scale],
) -> tuple[tuple[Any, ...], int]:
    """The K/V kernels' destination arguments (K's and V's base and strides, the layer table, the scales).

    Also ``LAYER_VEC``: the layer strides arrive divided by it, so the compiler still sees 16-byte aligned rows.
    """
    k_stride_l, k_stride_page, k_stride_slot, k_stride_h = k_strides
    v_stride_l, v_stride_page, v_stride_slot, v_stride_h = v_strides
    layer_vec = _pow2_divisor(k_stride_l | v_stride_l, 16)
    params = (
        k_dst, k_stride_l // layer_vec, k_stride_page, k_stride_slot, k_stride_h,
        v_dst, v_stride_l // layer_vec, v_stride_page, v_stride_slot, v_stride_h,
        layer_offsets, _scale_pair(scales),
    )  # fmt: skip
    return params, layer_vec


def _scale_params(scale: Scale) -> tuple[torch.Tensor | None, int, float]:
    """An FP8 scale as the kernels take it (one tuple argument, `typedkv._epilogue._layer_scale`).

    ``(tensor, its stride, float)``: the tensor read per layer when given, else the float (1.0 for None).
    """
    scale_t, scale_f = _number_or_tensor(scale, 1.0)
    return scale_t, scale_t.stride(0) if scale_t is not None else 0, scale_f


def _scale_pair(scales: tuple[Scale, Scale]) -> tuple[tuple[torch.Tensor | None, int, float], ...]:
    """K's and V's scales as the K/V kernels' ``scales`` argument."""
    return _scale_params(scales[0]), _scale_params(scales[1])


_NO_SCALES = _scale_pair((None, None))


def _table_mode(layer_offsets: torch.Tensor | None, table_multiple: int) -> int:
    """A kernel's ``LAYER_TABLE``: 0 without a layer table, else the multiple its offsets are of."""
    return 0 if layer_offsets is None else table_multiple


def _pow2_divisor(value: int, cap: int) -> int:
    """The largest power of two, at most ``cap``, that divides ``value``."""
    if value == 0:
        return cap
    return min(value & -value, cap)


def _fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """``(largest finite, mantissa bits, smallest normal exponent)`` of an FP8 dtype."""
    if not is_fp8(dtype):
        return 0.0, 0, 0
    info = torch.finfo(dtype)
    return info.max, round(-math.log2(info.eps)), round(math.log2(info.tiny))


def _scale_mode(scale: float | torch.Tensor | None, dst: torch.Tensor) -> int:
    if not is_fp8(dst.dtype):
        return 0
    # An FP8 destination is always saturated; a missing scale means 1.0.
    return 2 if isinstance(scale, torch.Tensor) else 1


# ------------------------------------------------- projection fused with K/V


class Blocks(NamedTuple):
    """A fused projection launch's configuration, as `ProjectionConfig.blocks` settles it."""

    block_m: int
    block_k: int
    num_stages: int
    early_rope: bool
    early_loads: bool
    tma: bool
    group_m: int
    num_warps: int
    # The V heads' pipeline depth; None in the tables: as K's (``num_stages``).
    v_stages: int | None = None
    # Under a programmatic dependent launch (`programmatic_launch`): the first weight columns
    # of each head asked of L2 before the program waits for the prior kernel (0: none), and
    # the next kernel let launch once a program's weight loop is done.
    l2_before_wait: int = 0
    signal_next: bool = False


@dataclass(frozen=True)
class ProjectionConfig:
    """How the fused projection kernel (`project_kv_kernel`) is launched.

    A field left ``None`` comes from `PROJECTION_BLOCKS` by the batch's size
    (measured on the H200, ``benchmarks/fused_sweep.py``), or from
    `PROJECTION_BLOCKS_TMA` where the weight's tiles can load by TMA (the rows of
    `PROJECTION_BLOCKS_TMA_BY_DEVICE` on a device measured apart), with the
    pipeline's depth, then ``block_k``, reduced until it fits the device's shared
    memory. Tests and sweeps pass others; every configuration computes the same thing.
    """

    block_m: int | None = None  # tokens per program
    block_k: int | None = None  # hidden columns per step of the K loop
    num_warps: int | None = None
    num_stages: int | None = None  # software pipelining of the K loop (tl.range)
    # K's RoPE rows loaded before the GEMM loop, their latency hidden behind it (registers:
    # 2 * block_m * R/2 floats more through the loop).
    early_rope: bool | None = None
    # The epilogue's other loads (per-layer pools' table entry, a tensor scale, eps, the K
    # norm weights) before the loop too.
    early_loads: bool | None = None
    # Weight tiles loaded by TMA (Hopper's tensor memory accelerator, from host-side
    # descriptors) instead of by pointer. Taken only where it can be (`weight_blocks`):
    # NeoX RoPE, each piece of a head a power of two >= 16 rows, the weight's rows
    # 16-byte aligned; elsewhere the weights load by pointer whatever this says.
    tma: bool | None = None
    # Token blocks per band of programs (1: none): programs running together share a
    # band of ``hidden``'s rows, which stays in L2 while every head passes over it.
    group_m: int | None = None
    # The V heads' pipeline depth (None: the table's where ``num_stages`` is the table's too,
    # else as K's). Where all programs run at once (small T) each program's loads are bound
    # by their latency: K's programs, with more of them in flight than V's, end their loop
    # first, and their longer epilogue overlaps V's last loads.
    v_stages: int | None = None
    # Where launches are programmatic dependent ones (`programmatic_launch`): the first weight
    # columns of each head asked of L2 before a program waits for the prior kernel, so that
    # they stream in while that kernel ends (a power of two, 0: none), and the next kernel let
    # launch when a program's weight loop is done, so that its launch overlaps this epilogue.
    l2_before_wait: int | None = None
    signal_next: bool | None = None

    def blocks(
        self,
        num_tokens: int,
        head_rows: int,
        itemsize: int,
        shared_memory: int,
        tma_possible: bool = False,
        device_name: str = "",
    ) -> Blocks:
        """The launch configuration for ``num_tokens``; ``head_rows`` weight rows per program.

        ``tma_possible``: the weight's tiles can load by TMA (`weight_blocks`), so the
        defaults come from `PROJECTION_BLOCKS_TMA` unless ``tma`` is False, or from
        `PROJECTION_BLOCKS_TMA_BY_DEVICE`'s rows for ``device_name`` where it has them.
        """
        if tma_possible and self.tma is not False:
            table = PROJECTION_BLOCKS_TMA_BY_DEVICE.get(device_name, PROJECTION_BLOCKS_TMA)
        else:
            table = PROJECTION_BLOCKS
        measured = next(blocks for most, blocks in table if num_tokens <= most)
        block_m = self.block_m or measured.block_m
        block_k = self.block_k or measured.block_k
        stages = self.num_stages or measured.num_stages
        early_rope = measured.early_rope if self.early_rope is None else self.early_rope
        early_loads = measured.early_loads if self.early_loads is None else self.early_loads
        tma = measured.tma if self.tma is None else self.tma
        group_m = self.group_m or measured.group_m
        num_warps = self.num_warps or measured.num_warps
        l2_before_wait = measured.l2_before_wait if self.l2_before_wait is None else self.l2_before_wait
        signal_next = measured.signal_next if self.signal_next is None else self.signal_next

        # A stage holds a hidden tile and the head's weight tile.
        def fits() -> bool:
            return stages * (block_m + head_rows) * block_k * itemsize <= shared_memory

        while self.num_stages is None and stages > 2 and not fits():
            stages -= 1
        while self.block_k is None and block_k > 16 and not fits():
            block_k //= 2
        if self.v_stages is not None:
            v_stages = self.v_stages
        elif self.num_stages is None and measured.v_stages is not None:
            # The table's V depth in proportion to K's, where shared memory made K's shallower.
            v_stages = max(2, -(-stages * measured.v_stages // measured.num_stages))
        else:
            v_stages = stages
        return Blocks(
            block_m, block_k, stages, early_rope, early_loads, tma, group_m, num_warps, v_stages, l2_before_wait,
            signal_next,
        )  # fmt: skip


# ``ProjectionConfig``'s defaults, (most tokens, blocks), from benchmarks/fused_sweep.py
# on the H200 (benchmarks/NOTES.md). At small T the weights dominate and the time is
# their read: one token block, so each weight row is read once, and a deep pipeline
# (many bytes in flight per SM). Fused / torch.mm alone with these (2026-12-01,
# each configuration beside torch.mm in one process): 0.97x at T = 16 (RoPE rows
# and the epilogue's other loads before the loop; 1.00x with neither), 1.00x at
# 32 (the other loads early; the RoPE rows early too: 1.25x, the extra registers
# spill), 1.14-1.18x at T = 48-64 (loads early not measured there); 1.44x at
# T = 2048 and 1.73x at 16384 with the last, weights by pointer.
PROJECTION_BLOCKS: tuple[tuple[float, Blocks], ...] = (
    (16, Blocks(16, 128, 5, True, True, False, 1, 4)),
    (32, Blocks(32, 128, 5, False, True, False, 1, 4)),
    (64, Blocks(64, 64, 6, False, False, False, 1, 4)),
    (math.inf, Blocks(128, 64, 3, False, False, False, 1, 4)),
)

# The same where the weight's tiles can load by TMA (`weight_blocks`). Up to T = 128
# (2026-12-01, fused_sweep.py, two to five runs; benchmarks/NOTES.md): one wave of programs,
# each one's loads bound by their latency, and K's pipeline deeper than V's, so that K's
# loop ends first and its epilogue overlaps V's last loads. T = 33-64: 64 hidden columns
# a step, K 9 stages, V 7: 1.009-1.024x torch.mm at T = 48 and 1.044-1.079x at 64
# (K and V 4 stages of 128 columns, the default before: 1.059-1.065x / 1.086-1.097x;
# both 9 stages: 1.09-1.14x; V 5: 1.10-1.14x). T = 65-128 the same way: one program of
# 128 tokens a head (8 warps, 178 registers), K 7 stages, V 6: 1.087-1.109x (GEMM + kernel
# 1.102-1.131x; 64 tokens a program, 4 stages, bands of 8, the default before: 1.28-1.33x).
# T = 17-32: TMA, 5 stages of 128 columns, 1.022-1.024x (by pointer 1.040-1.042x). T <= 16:
# TMA, K 6 stages of 128 columns, V 5, RoPE rows and the other loads early: 0.983-0.998x
# dense and 0.988-1.007x into per-layer pools at T = 1 and 16 (two runs, 2026-12-02), against
# 1.005-1.025x / 1.012-1.024x by pointer (PROJECTION_BLOCKS[0]). It stayed by pointer while
# every call made and encoded the descriptors (eager `KVMaterializer` call 1.54-1.89x a bare
# launch by TMA, 1.19-1.30x by pointer); `ProjectionLaunch` now encodes them once per weight
# address, and the two read alike (host_ratios.py, three rounds: 1.15-1.44x by TMA,
# 1.13-1.35x by pointer at T = 16; 1.13-1.16x by TMA at T = 64). Above T = 256: TMA, 8 warps
# (149 registers; 4 warps spill at 255), 4 stages, bands of 8 token blocks: 1.20x at
# T = 2048 (1.44x by pointer, 4 warps, no bands) and 1.21x at 16384 (1.73x); without
# bands 1.28x / 1.65x. T = 129-256 (a later sweep, each beside
# the large-T row in the same run): blocks of 64 tokens, 4 warps (137 registers, no
# spills), bands of 8, 3 stages (74 KB of shared memory: room for three programs to an
# SM, the 320 programs of T = 256 in one wave; 1.253x against 1.720x). The last two fields
# (2026-12-04, fused_sweep.py --before-wait, two processes; docs/performance.md): the next
# kernel let launch after the weight loop up to T = 256, and from 17 to 128 the first 128
# weight columns asked of L2 before the wait: T = 32-64 0.98-1.02x against 1.01-1.07x without,
# back to back; after a kernel that is not a programmatic launch 0.5-1.5 points, none at T = 16.
# T = 33-64, K 8 stages (9 before; 2026-12-06, the H200 lent that day, `fused_sweep.py`, three
# runs of the grid, each / torch.mm): 1.023-1.029 at T = 64 against K 9's 1.042-1.049, 0.969 / 0.974
# at 40, 0.979-0.980 / 0.981-0.983 at 48, 1.029 / 1.026 at 56 (one run); into per-layer pools at
# 64 1.052 / 1.055.
PROJECTION_BLOCKS_TMA: tuple[tuple[float, Blocks], ...] = (
    (16, Blocks(16, 128, 6, True, True, True, 1, 4, 5, 0, True)),
    (32, Blocks(32, 128, 5, False, True, True, 1, 4, None, 128, True)),
    (64, Blocks(64, 64, 8, False, False, True, 1, 4, 7, 128, True)),
    (128, Blocks(128, 64, 7, False, False, True, 1, 8, 6, 128, True)),
    (256, Blocks(64, 64, 3, False, False, True, 8, 4, None, 0, True)),
    (math.inf, Blocks(128, 64, 4, False, False, True, 8, 8)),
)

# `PROJECTION_BLOCKS_TMA` where a device measured other rows best (torch.cuda.get_device_name).
# H100 80GB HBM3 (2026-12-06, fused_sweep.py at T = 1-64, two runs on one machine, dense, each /
# torch.mm, the medians of the rounds; the H200's rows first): V's pipeline one stage shallower
# still, and at 33-64 K's one stage shallower too. T = 1: 1.030-1.031 -> 0.995-0.996 (V 4 stages
# of K's 6); 16: 1.044-1.047 -> 1.006-1.019 (the same); 32: 1.019 -> 1.005-1.006 (V 4 of K's 5);
# 48: 1.006 -> 0.986-0.987 and 64: 1.030-1.042 -> 1.006-1.011 (K 8 stages, V 6). V 3 at 32, K 12
# stages of 64 columns at 1-16 and V 8-9 at 64: 1.05-1.21. Each row is the shared one with the
# depths measured here; every other field, and where T is cut, as there.
PROJECTION_BLOCKS_TMA_BY_DEVICE: dict[str, tuple[tuple[float, Blocks], ...]] = {
    "NVIDIA H100 80GB HBM3": (
        (16, PROJECTION_BLOCKS_TMA[0][1]._replace(v_stages=4)),
        (32, PROJECTION_BLOCKS_TMA[1][1]._replace(v_stages=4)),
        (64, PROJECTION_BLOCKS_TMA[2][1]._replace(num_stages=8, v_stages=6)),
        *PROJECTION_BLOCKS_TMA[3:],
    ),
}


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (no limit under the interpreter)."""
    if device.type != "cuda" or INTERPRETED:
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Triton's driver module ships no type information: imported by name, an Any to mypy.
    driver = importlib.import_module("triton.runtime.driver").driver
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


# Where the fused projection beats GEMM + kernel, measured per device
# (torch.cuda.get_device_name): [low, high) token counts. H200, dense outputs
# (benchmarks/fused_sweep.py, benchmarks/NOTES.md), each / torch.mm alone:
# fused 1.02-1.08x and GEMM + kernel 1.09-1.12x at T = 1, 16 and 32; from
# T = 48 on GEMM + kernel is as fast or faster (1.10-1.13x against 1.14-1.18x
# at 48-64, 1.08x against 1.7x at 16384). H100 80GB HBM3 (2026-12-06, fused_sweep.py
# --defaults --pointer, dense, the medians of its rounds): 1.027x against 1.069x at T = 1,
# 1.043x / 1.079x at 16, 1.044x / 1.080x at 48, 1.082x / 1.091x at 64 (not measured above 64).
# Elsewhere "auto" takes GEMM + kernel.
PROJECTION_FUSED_FASTER: dict[str, tuple[tuple[float, float], ...]] = {
    "NVIDIA H200": ((1, 33),),
    "NVIDIA H100 80GB HBM3": ((1, 65),),
}

# The same where the weight's tiles load by TMA (`weight_blocks`, and the weight on 16
# bytes; `PROJECTION_BLOCKS_TMA`). H200, each / torch.mm, fused against GEMM + kernel
# (2026-12-01, fused_sweep.py, `PROJECTION_BLOCKS_TMA`'s rows): 1.01-1.02x against
# 1.11-1.12x at T = 16 (by pointer; by TMA since 2026-12-02, 0.98-1.00x), 1.02x against 1.10x at 32, 1.01-1.02x against
# 1.10-1.11x at 48, 1.04-1.08x against 1.11-1.15x at 64, 1.11x against 1.10x at 80,
# 1.11x against 1.13x at 96, 1.09-1.10x against 1.12-1.13x at 128. Before K's pipeline was made
# deeper than V's, at T = 64: fused_sweep.py 1.082-1.096x against 1.108-1.119x; typedkv
# bench's end-to-end section, three runs, 1.081-1.099x against 1.103-1.111x. From T =
# 129 on GEMM + kernel is faster (1.11-1.13x against 1.25-1.31x at T = 256, 1.08x
# against 1.15-1.22x at 2048-16384). H100 80GB HBM3 (2026-12-05, fused_sweep.py --defaults, dense, the
# medians of its rounds): 1.023 against 1.065 at T = 1, 1.039 / 1.078 at 16, 1.016 / 1.080 at 32, 1.011 /
# 1.085 at 48, 1.036 / 1.085 at 64, 1.031 / 1.095 at 80, 1.038 / 1.098 at 96, 1.047 / 1.111 at 128, 1.240 /
# 1.156 at 256; typedkv bench's end-to-end section, dense / per-layer pools, fused against GEMM + kernel:
# 1.030 / 1.020 against 1.063 / 1.077 at 1, 1.044 / 1.036 against 1.076 / 1.088 at 16, 1.039 / 1.049
# against 1.085 / 1.104 at 64, 1.215 / 1.229 against 1.148 / 1.159 at 256; per-layer pools
# (2026-12-06, fused_sweep.py --defaults --pools): 1.033 / 1.093 at 16, 1.046 / 1.112 at 64, 1.050 /
# 1.131 at 96, 1.067 / 1.148 at 128, 1.303 / 1.153 at 160.
PROJECTION_FUSED_FASTER_TMA: dict[str, tuple[tuple[float, float], ...]] = {
    "NVIDIA H200": ((1, 129),),
    "NVIDIA H100 80GB HBM3": ((1, 129),),
}

# Where the GEMM path writes V straight into dense outputs, measured per device as
# above: V's rows of each layer as one batched GEMM into v_out ([L, T, H*D] is a batch
# of T x H*D matrices), K's rows as another into the workspace, then the K/V kernel
# on K alone (`launch_params`' k_only): V is never read back nor written again. H200,
# L=5, H=8, D=128, hidden 4096, bf16, each / torch.mm alone, against GEMM + kernel:
# benchmarks/gemm_split.py (medians of 3 alternated rounds) 1.276x / 1.143x at T = 512,
# 1.042x / 1.088x at 2048, 1.081x / 1.083x at 16384 (the batched GEMMs 3% slower than
# one torch.mm there), 1.048x / 1.080x at 65536, K and V bit-equal to GEMM + kernel;
# typedkv bench's end-to-end section (one run each way) 1.215x / 1.229x at 2048 (this
# host's noisiest T), 1.087x / 1.067x at 16384, 1.051x / 1.076x at 65536. Faster in
# both only from 65536 on.
SPLIT_GEMM_FASTER: dict[str, tuple[tuple[float, float], ...]] = {"NVIDIA H200": ((65536, math.inf),)}


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _measured_faster(table: dict[str, tuple[tuple[float, float], ...]], device: torch.device, num_tokens: int) -> bool:
    """Whether ``table`` (per device name, [low, high) token counts) holds ``num_tokens`` for ``device``."""
    return any(low <= num_tokens < high for low, high in table.get(_device_name(device), ()))


def projection_fused_faster(device: torch.device, num_tokens: int, tma: bool = False) -> bool:
    """Whether the measured table says the fused projection is faster at ``num_tokens`` on ``device``.

    ``tma``: its weight tiles would load by TMA (`PROJECTION_FUSED_FASTER_TMA`), else by pointer.
    """
    return _measured_faster(PROJECTION_FUSED_FASTER_TMA if tma else PROJECTION_FUSED_FASTER, device, num_tokens)


def split_gemm_faster(device: torch.device, num_tokens: int) -> bool:
    """Whether the measured table says V written by the GEMM (`SPLIT_GEMM_FASTER`) is faster at ``num_tokens``."""
    return _measured_faster(SPLIT_GEMM_FASTER, device, num_tokens)


def projection_launch(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    k_strides: tuple[int, int, int, int],
    v_dst: torch.Tensor,
    v_strides: tuple[int, int, int, int],
    layer_offsets: torch.Tensor | None,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    num_rows: int,
    neox: bool,
    scales: tuple[Scale, Scale] = (None, None),
    config: ProjectionConfig = ProjectionConfig(),
    table_multiple: int = 1,
    weight_aligned: bool = True,
) -> ProjectionLaunch:
    """The fused projection's launch; called with `projection_varying`'s values (``weight_blocks`` its own).

    ``hidden`` ``[T, hidden]`` and ``kv_weight`` ``[L*2*H*D, hidden]`` (each
    layer's K rows, then its V rows; ``kv_bias`` ``[L*2*H*D]`` or None) replace
    `launch_params`' ``kv``; the destinations and the rest (``table_multiple`` too) are as there.
    The weight's tiles load by TMA where ``config`` and `weight_blocks` allow, and
    ``weight_aligned`` (`weight_aligned` of the calls it serves: the caller keeps
    launches apart by it).
    """
    num_tokens, hidden_size = hidden.shape
    rotary_dim = cos_sin_cache.shape[1]
    # tl.dot takes tiles of at least 16 along every dim.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_half = max(16, triton.next_power_of_2(rotary_dim // 2))
    block_pass = max(16, triton.next_power_of_2(max(head_dim - rotary_dim, 1)))
    k_rows = 2 * block_half + (block_pass if head_dim > rotary_dim else 0)
    tma_blocks = weight_blocks(kv_weight, head_dim, rotary_dim, neox) if weight_aligned else None
    settled = config.blocks(
        num_tokens,
        max(block_d, k_rows),
        hidden.element_size(),
        _shared_memory(hidden.device),
        tma_blocks is not None,
        _device_name(hidden.device),
    )
    block_m, block_k, num_stages, early_rope, early_loads, tma, group_m, num_warps, v_stages, l2_columns, signal = (
        settled
    )
    # Both act through a programmatic dependent launch only (elsewhere a kernel waits for
    # nothing, and its successors launch when it ends). The L2 requests go a 128-byte line
    # at a time, a power of two of them a row.
    programmatic = programmatic_launch(hidden.device)
    if l2_columns and programmatic:
        l2_columns = triton.next_power_of_2(max(l2_columns, 128 // hidden.element_size()))
    else:
        l2_columns = 0
    blocks = (*tma_blocks, block_k) if tma and tma_blocks is not None else None
    fp8_max, fp8_mant, fp8_min_exp = _fp8_format(k_dst.dtype)
    destinations, layer_vec = _kv_destination_params(k_dst, k_strides, v_dst, v_strides, layer_offsets, scales)
    params = (
        hidden, *hidden.stride(), kv_weight, *kv_weight.stride(), kv_bias, *weight_descriptors(kv_weight, blocks),
        *_input_params(k_norm_weight, eps, cos_sin_cache, positions, slots),
        *destinations,
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        hidden_size, num_kv_heads, head_dim, rotary_dim, neox, k_norm_weight is not None, kv_bias is not None,
        isinstance(eps, torch.Tensor), slots is not None, page_size, _table_mode(layer_offsets, table_multiple),
        _scale_mode(scales[0], k_dst), _scale_mode(scales[1], v_dst), fp8_max, fp8_mant, fp8_min_exp,
        layer_vec, num_layers, block_m, block_k, block_d, block_half, block_pass, num_stages, v_stages,
        early_rope, early_loads, "ieee" if hidden.dtype == torch.float32 else "tf32", INTERPRETED,
        blocks is not None, group_m, l2_columns, signal and programmatic, programmatic,
        projection_wide(
            hidden, kv_weight, k_norm_weight, eps, cos_sin_cache, positions, slots, (k_strides[3], v_strides[3]),
            scales, num_layers=num_layers, num_kv_heads=num_kv_heads,
        ),
    )  # fmt: skip
    grid = (triton.cdiv(num_tokens, block_m), num_layers * 2 * num_kv_heads, 1)
    return ProjectionLaunch(project_kv_kernel, grid, params, num_warps, blocks)


class ProjectionLaunch(KernelLaunch):
    """The fused projection's launch: a `KernelLaunch` that knows its weight descriptors' blocks (None: by pointer).

    A call's values hold the weight itself where the kernel takes a TMA descriptor of it
    (`projection_varying`). `arguments` makes the descriptors; a direct launch passes each
    one encoded, as Triton's launcher would encode it, once per weight address (`_encodings`).
    """

    def __init__(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        params: tuple[Any, ...],
        num_warps: int,
        weight_blocks: tuple[int, int, int, int] | None,
    ) -> None:
        super().__init__(kernel, grid, params, num_warps)
        self.weight_blocks = weight_blocks
        self._descriptor_slots = tuple(i for i, p in enumerate(params) if _is_descriptor(p))
        self._descriptor_blocks = tuple(params[i].block_shape for i in self._descriptor_slots)
        self._encodings: dict[int, tuple[list[Any], ...]] = {}

    def arguments(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """The kernel's arguments, in order: `KernelLaunch.arguments`, the weight's descriptors made."""
        return self._described(super().arguments(values))

    def _described(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self._descriptor_slots:
            return params
        made = list(params)
        for i, block in zip(self._descriptor_slots, self._descriptor_blocks, strict=True):
            weight = made[i]
            made[i] = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), list(block))
        return tuple(made)

    def _encoded(self, params: tuple[Any, ...], metas: list[Any]) -> Sequence[Any]:
        if not self._descriptor_slots:
            return params
        address = params[self._descriptor_slots[0]].data_ptr()
        encoded = self._encodings.get(address)
        if encoded is None:
            if len(self._encodings) >= 8:  # a launch serves one weight; a few, if its buffer moves
                self._encodings.clear()
            # A descriptor is a function of the address, shape, strides, dtype and block alone (the
            # launch fixes all but the address), so an entry is right whatever tensor later has the address.
            made = self._described(params)
            encoded = self._encodings[address] = tuple(
                _encode_descriptor(made[i], meta) for i, meta in zip(self._descriptor_slots, metas, strict=True)
            )
        args = list(params)
        for i, value in zip(reversed(self._descriptor_slots), reversed(encoded), strict=True):
            args[i : i + 1] = value
        return args


def _encode_descriptor(descriptor: Any, meta: Any) -> list[Any]:
    """``descriptor``'s arguments as Triton 3.6's launcher passes them (the encoded map, shape, strides)."""
    return list(_nvidia_driver().make_tensordesc_arg(descriptor, meta))


@functools.cache
def _nvidia_driver() -> Any:
    return importlib.import_module("triton.backends.nvidia.driver")


def _unwrapped_launch(compiled: Any, slots: tuple[int, ...]) -> tuple[Any, list[Any], tuple[bool, bool]] | None:
    """``(launch, descriptor metadata, (cooperative, programmatic))``: Triton 3.6's C launch of ``compiled``.

    At decode sizes a call is host-bound, and Triton 3.6's launcher spends Python on every
    launch before its C launch: a function that asks for scratch memory (none here), and,
    for a kernel that takes TMA descriptors (``slots``: their argument positions), another
    that encodes each descriptor anew. The C launch takes the 13 leading arguments
    Triton's own call passes, then the kernel's arguments, each descriptor as its encoding,
    shape and strides (`make_tensordesc_arg`'s). None where the launcher is not that one
    (another Triton version, a kernel with scratch memory): those launches go through
    Triton's launcher.
    """
    try:
        run = compiled.run
        driver = _nvidia_driver()
        if (
            getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13
            or len(inspect.signature(driver.make_tensordesc_arg).parameters) != 2
            or run.global_scratch_size
            or run.profile_scratch_size
        ):
            return None
        flags = (run.launch_cooperative_grid, run.launch_pdl)
        wrapped = run.launch
        if not slots:
            # Without descriptors the launcher's launch is the C function itself.
            return None if hasattr(wrapped, "__code__") else (wrapped, [], flags)
        cells = dict(
            zip(wrapped.__code__.co_freevars, (c.cell_contents for c in wrapped.__closure__ or ()), strict=True)
        )
        usable = (
            set(cells) >= {"launcher", "tensordesc_indices", "tensordesc_meta"}
            and cells["tensordesc_indices"] == set(slots)
            and len(cells["tensordesc_meta"]) == len(slots)
            and all(isinstance(meta, dict) for meta in cells["tensordesc_meta"])
        )
        return (cells["launcher"], list(cells["tensordesc_meta"]), flags) if usable else None
    except (AttributeError, ImportError, KeyError, TypeError, ValueError):
        return None


def weight_blocks(kv_weight: torch.Tensor, head_dim: int, rotary_dim: int, neox: bool) -> tuple[int, int, int] | None:
    """``(R/2, D, D-R)``: the rows of the fused kernel's TMA weight tiles, or None where TMA cannot load them.

    A V head loads its ``D`` rows as one tile, and so does a K head of full rotary; a K head
    with pass-through rows loads its two rotary halves (NeoX: rows ``[0, R/2)`` and
    ``[R/2, R)``) and its pass-through rows ``[R, D)`` as three. TMA loads
    whole blocks of consecutive rows, so each piece must be a power of two of at least 16
    rows (a block, and a `tl.dot` operand), GPT-J's interleaved pairs are out, and the
    weight's rows must be contiguous and start on 16 bytes (TMA's requirement; the base
    address is the caller's to check per call, `weight_aligned`).
    """
    if TensorDescriptor is None or not neox or not _tma_device(kv_weight.device):
        return None
    if kv_weight.stride(1) != 1 or (kv_weight.stride(0) * kv_weight.element_size()) % 16 or 0 in kv_weight.shape:
        return None
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    pieces = (half, head_dim) + ((rest,) if rest else ())
    if any(n < 16 or n & (n - 1) for n in pieces):
        return None
    return half, head_dim, rest


def weight_aligned(kv_weight: torch.Tensor) -> bool:
    """Whether ``kv_weight`` starts on 16 bytes, as a TMA descriptor requires (one address read)."""
    return kv_weight.data_ptr() % 16 == 0


@functools.cache
def _tma_device(device: torch.device) -> bool:
    """Whether the fused kernel may load by TMA on ``device``: Hopper or later, or Triton's interpreter (tests)."""
    if INTERPRETED:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def weight_descriptors(kv_weight: torch.Tensor, blocks: tuple[int, int, int, int] | None) -> tuple[Any, Any, Any]:
    """The fused kernel's three weight descriptors for `weight_blocks`' ``blocks`` (all None: loads by pointer).

    A descriptor holds its tensor's address: a launch's calls make their own, or pass them
    encoded per address (`ProjectionLaunch`; the calls' values hold the weight in their
    places, `projection_varying`). A head of full rotary
    (no pass-through rows) loads K as a whole head too: its halves' and pass-through
    descriptors are None (each one passed is one more to encode).
    """
    if blocks is None:
        return None, None, None
    half, head, rest, block_k = blocks
    shape, strides = list(kv_weight.shape), list(kv_weight.stride())

    def descriptor(place: torch.Tensor | None, rows: int) -> Any:
        return None if place is None else TensorDescriptor(kv_weight, shape, strides, [rows, block_k])

    places = _descriptor_places(kv_weight, blocks)
    return descriptor(places[0], half), descriptor(places[1], head), descriptor(places[2], rest)


def _descriptor_places(kv_weight: torch.Tensor, blocks: tuple[int, int, int, int] | None) -> tuple[Any, Any, Any]:
    """`weight_descriptors`' three places, the weight in those that hold a descriptor (None in the others).

    A head of full rotary (no pass-through rows, ``blocks[2]`` 0) loads K as a whole head: only
    the middle place holds one."""
    if blocks is None:
        return None, None, None
    if not blocks[2]:
        return None, kv_weight, None
    return kv_weight, kv_weight, kv_weight


def projection_varying(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor | None,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    layer_offsets: torch.Tensor | None,
    scales: tuple[Scale, Scale] = (None, None),
    weight_blocks: tuple[int, int, int, int] | None = None,
) -> tuple[Any, ...]:
    """The fused projection kernel's per-call arguments, in kernel order; ``weight_blocks`` the launch's own.

    The weight itself stands where the kernel takes a descriptor of it (`ProjectionLaunch`
    makes or encodes the descriptors).
    """
    return (
        hidden, kv_weight, kv_bias, *_descriptor_places(kv_weight, weight_blocks), k_norm_weight,
        *_number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, k_dst, v_dst, layer_offsets, _scale_pair(scales),
    )  # fmt: skip
