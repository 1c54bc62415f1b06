"""The checked implementation of the ops: check the arguments, then launch or run the reference.

The public functions (`typedkv._ops`) declare the shapes and hand eager calls
here; the torch ops (`typedkv._library`) call here too: their fake
implementations run the production check, their real ones the whole op. Imports
point one way -- public face, torch ops, this module, checking, launch, kernel --
so the public face registers each function's `Signature` here (`declare`)
instead of this module importing it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from . import _launch, _reference
from ._checking import Bound, Signature
from ._config import debug_enabled
from ._errors import InputError
from ._messages import fmt_dtype

ROTARY_RULE = (
    "R % 2 == 0 and 2 <= R <= D",
    "cos_sin_cache",
    "the rotary dim R must be even and 2 <= R <= D",
    # Hugging Face keeps cos and sin as two [P, D] tables with duplicated halves: side by side they are 2*D wide.
    (
        "R == 2 * D",
        "Hugging Face cos and sin tables side by side? build the cache with typedkv.cos_sin_cache_from_hf(cos, sin)",
    ),
)
"""``Signature`` rule shared by every function that takes a cos/sin cache."""

DENSE = "materialize_kv"
POOL = "materialize_kv_into_pool"
_SIGNATURES: dict[str, Signature] = {}


def declare(fn: Callable[..., Any], **relations: Any) -> Signature:
    """Read ``fn``'s annotations into the `Signature` its calls are checked with (``relations`` as there)."""
    signature = Signature(fn, **relations)
    _SIGNATURES[fn.__name__] = signature
    return signature


def signature(name: str) -> Signature:
    return _SIGNATURES[name]


@dataclass
class _Plan:
    """What one checked layout needs at every call."""

    bound: Bound
    empty: bool  # T == 0 or L == 0: nothing to compute
    kernel: bool  # the Triton kernel (else the PyTorch reference)
    launch: _launch.Launch | None = None  # built at the first launch, when the outputs exist
    typechecked: bool = False  # debug mode's beartype + jaxtyping pass done for this layout
    geometry: _Geometry | None = None  # a pool op's page geometry, worked out at its first non-empty call


def _planner(check_relations: Callable[[Bound], None] | None = None) -> Callable[[Bound], _Plan]:
    def build(bound: Bound) -> _Plan:
        if check_relations is not None:
            check_relations(bound)
        dims = bound.dims
        return _Plan(bound, dims["T"] == 0 or dims["L"] == 0, _launch.use_kernel(bound.device))

    return build


def _debug(sig: Signature, plan: _Plan, args: tuple[object, ...]) -> None:
    # The annotations' verdict depends on the layout only: one full beartype +
    # jaxtyping pass per layout; the value checks run on every call.
    if not plan.typechecked:
        sig.debug_check(args, plan.bound)
        plan.typechecked = True


# --------------------------------------------------------------------- dense


def check_dense(args: tuple[Any, ...]) -> Bound:
    """The production check of `typedkv.materialize_kv`'s arguments (in signature order)."""
    return signature(DENSE).check(args)


