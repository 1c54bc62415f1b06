"""Value checks: Python numbers on every call (no sync); in debug mode, what needs the tensors' values,
and so a device sync."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ._errors import InputError


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


def check_eps(eps: object, norm_weight: object) -> None:
    """Every call: an eps given as Python numbers finite and >= 0 (a tensor's values: `check_layer_values`).

    A NaN or infinite eps makes every K NaN or zero; a negative one, NaN where a row's mean square is smaller.
    Without a norm weight (a RoPE-only draft) nothing reads eps: it is not checked.
    """
    if norm_weight is None:
        return
    if type(eps) is float:
        if not 0.0 <= eps < math.inf:  # False for NaN too
            _out_of_range("eps", eps, zero_ok=True)
    elif isinstance(eps, (list, tuple)):
        for i, value in enumerate(eps):
            if not 0.0 <= value < math.inf:
                _out_of_range(f"eps[{i}]", value, zero_ok=True)
    elif isinstance(eps, int) and eps < 0:
        _out_of_range("eps", eps, zero_ok=True)


def check_scale_numbers(scales: Mapping[str, float | Tensor | None]) -> None:
    """Every call: FP8 scales given as Python numbers finite and > 0 (the pool stores ``x / scale``)."""
    for name, scale in scales.items():
        if scale is not None and not isinstance(scale, Tensor) and not 0.0 < scale < math.inf:
            _out_of_range(name, scale, zero_ok=False)


def check_layer_values(name: str, values: Tensor, *, zero_ok: bool) -> None:
    """Debug mode: a per-layer eps (``zero_ok``) or scale tensor finite and >= 0 (> 0). One device sync."""
    if values.numel() == 0:
        return
    bad = ~torch.isfinite(values) | ((values < 0) if zero_ok else (values <= 0))
    if bad.any():
        layer = int(bad.nonzero()[0, 0])
        _out_of_range(name, float(values[layer]), zero_ok=zero_ok, layer=layer)


def _out_of_range(name: str, value: float, *, zero_ok: bool, layer: int | None = None) -> None:
    bound = ">= 0" if zero_ok else "> 0"
    expected = f"a finite number {bound}" if layer is None else f"finite values {bound}"
    at = "" if layer is None else f" at layer {layer}"
    why = (
        "RMSNorm divides by sqrt(mean square + eps): a model's eps is small and positive (1e-6, 1e-5)"
        if zero_ok
        else "the pool stores x / scale: a scale is positive and finite"
    )
    raise InputError(f"{name}: expected {expected}, got {value!r}{at}: {why}")
