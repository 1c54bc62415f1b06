"""An independent float64 reference for ``typedkv.materialize_kv``, written from DESIGN.md.

It deliberately shares no code with typedkv's reference modules (``typedkv.kv.reference``,
``typedkv.mla.reference``): a mistake copied into both would pass every comparison. The math follows the contract's "unfused model
path" literally:

1. K RMSNorm in float64: ``x / sqrt(mean(x**2) + eps[l]) * k_norm_weight[l]``
   (skipped for a RoPE-only draft, ``k_norm_weight=None``);
2. the normed K rounded to the storage dtype (what an unfused model stores between
   the norm and RoPE);
3. RoPE in float64 on the first ``R`` dims, with ``cos``/``sin`` read from row
   ``positions[t]`` of the cache (of layer ``l``'s table, for a cache of a table
   per layer); dims ``>= R`` pass through;
4. V copied unchanged, or, with a V norm weight, RMSNorm'ed as K in step 1.

K (and a normed V) is returned in float64 *without* the final rounding to the
storage dtype, so a test can measure the op's error against the exact value of the
unfused path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["BOUNDARY", "materialize_kv64", "materialize_mla_kv64", "rotation_pairs"]

# How close (relative) to a rounding boundary of the storage dtype the exact normed K must be
# for a float32 norm to round it either way (`materialize_kv64`'s ``other_rounding``): 2**-20,
# several times the float32 norm's own error.
BOUNDARY = 2.0**-20


def rotation_pairs(rotary_dim: int, rope_style: str) -> tuple[Tensor, Tensor]:
    """The dims RoPE rotates together, as two index vectors.

    Pair ``i`` (``0 <= i < R/2``) is rotated by angle ``i`` of the cache row:
    ``(first[i], second[i])`` becomes
    ``(a*cos_i - b*sin_i, b*cos_i + a*sin_i)`` for ``a, b`` the values at those dims.

    Parameters
    ----------
    rotary_dim : int
        ``R``, even.
    rope_style : {"neox", "gptj"}
        ``"neox"`` pairs dim ``i`` with ``i + R/2`` (halves); ``"gptj"`` pairs
        ``2i`` with ``2i + 1`` (interleaved).

    Returns
    -------
    first, second : Tensor of int64, shape ``[R/2]``
    """
    half = rotary_dim // 2
    i = torch.arange(half)
    if rope_style == "neox":
        return i, i + half
    if rope_style == "gptj":
        return 2 * i, 2 * i + 1
    raise ValueError(f"unknown rope_style {rope_style!r}")


def materialize_kv64(
    kv: Tensor,
    k_norm_weight: Tensor | None,
    eps: float | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    rope_style: str = "neox",
    *,
    round_after_norm: bool = True,
    other_rounding: bool = False,
    v_norm_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """K and V of every layer, K computed in float64.

    Parameters
    ----------
    kv : Tensor ``[T, L, 2*H*D]``
        Per layer the K block (head-major) then the V block, in the storage dtype.
    k_norm_weight : Tensor ``[L, D]``, or None
        None: no norm, K is RoPE(k); ``D`` is then kv's width / ``2*H``.
    eps : float or Tensor ``[L]``
    cos_sin_cache : Tensor ``[P, R]``, or ``[L, P, R]`` (layer ``l`` reads table ``l``)
        Columns ``[0, R/2)`` cos, ``[R/2, R)`` sin.
    positions : Tensor ``[T]``
        Positions outside ``[0, P)`` give an all-NaN K row for that token (the
        op's documented production behaviour).
    num_kv_heads : int
        ``H``.
    rope_style : {"neox", "gptj"}
    round_after_norm : bool
        Round the normed K to kv's dtype before RoPE (the contract). ``False``
        gives the single-rounding variant, used by tests to show that the op does
        the intermediate rounding.
    other_rounding : bool
        Where the exact normed value lies within ``BOUNDARY`` (relative) of a rounding
        boundary of kv's dtype, round it to the other neighbour. The op computes the
        norm in float32 (a sum in its own order, an rsqrt, products: a few 2**-24
        each), so there it may round either way; a test accepts either K
        (`tests/test_fused_projection.assert_matches_oracle`).
    v_norm_weight : Tensor ``[L, D]``, or None
        V's RMSNorm weight (with eps, as K's): V is returned normed in float64, not rounded.

    Returns
    -------
    k : Tensor ``[L, T, H, D]``, float64
        Not rounded to the storage dtype after RoPE.
    v : Tensor ``[L, T, H, D]``, kv's dtype
        The V block, a copy of kv's bits; with ``v_norm_weight``, float64: the exact normed V.
    """
    num_tokens, num_layers, width = kv.shape
    head_dim = width // (2 * num_kv_heads) if k_norm_weight is None else k_norm_weight.shape[1]
    num_positions, rotary_dim = cos_sin_cache.shape[-2:]
    heads = num_kv_heads * head_dim
    if width != 2 * heads:
        raise ValueError(f"kv width {width} != 2*H*D = {2 * heads}")

    # [T, L, H, D] -> [L, T, H, D]; float64 holds every storage value exactly.
    blocks = kv.reshape(num_tokens, num_layers, 2, num_kv_heads, head_dim).permute(2, 1, 0, 3, 4)
    x = blocks[0].to(torch.float64)
    v = blocks[1].clone()

    # 1. RMSNorm, per layer eps and weight; a RoPE-only draft takes kv's values as they are.
    eps64 = torch.as_tensor(eps, dtype=torch.float64, device=kv.device).reshape(-1, 1, 1, 1)  # one, or per layer

    def rms_norm(rows: Tensor, norm_weight: Tensor) -> Tensor:
        mean_square = (rows * rows).sum(dim=-1, keepdim=True) / head_dim
        weight = norm_weight.to(torch.float64).reshape(num_layers, 1, 1, head_dim)
        return rows / torch.sqrt(mean_square + eps64) * weight

    y = x if k_norm_weight is None else rms_norm(x, k_norm_weight)
    if v_norm_weight is not None:
        v = rms_norm(v.to(torch.float64), v_norm_weight)

    # 2. The unfused model stores the normed K in kv's dtype.
    if round_after_norm and k_norm_weight is not None:
        rounded = y.to(kv.dtype).to(torch.float64)
        if other_rounding:
            # Nudged by BOUNDARY either way, a value next to a boundary rounds to both neighbours.
            below = (y * (1 - BOUNDARY)).to(kv.dtype).to(torch.float64)
            above = (y * (1 + BOUNDARY)).to(kv.dtype).to(torch.float64)
            rounded = torch.where(below != rounded, below, above)
        y = rounded

    # 3. RoPE, pair by pair. Out-of-range positions read row 0 and are then
    #    overwritten with NaN, so the reference never indexes out of bounds.
    pos = positions.to(torch.int64)
    valid = (pos >= 0) & (pos < num_positions)
    table = cos_sin_cache.to(torch.float64)
    if table.dim() == 2:
        table = table[None]  # one table for every layer
    if num_positions == 0:  # an empty cache: every position is out of range
        table = torch.zeros(table.shape[0], 1, rotary_dim, dtype=torch.float64, device=kv.device)
    rows = table[:, torch.where(valid, pos, 0)]  # [L or 1, T, R]
    half = rotary_dim // 2
    cos = rows[:, :, None, :half]  # [L or 1, T, 1, R/2]
    sin = rows[:, :, None, half:]
    first, second = (i.to(kv.device) for i in rotation_pairs(rotary_dim, rope_style))
    a, b = y[..., first], y[..., second]
    k = y.clone()
    k[..., first] = a * cos - b * sin
    k[..., second] = b * cos + a * sin
    k[:, ~valid] = float("nan")
    return k, v


def materialize_mla_kv64(
    ckv: Tensor,
    kv_norm_weight: Tensor | None,
    eps: float | Sequence[float] | Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    rope_style: str,
) -> Tensor:
    """MLA cache rows of every layer, ``[L, T, C+R]`` in float64, from DESIGN.md's "MLA drafts".

    Each row of ``ckv`` (``[T, L, C+R]``) is the latent (``C`` dims) then the rope
    part (``R``, the cache's width). The latent is RMSNorm'ed in float64 and rounded
    to ckv's dtype (the unfused path stores ``kv_a_layernorm``'s output), or taken
    as it is when ``kv_norm_weight`` is None; every dim of the rope part is rotated
    in float64 and *not* rounded, so a test measures the op's error against the
    exact value. A position outside ``[0, P)`` gives NaN in that token's rope part. A
    cache of a table per layer (``[L, P, R]``) rotates layer ``l`` with table ``l``.
    """
    _, num_layers, width = ckv.shape
    num_positions, rotary_dim = cos_sin_cache.shape[-2:]
    latent_dim = width - rotary_dim
    rows = ckv.permute(1, 0, 2).to(torch.float64)  # [L, T, C+R], exact
    latent, rope = rows[..., :latent_dim], rows[..., latent_dim:]
    if kv_norm_weight is not None:
        if isinstance(eps, (float, int)):
            eps64 = torch.full((num_layers, 1, 1), float(eps), dtype=torch.float64)
        else:  # per layer: a tensor or a sequence of numbers
            eps64 = torch.as_tensor(eps, dtype=torch.float64).reshape(num_layers, 1, 1)
        mean_square = (latent * latent).sum(dim=-1, keepdim=True) / latent_dim
        weight = kv_norm_weight.to(torch.float64).reshape(num_layers, 1, latent_dim)
        latent = (latent / torch.sqrt(mean_square + eps64) * weight).to(ckv.dtype).to(torch.float64)
    pos = positions.to(torch.int64)
    valid = (pos >= 0) & (pos < num_positions)
    table = cos_sin_cache.to(torch.float64)
    if table.dim() == 2:
        table = table[None]  # one table for every layer
    if num_positions == 0:
        table = torch.zeros(table.shape[0], 1, rotary_dim, dtype=torch.float64)
    angles = table[:, torch.where(valid, pos, 0)]  # [L or 1, T, R]
    half = rotary_dim // 2
    cos = angles[..., :half]  # [L or 1, T, R/2]
    sin = angles[..., half:]
    first, second = rotation_pairs(rotary_dim, rope_style)
    a, b = rope[..., first], rope[..., second]
    rotated = rope.clone()
    rotated[..., first] = a * cos - b * sin
    rotated[..., second] = b * cos + a * sin
    rotated[:, ~valid] = float("nan")
    return torch.cat((latent, rotated), dim=-1)
