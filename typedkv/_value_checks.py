"""Debug mode's value checks: what needs the tensors' values, and so a device sync."""

from __future__ import annotations

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
