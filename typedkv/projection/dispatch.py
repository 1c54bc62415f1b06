"""The one place that picks how a materializer's call computes its projection.

Three ways (`Way`): the fused projection kernel (`typedkv.projection.fused.project_kv`, the Triton kernel or,
where it runs, the warp-specialised Gluon kernel); V written by the GEMM straight into dense outputs and the
K/V kernel on K (`typedkv.projection.fused.project_kv_split`); or one GEMM into the workspace, then the K/V
kernel. ``projection_path="auto"`` reads the measured tables (`typedkv.projection.tuning`,
`typedkv.projection.warp_specialized`); a device or Triton release they do not list gets GEMM + kernel.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from typedkv.core import launcher
from typedkv.core.tensor_types import strided
from typedkv.kv.impl import DenseCall, PoolCall
from typedkv.projection import launch as fused_launch
from typedkv.projection import tuning, warp_specialized

ProjectionPath = Literal["auto", "fused", "gemm"]
"""`KVMaterializer.projection_path`: how a call computes the projection."""

Way = Literal["fused", "split", "gemm"]
"""How a materializer's eager call computes: the fused projection (`typedkv.projection.fused.project_kv`);
V written by the GEMM into dense outputs and the K/V kernel on K (`typedkv.projection.fused.project_kv_split`);
or the GEMM into the workspace, then the K/V kernel."""

State = tuple[Tensor, Tensor | None, Tensor | None, float | Tensor, Tensor, Tensor | None]
"""``(kv_weight, kv_bias, k_norm_weight, eps, cos_sin_cache, v_norm_weight)``: what a call reads of the materializer."""


def way(
    path: ProjectionPath, call: DenseCall | PoolCall, state: State, *, num_kv_heads: int, head_dim: int, neox: bool
) -> Way:
    """How an eager call of a new layout computes, ``hidden`` in kv's place in ``call``."""
    hidden = call[0]
    if takes_fused(path, hidden, state, head_dim=head_dim, neox=neox) or _takes_warp_specialized(
        path, call, state, num_kv_heads=num_kv_heads, head_dim=head_dim, neox=neox
    ):
        return "fused"
    if (
        isinstance(call, DenseCall)
        and state[1] is None  # no bias (`typedkv.projection.layers.split_gemm`)
        # No V norm: V would be read back to be normed, which the split exists to avoid (GEMM + kernel does it).
        and state[5] is None
        and isinstance(hidden, Tensor)
        and hidden.dim() == 2
        and launcher.use_kernel(hidden.device)
        # V's GEMM writes v_out as [L, T, H*D] rows (a wrong shape is the op check's to reject).
        and (
            call.v_out is None
            or (isinstance(call.v_out, Tensor) and strided(call.v_out) and call.v_out.is_contiguous())
        )
        and tuning.split_gemm_faster(hidden.device, hidden.shape[0])
    ):
        return "split"
    return "gemm"


def takes_fused(path: ProjectionPath, hidden: object, state: State, *, head_dim: int, neox: bool) -> bool:
    """Whether a call takes the fused path (the call's own arguments are checked on it, as on the GEMM's).

    "auto" follows the measured tables (`typedkv.projection.tuning.projection_fused_faster`): the
    fused kernel's weight tiles load by TMA where `typedkv.projection.launch.weight_blocks` and
    the weight's address allow, which makes it faster at more sizes; a draft of too few layers and
    heads to fill the GPU with its programs takes GEMM + kernel. Decided once per
    layout, as the way is kept: a weight buffer replaced later by one off 16 bytes keeps
    the way, its launches loading by pointer.
    """
    # Not a [T, hidden] tensor: the GEMM path's check says so, in its words.
    if path == "gemm" or not isinstance(hidden, Tensor) or hidden.dim() != 2:
        return False
    if not launcher.use_kernel(hidden.device):
        return False  # CPU tensors: the reference, after the GEMM
    if torch.compiler.is_compiling():
        # The fused op checks while tracing; "auto" reads no device table there (GEMM + kernel).
        return path == "fused"
    if path == "fused":
        return True
    weight, rotary_dim = state[0], state[4].shape[-1]
    tma = fused_launch.weight_aligned(weight) and (
        fused_launch.weight_blocks(weight, head_dim, rotary_dim, neox) is not None
    )
    # kv_weight is [L * 2 * H * D, hidden]: a program per D rows.
    programs = weight.shape[0] // head_dim
    return tuning.projection_fused_faster(hidden.device, hidden.shape[0], tma, programs, head_dim)


def _takes_warp_specialized(
    path: ProjectionPath, call: DenseCall | PoolCall, state: State, *, num_kv_heads: int, head_dim: int, neox: bool
) -> bool:
    """Whether "auto" takes the fused path for its warp-specialised kernel (`typedkv.projection.warp_specialized`).

    Calls that kernel can run (``hidden`` in kv's place in ``call``), dense or into pools,
    at the T measured faster there than GEMM + kernel; the fused path then launches it.
    """
    if path != "auto":
        return False
    hidden = call[0]
    if isinstance(call, PoolCall):
        runs = warp_specialized.launchable_pool(
            hidden, state[0], state[1], state[4], call.k_pool, call.scales, num_kv_heads=num_kv_heads,
            head_dim=head_dim, neox=neox, v_norm_weight=state[5],
        )  # fmt: skip
    else:
        runs = warp_specialized.launchable(
            hidden, state[0], state[1], state[4], call.k_out, call.v_out, num_kv_heads=num_kv_heads,
            head_dim=head_dim, neox=neox, v_norm_weight=state[5],
        )  # fmt: skip
    return runs and warp_specialized.faster(hidden.device, hidden.shape[0])