def materialize_kv(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps: float | Sequence[float] | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    rope_style: str,
    k_out: Tensor | None,
    v_out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """`typedkv.materialize_kv`, eagerly: checked, then launched (or run by the reference)."""
    args = (kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, rope_style, k_out, v_out)
    sig = signature(DENSE)
    plan: _Plan = sig.plan(args, _planner())
    if k_out is not None and v_out is not None and _same_memory(k_out, v_out):
        raise InputError("v_out: expected a tensor apart from k_out, got one sharing its memory")
    if debug_enabled():
        _debug(sig, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
    dims = plan.bound.dims
    eps = layer_eps(eps, kv.device)
    if k_out is None:
        k_out = torch.empty((dims["L"], dims["T"], num_kv_heads, dims["D"]), dtype=kv.dtype, device=kv.device)
    if v_out is None:
        v_out = torch.empty((dims["L"], dims["T"], num_kv_heads, dims["D"]), dtype=kv.dtype, device=kv.device)
    if plan.empty:
        return k_out, v_out
    neox = rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written.
        with torch.no_grad():
            k, v = _reference.rmsnorm_rope(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, neox)
            k_out.copy_(k)
            v_out.copy_(v)
        return k_out, v_out
    if plan.launch is None:
        # Dense outputs are pools of T rows, one token per row, no pages.
        plan.launch = _launch.Launch(
            kv, k_norm_weight, eps, cos_sin_cache, positions, None,
            k_out, (k_out.stride(0), k_out.stride(1), 0, k_out.stride(2)),
            v_out, (v_out.stride(0), v_out.stride(1), 0, v_out.stride(2)),
            None, num_kv_heads=num_kv_heads, head_dim=dims["D"], page_size=1, num_rows=dims["T"], neox=neox,
            k_scale=None, v_scale=None,
        )  # fmt: skip
    plan.launch(_launch.varying(kv, k_norm_weight, eps, cos_sin_cache, positions, None, k_out, v_out, None, None, None))
    return k_out, v_out


# ---------------------------------------------------------------------- pool


def check_pool(args: tuple[Any, ...]) -> Bound:
    """The production check of `typedkv.materialize_kv_into_pool`'s arguments (in signature order)."""
    sig = signature(POOL)
    bound = sig.check(args)
    named = dict(zip(sig.parameters, args, strict=True))
    _pool_layout(named["kv"], named["k_pool"], named["v_pool"], named["k_scale"], named["v_scale"], bound)
    return bound


def materialize_kv_into_pool(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps: float | Sequence[float] | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    cache_loc: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    num_kv_heads: int,
    rope_style: str,
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
    kv_layout: str | None,
) -> None:
    """`typedkv.materialize_kv_into_pool`, eagerly: checked, then launched (or run by the reference)."""
    args = (
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, k_scale, v_scale, kv_layout,
    )  # fmt: skip
    sig = signature(POOL)
    plan: _Plan = sig.plan(args, _planner(lambda bound: _pool_layout(kv, k_pool, v_pool, k_scale, v_scale, bound)))
    _check_apart(k_pool, v_pool)
    if debug_enabled():
        _debug(sig, plan, args)
        _check_positions(positions, cos_sin_cache.shape[0])
    if plan.empty:
        return
    dims = plan.bound.dims
    eps = layer_eps(eps, kv.device)
    geometry = plan.geometry
    if geometry is None:
        geometry = plan.geometry = _Geometry.of(plan.bound)
    if debug_enabled():
        _check_slots(cache_loc, geometry.num_slots)
    neox = rope_style == "neox"
    if not plan.kernel:
        # Inference only, as on the GPU: no autograd history on what is written.
        with torch.no_grad():
            k, v = _reference.rmsnorm_rope(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, neox)
            k_layers, v_layers = _layers(k_pool), _layers(v_pool)
            page, hnd = geometry.page_size, kv_layout == "HND"
            _reference.write_pool(_reference.quantize(k, k_scale, k_layers[0].dtype), cache_loc, k_layers, page, hnd)
            _reference.write_pool(_reference.quantize(v, v_scale, v_layers[0].dtype), cache_loc, v_layers, page, hnd)
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
        plan.launch = _launch.Launch(
            kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc,
            k_dst, geometry.strides(plan.bound, "k_pool", k_dst),
            v_dst, geometry.strides(plan.bound, "v_pool", v_dst),
            table, num_kv_heads=num_kv_heads, head_dim=dims["D"], page_size=geometry.page_size,
            num_rows=geometry.num_slots, neox=neox, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    plan.launch(
        _launch.varying(
            kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_dst, v_dst, table, k_scale, v_scale
        )
    )


@dataclass(frozen=True)
class _Geometry:
    """Where slot ``s`` of a pool is: page ``s // page_size``, offset ``s % page_size`` within it."""

    page_size: int  # B; 1 for a pool without page dims (a page per slot)
    num_slots: int  # S, or N * B

    @staticmethod
    def of(bound: Bound) -> _Geometry:
        dims = bound.dims
        if "B" in dims:
            return _Geometry(dims["B"], dims["N"] * dims["B"])
        return _Geometry(1, dims["S"])

    def strides(self, bound: Bound, name: str, tensor: Tensor) -> tuple[int, int, int, int]:
        """``(layer, page, slot within page, head)`` element strides; layer 0 for per-layer tensors (a table)."""
        by_dim = bound.strides(name, tensor)
        page = by_dim["N"] if "N" in by_dim else by_dim["S"]
        return by_dim.get("L", 0), page, by_dim.get("B", 0), by_dim["H"]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _pool_layout(
    kv: Tensor,
    k_pool: Tensor | Sequence[Tensor],
    v_pool: Tensor | Sequence[Tensor],
    k_scale: float | Tensor | None,
    v_scale: float | Tensor | None,
    bound: Bound,
) -> None:
    """The relations between pools, kv and scales that shapes cannot say."""
    check_pool_kinds(k_pool, v_pool)
    stacked = isinstance(k_pool, Tensor)
    # A stacked pool is one tensor; a list is checked layer by layer.
    k_layers = [k_pool] if isinstance(k_pool, Tensor) else k_pool
    v_layers = [v_pool] if isinstance(v_pool, Tensor) else v_pool
    if not k_layers:
        return  # L == 0: nothing to write
    k_shape, v_shape = bound.shape_of("k_pool"), bound.shape_of("v_pool")
    if k_shape != v_shape:
        raise InputError(
            f"v_pool: expected k_pool's layout [{', '.join(k_shape.split())}], got [{', '.join(v_shape.split())}]: "
            "K and V pools are paged alike"
        )
    dtype = k_layers[0].dtype
    for name, layers in (("k_pool", k_layers), ("v_pool", v_layers)):
        for i, layer in enumerate(layers):
            label = name if stacked else f"{name}[{i}]"
            if layer.dtype != dtype:
                first = "k_pool" if stacked else "k_pool[0]"
                raise InputError(
                    f"{label}: expected dtype {fmt_dtype(dtype)} ({first}'s), got {fmt_dtype(layer.dtype)}: "
                    "every K and V pool tensor shares one dtype"
                )
            if not stacked and layer.stride() != layers[0].stride():
                raise InputError(
                    f"{label}: expected strides {tuple(layers[0].stride())} ({name}[0]'s), got "
                    f"{tuple(layer.stride())}: per-layer pools must share one layout"
                )
    if dtype not in _FP8:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise InputError(
                    f"{name}: expected None for a {fmt_dtype(dtype)} pool (scales are for FP8 pools), got {_describe(scale)}"
                )


def check_pool_kinds(k_pool: object, v_pool: object) -> None:
    """K and V pools both stacked tensors or both sequences (plain Python: torch.compile traces it)."""
    stacked = isinstance(k_pool, Tensor)
    if stacked != isinstance(v_pool, Tensor):
        kind = "a stacked tensor" if stacked else "a sequence of per-layer tensors"
        raise InputError(f"v_pool: expected the same layout as k_pool ({kind}), got {type(v_pool).__qualname__}")


def _layers(pool: Tensor | Sequence[Tensor]) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


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


# eps given as a sequence of per-layer numbers -> an [L] float32 tensor on the
# device, made once per set of values and device and kept for good: a CUDA graph
# captured with it reads it on every replay (as with _PINNED). One small tensor
# per distinct set of a model's epsilons.
_EPS: dict[tuple[tuple[float, ...], torch.device], tuple[Tensor, Tensor]] = {}


def layer_eps(eps: float | Sequence[float] | Tensor, device: torch.device) -> float | Tensor:
    """``eps`` as the kernel and the reference take it: a float, or an ``[L]`` tensor on ``device``.

    A sequence (checked already: numbers, one per layer) becomes a tensor even
    when its values are equal, so that one layout always launches alike.
    """
    if isinstance(eps, (float, int, Tensor)):
        return eps
    key = (tuple(map(float, eps)), device)
    with _LOCK:
        entry = _EPS.get(key)
        if entry is None:
            host = torch.tensor(key[0], dtype=torch.float32, pin_memory=device.type == "cuda")
            # The pinned source lives as long as the copy: a copy made during capture reads it on every replay.
            entry = _EPS[key] = (host.to(device, non_blocking=True), host)
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
    """Debug mode: every slot below S (N*B for a paged pool), no slot used twice. One device sync."""
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
