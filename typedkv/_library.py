"""The ops as registered torch ops (``torch.ops.typedkv.*``), for torch.compile and CUDA graphs.

Eager calls of the public functions never come here: they check and launch
directly, since an op's dispatch costs host time a decode step cannot spare.
While torch.compile traces, the public functions call these ops instead (the
``materialize_kv`` and ``materialize_kv_into_pool`` below, which keep the public
signatures), so the graph holds one opaque op per call and never a graph break:

- the **fake** implementation runs the production checks on the fake tensors,
  so misuse is rejected at trace time with the eager message (debug mode's
  beartype and value checks run in eager calls only);
- the **real** implementation, on CPU and CUDA alike, is the eager checked
  implementation (`_impl`), called when the compiled graph runs;
- every op returns nothing and declares exactly what it writes (``k_out`` and
  ``v_out``, or the two pools) in ``mutates_args``, so functionalization and
  CUDA-graph replay see every write and reorder or alias none of them.

An op schema has no ``float | Tensor`` union: eps and the FP8 scales travel as
a ``(value, tensor)`` pair of which the tensor wins when given.

Written tensors that enter the compiled region as separate tensors sharing one
allocation (K and V pools as two halves of one buffer, per-layer pools as views
of one buffer, ``k_out``/``v_out`` views of one slab) are not written in place
by inductor: it copies them out and back around the op on every call
(pytorch/pytorch#139628), and before torch 2.13 that copy can read past the end
of a view with a storage offset and corrupt it (seen on 2.11). The fake
implementations warn when written tensors share an allocation; separate
allocations, and views taken inside the compiled region from one tensor, are
written in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _impl
from ._checking import check_numbers
from ._types import RopeStyle

# Before this version inductor's copy of a shared allocation can be wrong, not just slow.
_SHARED_COPY_FIXED = (2, 13)


def _split(value: float | Tensor | None) -> tuple[float | None, Tensor | None]:
    return (None, value) if isinstance(value, Tensor) else (value, None)


def _split_eps(eps: float | Sequence[float] | Tensor, kv: Tensor) -> tuple[float | None, Tensor | None]:
    """eps as the schema's ``(value, tensor)`` pair; per-layer numbers as a float32 tensor on kv's device.

    The tensor is a constant of the traced graph. The numbers are checked
    first, with the eager message (the fake sees only the tensor).
    """
    if isinstance(eps, (float, int, Tensor)):
        return _split(eps)
    check_numbers("eps", eps)
    return None, torch.tensor([float(x) for x in eps], dtype=torch.float32, device=getattr(kv, "device", None))


def _join(value: float | None, tensor: Tensor | None) -> float | Tensor | None:
    return tensor if tensor is not None else value


def _static(value: float | None) -> float | None:
    """A traced scalar as the Python number the checks expect (a guard on its value).

    torch.compile passes an ``int`` or ``float`` argument that changed between
    calls as a symbol; the layout checks are on concrete numbers.
    """
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return value


def _warn_shared_allocation(written: Sequence[tuple[str, Tensor]]) -> None:
    """Trace time: warn when tensors an op writes share an allocation (see the module notes)."""
    seen: dict[int, str] = {}
    for name, tensor in written:
        other = seen.setdefault(tensor.untyped_storage()._cdata, name)
        if other == name:
            continue
        harm = "copies them around the op on every call instead of writing in place"
        if _torch_version() < _SHARED_COPY_FIXED:
            harm += f", and with torch {torch.__version__} the copy can corrupt them"
        warnings.warn(
            f"typedkv: {name} shares one allocation with {other}: when such tensors enter a torch.compile'd region "
            f"as separate tensors, inductor {harm} (pytorch/pytorch#139628); give each its own allocation, "
            "or take the views inside the compiled region from one tensor",
            stacklevel=2,
        )
        return


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _eps(value: float | None, tensor: Tensor | None) -> float | Tensor:
    eps = _join(value, tensor)
    assert eps is not None  # the traced functions pass one of the two
    return eps


# ------------------------------------------------------------------ dense op


@torch.library.custom_op("typedkv::materialize_kv_out", mutates_args=("k_out", "v_out"))
def materialize_kv_out(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    rope_style: str,
    k_out: Tensor,
    v_out: Tensor,
) -> None:
    """`typedkv.materialize_kv` into ``k_out`` and ``v_out``."""
    _impl.materialize_kv(
        kv, k_norm_weight, _eps(eps_value, eps_tensor), cos_sin_cache, positions, num_kv_heads, rope_style, k_out, v_out
    )


@materialize_kv_out.register_fake
def _materialize_kv_out_fake(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    rope_style: str,
    k_out: Tensor,
    v_out: Tensor,
) -> None:
    eps = _join(_static(eps_value), eps_tensor)
    heads = _static(num_kv_heads)
    _impl.check_dense((kv, k_norm_weight, eps, cos_sin_cache, positions, heads, rope_style, k_out, v_out))
    _warn_shared_allocation((("k_out", k_out), ("v_out", v_out)))


# ------------------------------------------------------------------- pool ops


@torch.library.custom_op("typedkv::materialize_kv_into_pool_stacked", mutates_args=("k_pool", "v_pool"))
def materialize_kv_into_pool_stacked(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    num_kv_heads: int,
    rope_style: str,
    k_scale_value: float | None,
    k_scale_tensor: Tensor | None,
    v_scale_value: float | None,
    v_scale_tensor: Tensor | None,
    kv_layout: str | None,
) -> None:
    """`typedkv.materialize_kv_into_pool` with stacked pools (``[L, S, H, D]``, or paged)."""
    _pool(
        kv, k_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, k_scale_value, k_scale_tensor, v_scale_value, v_scale_tensor, kv_layout,
    )  # fmt: skip


@torch.library.custom_op("typedkv::materialize_kv_into_pool_list", mutates_args=("k_pool", "v_pool"))
def materialize_kv_into_pool_list(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Sequence[Tensor],
    v_pool: Sequence[Tensor],
    num_kv_heads: int,
    rope_style: str,
    k_scale_value: float | None,
    k_scale_tensor: Tensor | None,
    v_scale_value: float | None,
    v_scale_tensor: Tensor | None,
    kv_layout: str | None,
) -> None:
    """`typedkv.materialize_kv_into_pool` with one pool tensor per layer."""
    _pool(
        kv, k_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, k_scale_value, k_scale_tensor, v_scale_value, v_scale_tensor, kv_layout,
    )  # fmt: skip


def _pool(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    num_kv_heads: int,
    rope_style: str,
    k_scale_value: float | None,
    k_scale_tensor: Tensor | None,
    v_scale_value: float | None,
    v_scale_tensor: Tensor | None,
    kv_layout: str | None,
) -> None:
    _impl.materialize_kv_into_pool(
        kv, k_norm_weight, _eps(eps_value, eps_tensor), cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, _join(k_scale_value, k_scale_tensor), _join(v_scale_value, v_scale_tensor),
        kv_layout,
    )  # fmt: skip


@materialize_kv_into_pool_stacked.register_fake
@materialize_kv_into_pool_list.register_fake
def _pool_fake(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps_value: float | None,
    eps_tensor: Tensor | None,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    num_kv_heads: int,
    rope_style: str,
    k_scale_value: float | None,
    k_scale_tensor: Tensor | None,
    v_scale_value: float | None,
    v_scale_tensor: Tensor | None,
    kv_layout: str | None,
) -> None:
    eps = _join(_static(eps_value), eps_tensor)
    k_scale = _join(_static(k_scale_value), k_scale_tensor)
    v_scale = _join(_static(v_scale_value), v_scale_tensor)
    heads = _static(num_kv_heads)
    _impl.check_pool(
        (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool, heads, rope_style,
         k_scale, v_scale, kv_layout)
    )  # fmt: skip
    _warn_shared_allocation([*_labelled("k_pool", k_pool), *_labelled("v_pool", v_pool)])


def _labelled(name: str, pool: Tensor | Sequence[Tensor]) -> list[tuple[str, Tensor]]:
    return [(name, pool)] if isinstance(pool, Tensor) else [(f"{name}[{i}]", t) for i, t in enumerate(pool)]


# ------------------------------------------------- what the public ops trace


def materialize_kv(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps: float | Sequence[float] | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    *,
    num_kv_heads: int,
    rope_style: RopeStyle,
    k_out: Tensor | None,
    v_out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """`typedkv.materialize_kv` while torch.compile traces: the outputs, then one op call."""
    if k_out is None:
        k_out = _empty_out(kv, k_norm_weight, num_kv_heads)
    if v_out is None:
        v_out = _empty_out(kv, k_norm_weight, num_kv_heads)
    eps_value, eps_tensor = _split_eps(eps, kv)
    materialize_kv_out(
        kv, k_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, num_kv_heads, rope_style, k_out, v_out
    )
    return k_out, v_out


def materialize_kv_into_pool(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps: float | Sequence[float] | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    *,
    num_kv_heads: int,
    rope_style: RopeStyle,
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
    kv_layout: str | None,
) -> None:
    """`typedkv.materialize_kv_into_pool` while torch.compile traces: one op call."""
    eps_value, eps_tensor = _split_eps(eps, kv)
    k_scale_value, k_scale_tensor = _split(k_scale)
    v_scale_value, v_scale_tensor = _split(v_scale)
    if isinstance(k_pool, Tensor) != isinstance(v_pool, Tensor):
        # The eager message; raised here because no op schema takes the mixed layout.
        _impl.check_pool_kinds(k_pool, v_pool)
    if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor):
        materialize_kv_into_pool_stacked(
            kv, k_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
            num_kv_heads, rope_style, k_scale_value, k_scale_tensor, v_scale_value, v_scale_tensor, kv_layout,
        )  # fmt: skip
    else:
        materialize_kv_into_pool_list(
            kv, k_norm_weight, eps_value, eps_tensor, cos_sin_cache, positions, cache_loc, list(k_pool), list(v_pool),
            num_kv_heads, rope_style, k_scale_value, k_scale_tensor, v_scale_value, v_scale_tensor, kv_layout,
        )  # fmt: skip


def _empty_out(kv: Tensor, k_norm_weight: Tensor | None, num_kv_heads: int) -> Tensor:
    """A ``[L, T, H, D]`` output like the eager op allocates.

    Arguments that cannot size it get a placeholder: the op's fake
    implementation rejects them (they come before the outputs) with the eager message.
    """
    heads_ok = isinstance(num_kv_heads, (int, torch.SymInt)) and not isinstance(num_kv_heads, bool) and num_kv_heads > 0
    if kv.dim() == 3 and heads_ok and (k_norm_weight is None or k_norm_weight.dim() == 2):
        # D from the norm weight, else from kv's width (2*H*D).
        head_dim = kv.shape[2] // (2 * num_kv_heads) if k_norm_weight is None else k_norm_weight.shape[1]
        shape = (kv.shape[1], kv.shape[0], num_kv_heads, head_dim)
        return torch.empty(shape, dtype=kv.dtype, device=kv.device)
    return torch.empty(0)
