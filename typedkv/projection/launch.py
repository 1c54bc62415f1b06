"""The fused projection kernel's launch: TMA weight descriptors, its arguments by name, its prepared launch."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch
import triton

from typedkv.core import launcher
from typedkv.core.launch_args import (
    INPUT_VALUES,
    NO_SCALES,
    Inputs,
    Scale,
    ScaleOut,
    input_extents,
    scale_pair,
    wide_offsets,
)
from typedkv.core.launcher import INTERPRETED, KernelLaunch, TensorDescriptor, device_name
from typedkv.kv.launch import KVGeometry, head_extents, kv_arguments, v_norm_of
from typedkv.projection.kernel import project_kv_kernel
from typedkv.projection.tuning import ProjectionConfig

VALUES = (
    "hidden_ptr", "w_ptr", "bias_ptr", *INPUT_VALUES, "k_ptr", "v_ptr", "layer_offsets_ptr", "scales", "v_norm",
    "scale_out",
)  # fmt: skip
"""The names of `call_values`' values: the fused projection kernel's per-call arguments."""

_DESCRIPTORS = ("w_half_desc", "w_head_desc", "w_pass_desc")
"""The kernel's TMA descriptors of the weight, made per call from its ``w_ptr`` (`ProjectionLaunch`)."""


def call_values(
    hidden: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    inputs: Inputs,
    slots: torch.Tensor | None,
    destinations: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    scales: tuple[Scale, Scale] = (None, None),
    v_norm_weight: torch.Tensor | None = None,
    scale_out: ScaleOut | None = None,
) -> tuple[Any, ...]:
    """A call's values, in `VALUES`' order (what `KernelLaunch` fills in at each call of a `projection_launch`).

    ``hidden`` ``[T, hidden]`` and ``kv_weight`` ``[L*2*H*D, hidden]`` (each layer's K rows, then its V rows;
    ``kv_bias`` ``[L*2*H*D]`` or None) replace `typedkv.kv.launch.call_values`' ``kv``;
    ``destinations`` is ``(k_dst, v_dst, layer_offsets)`` and the rest is as there.
    """
    norm_weight, eps, cos_sin_cache, positions = inputs
    k_dst, v_dst, layer_offsets = destinations
    eps_tensor, eps_float = (eps, 0.0) if isinstance(eps, torch.Tensor) else (None, float(eps))
    scale_values = NO_SCALES if scales[0] is None and scales[1] is None else scale_pair(scales)
    return (
        hidden, kv_weight, kv_bias, norm_weight, eps_tensor, eps_float, cos_sin_cache, positions, slots,
        k_dst, v_dst, layer_offsets, scale_values, v_norm_of(v_norm_weight), scale_out,
    )  # fmt: skip


def projection_wide(values: tuple[Any, ...], geometry: KVGeometry, num_layers: int) -> bool:
    """A fused projection launch's ``WIDE`` (`typedkv.core.launch_args.wide_offsets`) from a call's `call_values`."""
    named = dict(zip(VALUES, values, strict=True))
    extents = (*_extents(named), *head_extents(geometry), *input_extents(named, named["scales"], num_layers))
    return wide_offsets(*extents)


