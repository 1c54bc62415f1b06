"""A `KVMaterializer` method's path to its op: the fused projection as torch ops, and the op each method ends in.

``forward`` ends in `typedkv.materialize_kv`'s op, ``into_pool`` in `typedkv.materialize_kv_into_pool`'s;
traced by ``torch.compile``, the fused path is a torch op of its own (``torch.ops.typedkv.project_kv_*``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from typedkv.core import torch_ops
from typedkv.core.implementation import Plan
from typedkv.kv.api import DENSE_OPS, POOL_OPS, materialize_kv, materialize_kv_into_pool
from typedkv.kv.impl import check_pool_kinds, dense_layout, pool_layout
from typedkv.kv.impl import materialize_kv as materialize_kv_planned
from typedkv.kv.impl import materialize_kv_into_pool as materialize_kv_into_pool_planned
from typedkv.projection.fused import FUSED, FUSED_POOL, declaration, project_kv, project_kv_into_pool


def _allocate_fused_outputs(arguments: list[Any], index: Mapping[str, int]) -> None:
    """The fused dense op traced: ``[L, T, H, D]`` outputs for those left None (ops write, never allocate).

    The arguments are a materializer's own (`KVMaterializer._materialize`):
    ``D`` is read from its weight's ``L * 2*H*D`` rows.
    """
    hidden, kv_weight = arguments[index["hidden"]], arguments[index["kv_weight"]]
    num_layers, num_kv_heads = arguments[index["num_layers"]], arguments[index["num_kv_heads"]]
    shape = (num_layers, hidden.shape[0], num_kv_heads, kv_weight.shape[0] // (num_layers * 2 * num_kv_heads))
    for name in ("k_out", "v_out"):
        if arguments[index[name]] is None:
            arguments[index[name]] = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)


# The fused ops take the projection's arguments in kv's place (`typedkv.projection.fused.declaration`):
# declared for the ops' schemas; calls are checked by FUSED's and FUSED_POOL's own checks.
FUSED.declare(
    declaration(materialize_kv), scalar_dims={"H": "num_kv_heads"}, device_of="hidden", outputs=("k_out", "v_out")
)
FUSED_POOL.declare(
    declaration(materialize_kv_into_pool),
    scalar_dims={"H": "num_kv_heads"},
    device_of="hidden",
    sequence_len={"k_pool": "L", "v_pool": "L", "k_scale_out": "L", "v_scale_out": "L"},
    outputs=("k_pool", "v_pool", "k_scale_out", "v_scale_out"),
    per_row_of={"k_scale_out": "k_pool", "v_scale_out": "v_pool"},
)
FUSED_OPS = torch_ops.TorchOps(FUSED, ("project_kv_out",), allocate=_allocate_fused_outputs, returns=("k_out", "v_out"))
FUSED_POOL_OPS = torch_ops.TorchOps(
    FUSED_POOL, ("project_kv_into_pool_stacked", "project_kv_into_pool_list"), check_kinds=check_pool_kinds
)


class MethodPath(NamedTuple):
    """What differs between `KVMaterializer.forward` and `into_pool`: the op they end in, and its steps."""

    ops: torch_ops.TorchOps  # traced, GEMM + kernel: the public function's op
    fused_ops: torch_ops.TorchOps  # traced, fused
    layout: Callable[[Any], Plan]  # the op's plan of a call's layout (its production check)
    planned: Callable[[Any, Plan, bool], Any]  # the op, eagerly, given the plan (and: right after the GEMM)
    project: Callable[..., Any]  # the fused projection, eagerly, given the plan


DENSE_PATH = MethodPath(DENSE_OPS, FUSED_OPS, dense_layout, materialize_kv_planned, project_kv)
POOL_PATH = MethodPath(POOL_OPS, FUSED_POOL_OPS, pool_layout, materialize_kv_into_pool_planned, project_kv_into_pool)
