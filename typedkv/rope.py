"""Building the ``[P, R]`` cos/sin cache the ops read: from RoPE's parameters, or from Hugging Face tables.

The cache holds, for each position ``p``, ``cos(p * f_j)`` in columns ``[0, R/2)``
and ``sin(p * f_j)`` in ``[R/2, R)``, one column per rotary frequency ``f_j`` --
the layout vLLM's and sglang's rotary modules keep as ``cos_sin_cache``. Hugging
Face rotary embeddings give two tables instead, ``cos`` and ``sin``, each
``[P, R]`` with its halves duplicated (``cat(freqs, freqs)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from typedkv.core.checking import check_float
from typedkv.core.errors import InputError
from typedkv.core.messages import fmt_dtype, or_list, type_name
from typedkv.core.signature import Signature
from typedkv.core.tensor_types import static_jaxtyping
from typedkv.core.value_checks import F32_MAX, F32_NORMAL, F32_TINY

if TYPE_CHECKING:
    from jaxtyping import Float as ParamFloat
else:
    from typedkv.core.tensor_types import ParamFloat


_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the ops take (ParamFloat)


def cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The cos/sin cache of standard RoPE, ``[max_position, rotary_dim]``.

    Row ``p`` is ``cos(p * f_j)`` then ``sin(p * f_j)`` for the frequencies
    ``f_j = base ** (-2j / rotary_dim)``, ``j < rotary_dim / 2``, computed in
    float32 as vLLM's and sglang's rotary modules compute them, then converted
    to ``dtype``.

    Parameters
    ----------
    max_position : int
        ``P``, the number of positions (the model's ``max_position_embeddings``).
    rotary_dim : int
        ``R``, the number of rotated dims of a head: even, at most the head dim.
    base : float
        RoPE's base (``rope_theta``), in float32's normal range.
    dtype : torch.dtype
        The cache's dtype: float32 (exact to float32), bfloat16, float16 or float64.
    device : torch.device or str, optional
        Where to build it.

    Returns
    -------
    Tensor, shape ``[max_position, rotary_dim]``

    Raises
    ------
    InputError
        For a count that is not a positive int below ``2**63`` (``rotary_dim`` also even), a base outside
        float32's normal range (the table is computed in float32), a dtype the ops do not take, or a
        device torch cannot allocate on here (a misspelt one, a GPU this machine or this build of torch
        does not have; torch's own error is the cause).

    Examples
    --------
    >>> cache = typedkv.cos_sin_cache(max_position=128, rotary_dim=64)
    >>> cache.shape, cache.dtype
    (torch.Size([128, 64]), torch.float32)
    >>> torch.equal(cache[0], torch.cat((torch.ones(32), torch.zeros(32))))  # position 0: cos 1, sin 0
    True
    """
    for name, value in (("max_position", max_position), ("rotary_dim", rotary_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name}: expected a positive int, got {value!r} ({type_name(value)})")
        if value >= 2**63:  # past int64: no tensor has such a size (torch raises OverflowError or RuntimeError)
            raise InputError(
                f"{name}: expected a positive int below 2**63 (a size), got an int of {len(str(value))} digits"
            )
    if rotary_dim % 2:
        raise InputError(f"rotary_dim: expected an even number (dims rotate in pairs), got {rotary_dim}")
    check_float("base", base)
    # The frequencies are computed in float32: a base past its max is infinite there, one below its smallest
    # normal 0 (or flushed to it), and either gives a table of no rotation or of NaN.
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not F32_TINY <= base <= F32_MAX:
        raise InputError(
            f"base: expected a number in {F32_NORMAL}, got {base!r}: RoPE's base (rope_theta, such as 10000.0), "
            "as the table is computed in float32"
        )
    if dtype not in _CACHE_DTYPES:
        # An integer cache would hold cos and sin truncated to -1, 0 and 1, which the ops refuse anyway.
        raise InputError(f"dtype: expected {or_list([fmt_dtype(d) for d in _CACHE_DTYPES])}, got {dtype!r}")
    device = _device(device)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def _device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a `torch.device` torch can allocate on here (None as it is)."""
    if device is None:
        return None
    try:
        where = torch.device(device)
        torch.empty(0, device=where)
    except (RuntimeError, TypeError, AssertionError, NotImplementedError) as err:
        # torch's own words (a misspelt type, a build without CUDA, no such GPU) stay on as the cause.
        raise InputError(
            f"device: expected None or a device torch can allocate on here ('cpu', 'cuda:0' where "
            f"torch.cuda.is_available(), a torch.device), got {device!r}: torch's reason is this error's cause"
        ) from err
    return where


@static_jaxtyping("P R")
def cos_sin_cache_from_hf(cos: ParamFloat[Tensor, "P R"], sin: ParamFloat[Tensor, "P R"]) -> Tensor:
    """The cos/sin cache from a Hugging Face rotary embedding's ``cos`` and ``sin`` tables.

    Hugging Face rotary modules return ``cos`` and ``sin`` of shape ``[batch,
    seq, R]`` for the positions asked, each with its two halves equal; for
    positions ``0 .. P-1`` take batch 0::

        cos, sin = rotary_emb(x, torch.arange(P, device=x.device)[None])
        cache = typedkv.cos_sin_cache_from_hf(cos[0], sin[0])

    Parameters
    ----------
    cos, sin : Tensor, shape ``[P, R]``, any float dtype, one device
        The tables, halves duplicated.

    Returns
    -------
    Tensor, shape ``[P, R]``, cos's dtype and device
        The first halves side by side: ``cat(cos[:, :R/2], sin[:, :R/2])``.

    Raises
    ------
    InputError
        For tables of other shapes, dtypes or devices, an odd ``R`` or none
        (``R`` is even and at least 2, as the ops take it), meta tensors (no
        values to compare), or halves that differ (not a Hugging Face table).
        Comparing the halves reads the values: on a GPU it waits for the device
        once, so build the cache at setup, not in a decode loop.

    Examples
    --------
    >>> angles = torch.outer(torch.arange(16.0), 0.5 ** torch.arange(8.0))  # [P, R/2]
    >>> emb = torch.cat((angles, angles), dim=-1)  # Hugging Face's layout: [P, R], halves duplicated
    >>> cos, sin = emb.cos(), emb.sin()
    >>> cache = typedkv.cos_sin_cache_from_hf(cos, sin)
    >>> cache.shape, torch.equal(cache, torch.cat((cos[:, :8], sin[:, :8]), dim=-1))
    (torch.Size([16, 16]), True)
    """
    _FROM_HF.check((cos, sin))
    if cos.is_meta:  # sin too: it is on cos's device
        raise InputError(
            "cos: expected a tensor with values (its halves are compared), got a meta tensor: "
            "build the tables on the device the model runs on"
        )
    half = cos.shape[1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if not torch.equal(table[:, :half], table[:, half:]):
            raise InputError(
                f"{name}: expected a Hugging Face table (its two halves equal), got halves that differ: "
                "a cache already in the [cos | sin] layout is passed to the ops as it is"
            )
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1)


_FROM_HF = Signature(
    cos_sin_cache_from_hf,
    scalar_dims={},
    device_of="cos",
    same_dtype={"sin": "cos"},
    # As the ops take R (`typedkv.kv.impl.ROTARY_RULE`): a table with no rotary dims is none of theirs.
    rules=(("R % 2 == 0 and 2 <= R", "cos", "expected an even rotary dim R, at least 2 (its halves are equal)"),),
)
