"""Value checks: Python numbers on every call (no sync); in debug mode, what needs the tensors' values,
and so a device sync."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from typedkv.core.checking import check_float
from typedkv.core.errors import InputError

DEBUG_IN_CAPTURE = (
    "typedkv debug mode is on during a CUDA graph capture: its value checks copy values to the host, which a "
    "capture forbids. Check the call in debug mode before capture (a warm-up call), then capture with "
    "typedkv.set_debug(False): replays run no Python, so no check runs in them anyway"
)


def check_not_capturing(tensor: Tensor) -> None:
    """Debug mode, before its first sync: a ``RuntimeError`` in typedkv's words where ``tensor``'s stream is
    being captured (torch's own, raised at the copy to the host, names neither debug mode nor the fix)."""
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(DEBUG_IN_CAPTURE)


def check_positions(positions: Tensor, num_positions: int) -> None:
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


def check_slots(cache_loc: Tensor, num_slots: int) -> None:
    """Debug mode: every slot below S (N*B for a paged pool), no slot used twice. One device sync."""
    if cache_loc.numel() == 0 or cache_loc.is_meta:  # meta: a dry run of shapes, no values
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


F32_TINY, F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
F32_NORMAL = f"float32's normal range ({F32_TINY!r} to {F32_MAX!r})"
"""eps and FP8 scales are computed with in float32 (kernels and reference alike): a number above float32's max
is infinite there; a scale below its smallest normal has an infinite reciprocal (and a GPU may flush it to 0)."""


def check_eps(eps: object, norm_weight: object) -> None:
    """Every call: an eps given as Python numbers from 0 to float32's max (a tensor's values: `check_layer_values`).

    A NaN, infinite or larger eps makes every K NaN or zero; a negative one, NaN where a row's mean square is
    smaller; one that rounds to 0 in float32 acts as 0 (allowed: a row of zeros gives NaN, as with eps=0).
    Without a norm weight (a RoPE-only draft) nothing reads eps: its range is not checked, but an int no
    float holds is refused all the same (`check_float`: every path converts eps).
    """
    if type(eps) is float:  # the usual call: one comparison
        if norm_weight is not None and not 0.0 <= eps <= F32_MAX:  # False for NaN too
            _out_of_range("eps", eps, zero_ok=True)
        return
    if isinstance(eps, (list, tuple)):
        items = [(f"eps[{i}]", value) for i, value in enumerate(eps)]
    elif isinstance(eps, (int, float)) and not isinstance(eps, bool):  # an int, or a float subclass (numpy.float64)
        items = [("eps", eps)]
    else:
        return  # a tensor (debug mode's), or not a number at all (the signature's to refuse)
    for name, value in items:
        check_float(name, value)
        if norm_weight is not None and not 0.0 <= value <= F32_MAX:
            _out_of_range(name, value, zero_ok=True)


def check_scale_numbers(scales: Mapping[str, float | Tensor | None]) -> None:
    """Every call: FP8 scales given as Python numbers in float32's normal range (the pool stores
    ``x * (1 / scale)``, computed in float32)."""
    for name, scale in scales.items():
        if scale is not None and not isinstance(scale, Tensor):
            check_float(name, scale)
            if not F32_TINY <= scale <= F32_MAX:  # False for NaN too
                _out_of_range(name, scale, zero_ok=False)


def check_layer_values(name: str, values: Tensor, *, zero_ok: bool) -> None:
    """Debug mode: a per-layer eps (``zero_ok``) or scale tensor's values in range, as `check_eps` and
    `check_scale_numbers` take numbers, once in float32 (as the kernels read them). One device sync."""
    if values.numel() == 0:
        return
    read = values.float()
    bad = ~torch.isfinite(read) | ((read < 0) if zero_ok else (read < F32_TINY))
    if bad.any():
        layer = int(bad.nonzero()[0, 0])
        _out_of_range(name, float(values[layer]), zero_ok=zero_ok, layer=layer)


def _out_of_range(name: str, value: object, *, zero_ok: bool, layer: int | None = None) -> None:
    what = "a number" if layer is None else "values"
    where = f"from 0 to float32's max ({F32_MAX!r})" if zero_ok else f"in {F32_NORMAL}"
    at = "" if layer is None else f" at layer {layer}"
    why = (
        "RMSNorm divides by sqrt(mean square + eps), in float32: a model's eps is small and positive (1e-6, 1e-5)"
        if zero_ok
        else "the pool stores x * (1 / scale), in float32: a scale is positive, and neither it nor its reciprocal "
        "overflows"
    )
    raise InputError(f"{name}: expected {what} {where}, got {value!r}{at}: {why}")
