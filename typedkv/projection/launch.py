"""The fused projection kernel's launch: TMA weight descriptors, its argument list, its prepared launch."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch
import triton

from typedkv.core import launcher
from typedkv.core.launch_args import (
    Scale,
    fp8_format,
    input_extents,
    input_params,
    kv_destination_params,
    number_or_tensor,
    scale_mode,
    scale_pair,
    table_mode,
    wide_offsets,
)
from typedkv.core.launcher import (
    INTERPRETED,
    KernelLaunch,
    TensorDescriptor,
    device_name,
    is_descriptor,
)
from typedkv.projection.kernel import project_kv_kernel
from typedkv.projection.tuning import ProjectionConfig


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
        *input_extents(num_layers, k_norm_weight, eps, cos_sin_cache, positions, slots, scales),
    )  # fmt: skip


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (no limit under the interpreter)."""
    if device.type != "cuda" or INTERPRETED:
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Triton's driver module ships no type information: imported by name, an Any to mypy.
    driver = importlib.import_module("triton.runtime.driver").driver
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


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
        device_name(hidden.device),
    )
    block_m, block_k, num_stages, early_rope, early_loads, tma, group_m, num_warps, v_stages, l2_columns, signal = (
        settled
    )
    # Both act through a programmatic dependent launch only (elsewhere a kernel waits for
    # nothing, and its successors launch when it ends). The L2 requests go a 128-byte line
    # at a time, a power of two of them a row.
    programmatic = launcher.programmatic_launch(hidden.device)
    if l2_columns and programmatic:
        l2_columns = triton.next_power_of_2(max(l2_columns, 128 // hidden.element_size()))
    else:
        l2_columns = 0
    blocks = (*tma_blocks, block_k) if tma and tma_blocks is not None else None
    fp8_max, fp8_mant, fp8_min_exp = fp8_format(k_dst.dtype)
    destinations, layer_vec = kv_destination_params(k_dst, k_strides, v_dst, v_strides, layer_offsets, scales)
    params = (
        hidden, *hidden.stride(), kv_weight, *kv_weight.stride(), kv_bias, *weight_descriptors(kv_weight, blocks),
        *input_params(k_norm_weight, eps, cos_sin_cache, positions, slots),
        *destinations,
        num_tokens, cos_sin_cache.shape[0], num_rows,
        # constexprs
        hidden_size, num_kv_heads, head_dim, rotary_dim, neox, k_norm_weight is not None, kv_bias is not None,
        isinstance(eps, torch.Tensor), slots is not None, page_size, table_mode(layer_offsets, table_multiple),
        scale_mode(scales[0], k_dst), scale_mode(scales[1], v_dst), fp8_max, fp8_mant, fp8_min_exp,
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
        self._descriptor_slots = tuple(i for i, p in enumerate(params) if is_descriptor(p))
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
                launcher.encode_descriptor(made[i], meta) for i, meta in zip(self._descriptor_slots, metas, strict=True)
            )
        args = list(params)
        for i, value in zip(reversed(self._descriptor_slots), reversed(encoded), strict=True):
            args[i : i + 1] = value
        return args


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
        *number_or_tensor(eps, 0.0), cos_sin_cache, positions, slots, k_dst, v_dst, layer_offsets, scale_pair(scales),
    )  # fmt: skip
