"""The public ops: shapes declared once in the annotations, checked, then launched.

This module checks and dispatches; the math lives in `_kernel` (CUDA, and CPU
under ``TRITON_INTERPRET=1``) and `_reference` (CPU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, cast

import torch
from torch import Tensor

from . import _launch, _library, _reference
from ._checking import Bound, Signature
from ._config import debug_enabled
from ._errors import InputError
from ._types import KV_WIDTH, RopeStyle, static_jaxtyping

if TYPE_CHECKING:
    # pyrefly reads jaxtyping's names only where they are imported (not through a
    # re-export): the families are those names to every static checker.
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as PoolFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from ._types import Index, ParamFloat, PoolFloat, StorageFloat

_ROTARY_RULE = ("R % 2 == 0 and 2 <= R <= D", "cos_sin_cache", "the rotary dim R must be even and 2 <= R <= D")


@dataclass
class _Plan:
    """What one checked layout needs at every call."""

    bound: Bound
    empty: bool  # T == 0 or L == 0: nothing to compute
    kernel: bool  # the Triton kernel (else the PyTorch reference)
    launch: _launch.Launch | None = None  # built at the first launch, when the outputs exist
    typechecked: bool = False  # debug mode's beartype + jaxtyping pass done for this layout


def _planner(check_relations: Callable[[], None] | None = None) -> Callable[[Bound], _Plan]:
    def build(bound: Bound) -> _Plan:
        if check_relations is not None:
            check_relations()
        dims = bound.dims
        return _Plan(bound, dims["T"] == 0 or dims["L"] == 0, _launch.use_kernel(bound.device))

    return build


def _debug(signature: Signature, plan: _Plan, args: tuple[object, ...]) -> None:
    # The annotations' verdict depends on the layout only: one full beartype +
    # jaxtyping pass per layout; the value checks run on every call.
    if not plan.typechecked:
        signature.debug_check(args, plan.bound)
        plan.typechecked = True


@static_jaxtyping("T L KV H D P R")
def materialize_kv(
    kv: Annotated[StorageFloat[Tensor, "T L KV"], KV_WIDTH],
    k_norm_weight: ParamFloat[Tensor, "L D"],
    eps: float | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"],
    positions: Index[Tensor, " T"],
    *,
    num_kv_heads: int,
    rope_style: RopeStyle = "neox",
    k_out: StorageFloat[Tensor, "L T H D"] | None = None,
    v_out: StorageFloat[Tensor, "L T H D"] | None = None,
) -> tuple[StorageFloat[Tensor, "L T H D"], StorageFloat[Tensor, "L T H D"]]:
    """Materialize K and V of every layer from a stacked K/V projection.

    For every token ``t``, layer ``l`` and kv head ``h``: K is
    ``RoPE(RMSNorm(kv[t, l, K block of h]))`` and V is copied bit for bit. One
    Triton launch covers all layers on CUDA.

    Parameters
    ----------
    kv : Tensor, shape ``[T, L, 2*H*D]``, bfloat16 | float16 | float32
        Per layer, the K block (``H*D`` values, head-major) then the V block.
        May be a strided view (its last dim contiguous).
    k_norm_weight : Tensor, shape ``[L, D]``, any float dtype
        The K RMSNorm weight of each layer. ``D`` (head dim) is read from here.
    eps : float, or Tensor of shape ``[L]``
        RMSNorm epsilon, one for all layers or one per layer.
    cos_sin_cache : Tensor, shape ``[P, R]``, any float dtype
        Row ``p`` holds ``cos`` in columns ``[0, R/2)`` and ``sin`` in
        ``[R/2, R)`` for position ``p``. ``R`` (rotary dim) is even, ``2 <= R <= D``;
        dims ``[R, D)`` pass through unrotated.
    positions : Tensor, shape ``[T]``, int32 | int64
        Each token's position, on kv's device. A position outside ``[0, P)``
        gives NaN in that token's K (debug mode raises instead).
    num_kv_heads : int
        ``H``, the number of KV heads (on this rank).
    rope_style : {"neox", "gptj"}
        ``"neox"`` rotates the two halves, ``"gptj"`` interleaved pairs.
    k_out, v_out : Tensor, shape ``[L, T, H, D]``, kv's dtype and device, optional
        Where to write; may be ``[:, :T]`` views of a larger slab (last dim
        contiguous). Allocated when ``None``.

    Returns
    -------
    k, v : Tensor, shape ``[L, T, H, D]``, kv's dtype
        ``k_out`` and ``v_out`` themselves when given.

    Raises
    ------
    InputError
        For any shape, dtype, device or layout misuse, before anything is written.
    """
    if torch.compiler.is_compiling():
        return _library.materialize_kv(
            kv, k_norm_weight, eps, cos_sin_cache, positions,
            num_kv_heads=num_kv_heads, rope_style=rope_style, k_out=k_out, v_out=v_out,
        )  # fmt: skip
    args = (kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, rope_style, k_out, v_out)
    plan: _Plan = _DENSE.plan(args, _planner())
    if k_out is not None and v_out is not None and _same_memory(k_out, v_out):
        raise InputError("v_out: expected a tensor apart from k_out, got one sharing its memory")
    if debug_enabled():
        _debug(_DENSE, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
    dims = plan.bound.dims
    if k_out is None:
        k_out = torch.empty((dims["L"], dims["T"], num_kv_heads, dims["D"]), dtype=kv.dtype, device=kv.device)
    if v_out is None:
        v_out = torch.empty((dims["L"], dims["T"], num_kv_heads, dims["D"]), dtype=kv.dtype, device=kv.device)
    if plan.empty:
        return k_out, v_out
    if not plan.kernel:
        k, v = _reference.rmsnorm_rope(
            kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, rope_style == "neox"
        )
        k_out.copy_(k)
        v_out.copy_(v)
        return k_out, v_out
    if plan.launch is None:
        plan.launch = _launch.Launch(
            kv, k_norm_weight, eps, cos_sin_cache, positions, None,
            k_out, (k_out.stride(0), k_out.stride(1), k_out.stride(2)),
            v_out, (v_out.stride(0), v_out.stride(1), v_out.stride(2)),
            None, num_kv_heads=num_kv_heads, num_rows=dims["T"], neox=rope_style == "neox", k_scale=None, v_scale=None,
        )  # fmt: skip
    plan.launch(_launch.varying(kv, k_norm_weight, eps, cos_sin_cache, positions, None, k_out, v_out, None, None, None))
    return k_out, v_out


_DENSE = Signature(
    materialize_kv,
    scalar_dims={"H": "num_kv_heads"},
    device_of="kv",
    same_dtype={"k_out": "kv", "v_out": "kv"},
    outputs=("k_out", "v_out"),
    rules=(_ROTARY_RULE,),
    inner_contiguous=("kv", "k_out", "v_out"),
)


@static_jaxtyping("T L KV H D P R S")
def materialize_kv_into_pool(
    kv: Annotated[StorageFloat[Tensor, "T L KV"], KV_WIDTH],
    k_norm_weight: ParamFloat[Tensor, "L D"],
    eps: float | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"],
    positions: Index[Tensor, " T"],
    cache_loc: Index[Tensor, " T"],
    k_pool: PoolFloat[Tensor, "L S H D"] | Sequence[PoolFloat[Tensor, "S H D"]],
    v_pool: PoolFloat[Tensor, "L S H D"] | Sequence[PoolFloat[Tensor, "S H D"]],
    *,
    num_kv_heads: int,
    rope_style: RopeStyle = "neox",
    k_scale: float | ParamFloat[Tensor, " L"] | None = None,
    v_scale: float | ParamFloat[Tensor, " L"] | None = None,
) -> None:
    """Materialize K and V of every layer straight into a paged KV pool.

    Computes what :func:`materialize_kv` computes and writes token ``t``'s K/V
    of layer ``l`` to row ``cache_loc[t]`` of that layer's pool. Rows not named
    by ``cache_loc`` are never touched. One launch for all layers.

    Parameters
    ----------
    kv, k_norm_weight, eps, cos_sin_cache, positions
        As in :func:`materialize_kv`.
    cache_loc : Tensor, shape ``[T]``, int32 | int64
        The pool slot of each token. A negative slot skips the token (padding).
        In production a slot ``>= S`` is skipped too; debug mode raises for it
        and for a slot used twice.
    k_pool : Tensor ``[L, S, H, D]``, or a sequence of L tensors ``[S, H, D]``
        The K pool: kv's dtype, or ``float8_e4m3fn`` / ``float8_e5m2``. Per-layer
        tensors may be views with padded rows; they must share one dtype and
        one set of strides. Written in place.
    v_pool
        The V pool, same layout kind (stacked or sequence) and dtype as k_pool.
    num_kv_heads : int
        ``H``.
    rope_style : {"neox", "gptj"}
        As in :func:`materialize_kv`.
    k_scale, v_scale : float, or Tensor of shape ``[L]``, optional
        FP8 pools only: the stored value is ``x / scale`` (computed as
        ``x * (1 / scale)`` in float32) saturated to the format's finite range.
        A missing scale means 1.0 (values are still saturated). A tensor scale
        is read in the kernel: no host sync.

    Raises
    ------
    InputError
        For any shape, dtype, device or layout misuse, before anything is written.
    """
    if torch.compiler.is_compiling():
        return _library.materialize_kv_into_pool(
            kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
            num_kv_heads=num_kv_heads, rope_style=rope_style, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    args = (
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, k_scale, v_scale,
    )  # fmt: skip
    plan: _Plan = _POOL.plan(args, _planner(lambda: _pool_layout(kv, k_pool, v_pool, k_scale, v_scale)))
    _check_apart(k_pool, v_pool)
    if debug_enabled():
        _debug(_POOL, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
        _check_slots(cache_loc, plan.bound.dims["S"])
    if plan.empty:
        return
    neox = rope_style == "neox"
    if not plan.kernel:
        k, v = _reference.rmsnorm_rope(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, neox)
        k_layers, v_layers = _layers(k_pool), _layers(v_pool)
        _reference.write_pool(_reference.quantize(k, k_scale, k_layers[0].dtype), cache_loc, k_layers)
        _reference.write_pool(_reference.quantize(v, v_scale, v_layers[0].dtype), cache_loc, v_layers)
        return
    k_dst: Tensor
    v_dst: Tensor
    if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor):
        k_dst, v_dst, table = k_pool, v_pool, None
    else:
        # Per-layer tensors (a mixed stacked/list pair was rejected by the plan):
        # layer 0's address plus an offset table for the others.
        k_list, v_list = cast(Sequence[Tensor], k_pool), cast(Sequence[Tensor], v_pool)
        k_dst, v_dst, table = k_list[0], v_list[0], _layer_table(k_list, v_list)
    if plan.launch is None:
        k_strides = (k_dst.stride(0), k_dst.stride(1), k_dst.stride(2)) if table is None else (0, *k_dst.stride()[:2])
        v_strides = (v_dst.stride(0), v_dst.stride(1), v_dst.stride(2)) if table is None else (0, *v_dst.stride()[:2])
        plan.launch = _launch.Launch(
            kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_dst, k_strides, v_dst, v_strides, table,
            num_kv_heads=num_kv_heads, num_rows=plan.bound.dims["S"], neox=neox, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    plan.launch(
        _launch.varying(
            kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_dst, v_dst, table, k_scale, v_scale
        )
    )


_POOL = Signature(
    materialize_kv_into_pool,
    scalar_dims={"H": "num_kv_heads"},
    device_of="kv",
    sequence_len={"k_pool": "L", "v_pool": "L"},
    outputs=("k_pool", "v_pool"),
    rules=(_ROTARY_RULE,),
    inner_contiguous=("kv", "k_pool", "v_pool"),
)

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _pool_layout(
    kv: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
) -> None:
    """The relations between pools, kv and scales that shapes cannot say."""
    stacked = isinstance(k_pool, Tensor)
    if stacked != isinstance(v_pool, Tensor):
        kind = "a stacked [L, S, H, D] tensor" if stacked else "a sequence of per-layer tensors"
        raise InputError(f"v_pool: expected the same layout as k_pool ({kind}), got {type(v_pool).__qualname__}")
    # A stacked pool is one tensor; a list is checked layer by layer.
    k_layers = [k_pool] if isinstance(k_pool, Tensor) else k_pool
    v_layers = [v_pool] if isinstance(v_pool, Tensor) else v_pool
    if not k_layers:
        return  # L == 0: nothing to write
    dtype = k_layers[0].dtype
    for name, layers in (("k_pool", k_layers), ("v_pool", v_layers)):
        for i, layer in enumerate(layers):
            label = name if stacked else f"{name}[{i}]"
            if layer.dtype != dtype:
                first = "k_pool" if stacked else "k_pool[0]"
                raise InputError(
                    f"{label}: expected dtype {_dt(dtype)} ({first}'s), got {_dt(layer.dtype)}: "
                    "every K and V pool tensor shares one dtype"
                )
            if not stacked and layer.stride() != layers[0].stride():
                raise InputError(
                    f"{label}: expected strides {tuple(layers[0].stride())} ({name}[0]'s), got "
                    f"{tuple(layer.stride())}: per-layer pools must share one layout"
                )
    if dtype != kv.dtype and dtype not in _FP8:
        raise InputError(
            f"k_pool: expected dtype {_dt(kv.dtype)} (kv's), float8_e4m3fn or float8_e5m2, got {_dt(dtype)}: "
            "allocate the pool with dtype=kv.dtype or an FP8 dtype"
        )
    if dtype not in _FP8:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise InputError(
                    f"{name}: expected None for a {_dt(dtype)} pool (scales are for FP8 pools), got {_describe(scale)}"
                )


def _layers(pool: Tensor | Sequence[Tensor]) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(value: object) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)


def _check_apart(k_pool: Tensor | Sequence[Tensor], v_pool: Tensor | Sequence[Tensor]) -> None:
    """Every layer's K and V pool its own memory: no tensor passed twice (addresses change per call)."""
    if isinstance(k_pool, Tensor) or isinstance(v_pool, Tensor):
        if isinstance(k_pool, Tensor) and isinstance(v_pool, Tensor) and _same_memory(k_pool, v_pool):
            raise InputError("v_pool: expected memory apart from k_pool, got the same tensor")
        return
    seen: dict[int, str] = {}
    for name, layers in (("k_pool", k_pool), ("v_pool", v_pool)):
        for i, t in enumerate(layers):
            if not t.numel():
                continue
            if t.data_ptr() in seen:
                raise InputError(
                    f"{name}[{i}]: expected memory of its own, got the same memory as {seen[t.data_ptr()]}"
                )
            seen[t.data_ptr()] = f"{name}[{i}]"