def _extents(named: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """The ``(count, stride)`` products of a fused launch beside the K/V kernel's: ``hidden``'s and the weight's
    columns."""
    hidden, kv_weight = named["hidden_ptr"], named["w_ptr"]
    return (hidden.shape[1], hidden.stride(1)), (hidden.shape[1], kv_weight.stride(1))


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
    values: tuple[Any, ...],
    geometry: KVGeometry,
    *,
    num_layers: int,
    config: ProjectionConfig = ProjectionConfig(),
    weight_aligned: bool = True,
) -> ProjectionLaunch:
    """The fused projection's launch of a layout, from a call's `call_values`; called with each call's.

    The weight's tiles load by TMA where ``config`` and `weight_blocks` allow, and
    ``weight_aligned`` (`weight_aligned` of the calls it serves: the caller keeps
    launches apart by it).
    """
    num_kv_heads, head_dim, neox = geometry[:3]
    named = dict(zip(VALUES, values, strict=True))
    hidden, kv_weight = named["hidden_ptr"], named["w_ptr"]
    num_tokens, hidden_size = hidden.shape
    rotary_dim = named["cos_sin_ptr"].shape[-1]
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
    arguments = dict(
        **named, **kv_arguments(named, geometry, num_layers, _extents(named)),
        **dict(zip(_DESCRIPTORS, _descriptor_blocks(blocks), strict=True)),
        hidden_stride_t=hidden.stride(0), hidden_stride_k=hidden.stride(1),
        w_stride_n=kv_weight.stride(0), w_stride_k=kv_weight.stride(1),
        HIDDEN=hidden_size, HAS_BIAS=named["bias_ptr"] is not None, W_TMA=blocks is not None,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_D=block_d, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        NUM_STAGES=num_stages, V_STAGES=v_stages, GROUP_M=group_m,
        EARLY_ROPE=early_rope, EARLY_LOADS=early_loads, L2_BEFORE_WAIT=l2_columns, SIGNAL_NEXT=signal and programmatic,
    )  # fmt: skip
    grid = (triton.cdiv(num_tokens, block_m), num_layers * 2 * num_kv_heads, 1)
    return ProjectionLaunch(project_kv_kernel, grid, arguments, VALUES, num_warps, blocks)


class ProjectionLaunch(KernelLaunch):
    """The fused projection's launch: a `KernelLaunch` that knows its weight descriptors' blocks (None: by pointer).

    Where the kernel takes a TMA descriptor of the weight (`_DESCRIPTORS`), the layout fixes
    the descriptor's block, and a call's descriptor is made of its weight (``w_ptr``):
    `arguments` makes the descriptors; a direct launch passes each one encoded, as Triton's
    launcher would encode it, once per weight address (`_encodings`).
    """

    def __init__(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        arguments: dict[str, Any],
        per_call: tuple[str, ...],
        num_warps: int,
        weight_blocks: tuple[int, int, int, int] | None,
    ) -> None:
        super().__init__(kernel, grid, arguments, per_call, num_warps)
        self.weight_blocks = weight_blocks
        names = launcher.parameter_names(kernel)
        self._weight_at = names.index("w_ptr")
        self._descriptor_slots = tuple(
            i for i, name in enumerate(names) if name in _DESCRIPTORS and arguments[name] is not None
        )
        self._encodings: dict[int, tuple[list[Any], ...]] = {}

    def arguments(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """The kernel's arguments, in order: `KernelLaunch.arguments`, the weight's descriptors made."""
        return self._described(super().arguments(values))

    def _described(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        """``params`` with a descriptor of the weight in each descriptor's place (which holds its block)."""
        if not self._descriptor_slots:
            return params
        made = list(params)
        weight = params[self._weight_at]
        shape, strides = list(weight.shape), list(weight.stride())
        for i in self._descriptor_slots:
            made[i] = TensorDescriptor(weight, shape, strides, list(params[i]))
        return tuple(made)

    def _encoded(self, params: tuple[Any, ...], metas: list[Any]) -> Sequence[Any]:
        if not self._descriptor_slots:
            return params
        address = params[self._weight_at].data_ptr()
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


def _descriptor_blocks(blocks: tuple[int, int, int, int] | None) -> tuple[tuple[int, int] | None, ...]:
    """The blocks of the fused kernel's three weight descriptors (`_DESCRIPTORS`) for `weight_blocks`' ``blocks``
    and the launch's ``BLOCK_K`` (all None: loads by pointer).

    A head of full rotary (no pass-through rows, ``blocks[2]`` 0) loads K as a whole head too: its
    halves' and pass-through descriptors are None (each one passed is one more to encode).
    """
    if blocks is None:
        return None, None, None
    half, head, rest, block_k = blocks
    if not rest:
        return None, (head, block_k), None
    return (half, block_k), (head, block_k), (rest, block_k)