def _same_memory(a: Tensor, b: Tensor) -> bool:
    # The same first element: one buffer passed twice. K and V as two halves of
    # one allocation (an engine's usual pool) start apart and pass.
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()


# Per-layer pool lists -> [2, L] int64 element offsets from layer 0, on the device.
# Built once per set of pool addresses (a pinned host copy, no sync) and reused;
# the last _TABLES_MAX sets are kept. A table a CUDA graph was captured with is
# read on every replay, so it moves to _PINNED and is never freed: otherwise its
# memory could go to another tensor (or another table) and the graph would write
# through whatever offsets that holds. _PINNED grows by one [2, L] table (and its
# pinned host copy) per set of pools ever captured. Threads share both under _LOCK.
_TABLES: OrderedDict[tuple[object, ...], tuple[Tensor, Tensor]] = OrderedDict()
_TABLES_MAX = 16
_PINNED: dict[tuple[object, ...], tuple[Tensor, Tensor]] = {}
_LOCK = threading.Lock()


def _layer_table(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor]) -> Tensor:
    # Offsets are in elements: the same addresses in another dtype need another table.
    device = k_layers[0].device
    key = (k_layers[0].element_size(), device, *(t.data_ptr() for t in (*k_layers, *v_layers)))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    with _LOCK:
        entry = _PINNED.get(key) or _TABLES.get(key)
        if entry is None:
            size = k_layers[0].element_size()
            rows = [[(t.data_ptr() - layers[0].data_ptr()) // size for t in layers] for layers in (k_layers, v_layers)]
            host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
            # The pinned source lives as long as the table: a copy made during
            # capture is a graph node that reads it again on every replay.
            entry = (host.to(device, non_blocking=True), host)
        if capturing:
            _TABLES.pop(key, None)
            _PINNED[key] = entry
        elif key not in _PINNED:
            _TABLES[key] = entry
            _TABLES.move_to_end(key)
            if len(_TABLES) > _TABLES_MAX:
                _TABLES.popitem(last=False)
        return entry[0]


def _check_positions(positions: Tensor, num_positions: int) -> None:
    """Debug mode: every position in [0, P). One device sync."""
    if positions.numel() == 0:
        return
    # Both extremes land in one buffer: one reduction, one copy to the host.
    extremes = torch.empty(2, dtype=positions.dtype, device=positions.device)
    torch.aminmax(positions, out=(extremes[0], extremes[1]))
    lo, hi = extremes.tolist()
    if lo < 0 or hi >= num_positions:
        t = int(((positions < 0) | (positions >= num_positions)).nonzero()[0, 0])
        got = int(positions[t])
        fix = "positions are never negative" if got < 0 else "extend cos_sin_cache to cover every position"
        raise InputError(f"positions: expected values in [0, P={num_positions}), got {got} at token {t}: {fix}")


def _check_slots(cache_loc: Tensor, num_slots: int) -> None:
    """Debug mode: every slot below S, no slot used twice. One device sync."""
    if cache_loc.numel() == 0:
        return
    ordered = torch.sort(cache_loc).values
    repeated = ((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any()
    hi, dup = torch.stack((ordered[-1].long(), repeated.long())).tolist()
    if hi >= num_slots:
        t = int((cache_loc >= num_slots).nonzero()[0, 0])
        raise InputError(
            f"cache_loc: expected slots below S={num_slots} (or negative to skip), got {int(cache_loc[t])} at token {t}"
        )
    if dup:
        slot = int(ordered[1:][(ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)][0])
        tokens = (cache_loc == slot).nonzero().flatten().tolist()
        raise InputError(
            f"cache_loc: expected distinct slots, got slot {slot} for tokens {tokens}: "
            "two tokens written to one slot race"
        )
