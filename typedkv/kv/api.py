"""The public ops: shapes declared once in the annotations; calls handed on by name.

This module is the public face. A function's body puts its arguments into one
typed call bundle (a NamedTuple whose fields are the parameters, in order: a
test holds them to the signature) and hands it on: eager calls to the checked
implementation (`typedkv._impl`: check, then launch the kernel or run the
reference), calls traced by torch.compile to the function's torch ops
(`typedkv.core.torch_ops`, whose schemas come from the same annotations). The bundle
is built by position because torch.compile (Dynamo, before torch 2.13) cannot
trace ``locals()``. Each function's `Signature` -- the annotations read once, with the
relations they cannot spell -- is declared right after it, then its torch ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import torch
from jaxtyping import Float32
from torch import Tensor

from typedkv.core import torch_ops
from typedkv.core.tensor_types import HND, KV_WIDTH, NHD, KVLayout, RopeStyle, static_jaxtyping
from typedkv.kv import impl as kv_impl

if TYPE_CHECKING:
    # pyrefly reads jaxtyping's names only where they are imported (not through a
    # re-export): the families are those names to every static checker.
    from jaxtyping import Float as KVPoolDtype
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, KVPoolDtype, ParamFloat, StorageFloat


@static_jaxtyping("T L KV H D P R")
def materialize_kv(
    kv: Annotated[StorageFloat[Tensor, "T L KV"], KV_WIDTH],
    k_norm_weight: ParamFloat[Tensor, "L D"] | None,
    eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    positions: Index[Tensor, " T"],
    *,
    num_kv_heads: int,
    rope_style: RopeStyle = "neox",
    v_norm_weight: ParamFloat[Tensor, "L D"] | None = None,
    k_out: StorageFloat[Tensor, "L T H D"] | None = None,
    v_out: StorageFloat[Tensor, "L T H D"] | None = None,
) -> tuple[StorageFloat[Tensor, "L T H D"], StorageFloat[Tensor, "L T H D"]]:
    """Materialize K and V of every layer from a stacked K/V projection.

    For every token ``t``, layer ``l`` and kv head ``h``: K is
    ``RoPE(RMSNorm(kv[t, l, K block of h]))`` and V is copied bit for bit (or
    RMSNorm'ed, with ``v_norm_weight``). One Triton launch covers all layers on CUDA.

    Parameters
    ----------
    kv : Tensor, shape ``[T, L, 2*H*D]``, bfloat16 | float16 | float32
        Per layer, the K block (``H*D`` values, head-major) then the V block.
        May be a strided view (its last dim contiguous).
    k_norm_weight : Tensor, shape ``[L, D]``, any float dtype, or None
        The K RMSNorm weight of each layer. ``D`` (head dim) is read from here.
        ``None`` for a draft without a K norm: K is RoPE(k), and ``D`` is kv's
        width divided by ``2*H`` (a width that is not a multiple is rejected).
    eps : float, a sequence of L numbers, or Tensor of shape ``[L]``
        RMSNorm epsilon, one for all layers or one per layer (a sequence is
        copied to the device once per set of values, then reused); K's and V's
        norms share it. Checked but unused when neither norm weight is given.
    cos_sin_cache : Tensor, shape ``[P, R]`` or ``[L, P, R]``, any float dtype
        Row ``p`` holds ``cos`` in columns ``[0, R/2)`` and ``sin`` in
        ``[R/2, R)`` for position ``p``. ``R`` (rotary dim) is even, ``2 <= R <= D``;
        dims ``[R, D)`` pass through unrotated. ``[L, P, R]``: a table per
        layer, layer ``l`` rotated with table ``l`` (drafts whose layers differ
        in RoPE base or scaling).
    positions : Tensor, shape ``[T]``, int32 | int64
        Each token's position, on kv's device. A position outside ``[0, P)``
        gives NaN in that token's K (debug mode raises instead).
    num_kv_heads : int
        ``H``, the number of KV heads (on this rank).
    rope_style : {"neox", "gptj"}
        ``"neox"`` rotates the two halves, ``"gptj"`` interleaved pairs.
    v_norm_weight : Tensor, shape ``[L, D]``, any float dtype, optional
        The V RMSNorm weight of each layer (a draft that norms V): V is
        ``RMSNorm(v)`` with ``eps``, in float32, rounded to kv's dtype as K's norm
        is; no RoPE. A weightless norm is a weight of ones. ``None`` (the
        default): V is copied bit for bit.
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

    Examples
    --------
    >>> T, L, H, D = 4, 2, 2, 16
    >>> kv = torch.randn(T, L, 2 * H * D, dtype=torch.bfloat16)
    >>> cos_sin_cache = typedkv.cos_sin_cache(64, D)
    >>> k, v = typedkv.materialize_kv(kv, torch.ones(L, D), 1e-6, cos_sin_cache, torch.arange(T), num_kv_heads=H)
    >>> k.shape, k.dtype
    (torch.Size([2, 4, 2, 16]), torch.bfloat16)
    >>> torch.equal(v[1, 3, 0], kv[3, 1, H * D : H * D + D])  # V of layer 1, token 3, head 0: copied as is
    True

    A draft that norms V too, and rotates each layer with its own table (two RoPE bases):

    >>> tables = torch.stack([typedkv.cos_sin_cache(64, D, base=1e4), typedkv.cos_sin_cache(64, D, base=1e6)])
    >>> k, v = typedkv.materialize_kv(kv, torch.ones(L, D), 1e-6, tables, torch.arange(T), num_kv_heads=H,
    ...                               v_norm_weight=torch.ones(L, D))
    >>> round(float(v[1, 3, 0].float().square().mean()), 1)  # V of layer 1, token 3, head 0: RMS-normed
    1.0
    """
    # In the signature's order (tests/test_compile.py checks the fields against it).
    call = kv_impl.DenseCall(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, rope_style, v_norm_weight, k_out, v_out
    )
    if torch.compiler.is_compiling():
        return DENSE_OPS(call)  # type: ignore[no-any-return]
    return kv_impl.materialize_kv(call)


kv_impl.DENSE.declare(
    materialize_kv,
    scalar_dims={"H": "num_kv_heads"},
    device_of="kv",
    sequence_len={"eps": "L"},
    same_dtype={"k_out": "kv", "v_out": "kv"},
    outputs=("k_out", "v_out"),
    rules=(kv_impl.ROTARY_RULE,),
    inner_contiguous=("kv", "k_out", "v_out"),
)
DENSE_OPS = torch_ops.TorchOps(
    kv_impl.DENSE, ("materialize_kv_out",), allocate=torch_ops.allocate_dense_outputs, returns=("k_out", "v_out")
)


# A pool's shapes: stacked over layers or a sequence of per-layer tensors; slots
# in a flat dim S, or in N pages of B slots with B before the heads (NHD) or
# after them (HND); scales written per row, the same without D. Written out in
# each signature: pyrefly does not read shapes through a type alias.
@static_jaxtyping("T L KV H D P R S N B")
def materialize_kv_into_pool(
    kv: Annotated[StorageFloat[Tensor, "T L KV"], KV_WIDTH],
    k_norm_weight: ParamFloat[Tensor, "L D"] | None,
    eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    positions: Index[Tensor, " T"],
    cache_loc: Index[Tensor, " T"],
    k_pool: Annotated[KVPoolDtype[Tensor, "L S H D"], NHD]
    | Annotated[KVPoolDtype[Tensor, "L N B H D"], NHD]
    | Annotated[KVPoolDtype[Tensor, "L N H B D"], HND]
    | Sequence[Annotated[KVPoolDtype[Tensor, "S H D"], NHD]]
    | Sequence[Annotated[KVPoolDtype[Tensor, "N B H D"], NHD]]
    | Sequence[Annotated[KVPoolDtype[Tensor, "N H B D"], HND]],
    v_pool: Annotated[KVPoolDtype[Tensor, "L S H D"], NHD]
    | Annotated[KVPoolDtype[Tensor, "L N B H D"], NHD]
    | Annotated[KVPoolDtype[Tensor, "L N H B D"], HND]
    | Sequence[Annotated[KVPoolDtype[Tensor, "S H D"], NHD]]
    | Sequence[Annotated[KVPoolDtype[Tensor, "N B H D"], NHD]]
    | Sequence[Annotated[KVPoolDtype[Tensor, "N H B D"], HND]],
    *,
    num_kv_heads: int,
    rope_style: RopeStyle = "neox",
    v_norm_weight: ParamFloat[Tensor, "L D"] | None = None,
    k_scale: float | ParamFloat[Tensor, " L"] | None = None,
    v_scale: float | ParamFloat[Tensor, " L"] | None = None,
    k_scale_out: Annotated[Float32[Tensor, "L S H"], NHD]
    | Annotated[Float32[Tensor, "L N B H"], NHD]
    | Annotated[Float32[Tensor, "L N H B"], HND]
    | Sequence[Annotated[Float32[Tensor, "S H"], NHD]]
    | Sequence[Annotated[Float32[Tensor, "N B H"], NHD]]
    | Sequence[Annotated[Float32[Tensor, "N H B"], HND]]
    | None = None,
    v_scale_out: Annotated[Float32[Tensor, "L S H"], NHD]
    | Annotated[Float32[Tensor, "L N B H"], NHD]
    | Annotated[Float32[Tensor, "L N H B"], HND]
    | Sequence[Annotated[Float32[Tensor, "S H"], NHD]]
    | Sequence[Annotated[Float32[Tensor, "N B H"], NHD]]
    | Sequence[Annotated[Float32[Tensor, "N H B"], HND]]
    | None = None,
    kv_layout: KVLayout | None = None,
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
        In production a slot ``>= S`` (``N*B`` for a paged pool) is skipped too;
        debug mode raises for it and for a slot used twice.
    k_pool : Tensor, or a sequence of L per-layer tensors
        The K pool, one of: stacked ``[L, S, H, D]``, ``[L, N, B, H, D]`` (NHD)
        or ``[L, N, H, B, D]`` (HND); per layer ``[S, H, D]``, ``[N, B, H, D]``
        or ``[N, H, B, D]``. A paged pool holds ``N`` pages of ``B`` slots:
        slot ``s`` is page ``s // B``, offset ``s % B``. kv's dtype,
        ``float8_e4m3fn`` / ``float8_e5m2``, or ``int8`` (with ``k_scale_out``
        and ``v_scale_out``). Any strides on the page, slot and head dims (the
        K half of a combined K/V cache, as a view), last dim contiguous.
        Per-layer tensors must share one dtype and one set of strides. Written
        in place.
    v_pool
        The V pool, the same layout (kind, shape, page size) and dtype as
        k_pool; it may be the other half of one combined K/V tensor.
    num_kv_heads : int
        ``H``.
    rope_style, v_norm_weight
        As in :func:`materialize_kv`.
    k_scale, v_scale : float, or Tensor of shape ``[L]``, optional
        FP8 pools only: the stored value is ``x / scale`` (computed as
        ``x * (1 / scale)`` in float32) saturated to the format's finite range
        (a normed V is rounded to kv's dtype first, as K is).
        A missing scale means 1.0 (values are still saturated). A tensor scale
        is read in the kernel: no host sync.
    k_scale_out, v_scale_out : Tensor, or a sequence of L per-layer tensors, optional
        FP8 or int8 pools: where the call writes a scale per row, one float32
        per (token, layer, head), computed from the row itself; K's and V's
        together, in place of the scales above. Shaped like the pools
        without their last dim (``[L, S, H]``, ``[L, N, B, H]``, ``[L, N, H,
        B]``, or per layer ``[S, H]`` ...), any strides: a scale kept inline
        in each pool row (vLLM's ``fp8_per_token_head`` / ``int8_per_token_head``
        caches) is a float32 view of those bytes. A row's scale is
        ``max(amax(|row|) / qmax, 1e-6)`` with ``qmax`` 448 (``float8_e4m3fn``),
        57344 (``float8_e5m2``) or 127 (``int8``), and the pool stores
        ``row * (1 / scale)`` saturated (int8: rounded to the nearest integer,
        ties to even), all in float32; ``row`` is K after norm and RoPE as
        :func:`materialize_kv` returns it (kv's dtype), or V (normed first
        with ``v_norm_weight``). A token with a negative slot writes neither
        value nor scale.
    kv_layout : "NHD", "HND" or None, default None
        Which 5-dim (4-dim per layer) shape a paged pool has: pages of
        ``[B, H, D]`` or ``[H, B, D]`` (FlashInfer's names). ``None`` (the
        default) means NHD, unless the pool's head count equals its page size
        (``H == B``): such a pool reads both ways, and ``None`` is an
        `InputError` asking for the layout. A pool without page dims is NHD.

    Raises
    ------
    InputError
        For any shape, dtype, device or layout misuse, before anything is written.

    Examples
    --------
    >>> T, L, H, D, S = 4, 2, 2, 16, 8
    >>> kv = torch.randn(T, L, 2 * H * D)
    >>> k_pool, v_pool = torch.zeros(L, S, H, D), torch.zeros(L, S, H, D)
    >>> cache_loc = torch.tensor([5, 0, -1, 2])  # token 2 is padding: written nowhere
    >>> typedkv.materialize_kv_into_pool(kv, torch.ones(L, D), 1e-6, typedkv.cos_sin_cache(64, D), torch.arange(T),
    ...                                  cache_loc, k_pool, v_pool, num_kv_heads=H)
    >>> torch.equal(v_pool[1, 5, 0], kv[0, 1, H * D : H * D + D]), bool(k_pool[:, [1, 3, 4, 6, 7]].any())
    (True, False)

    An int8 pool, with a scale per row written beside it:

    >>> k8, v8 = torch.zeros(L, S, H, D, dtype=torch.int8), torch.zeros(L, S, H, D, dtype=torch.int8)
    >>> k_s, v_s = torch.zeros(L, S, H), torch.zeros(L, S, H)
    >>> typedkv.materialize_kv_into_pool(kv, torch.ones(L, D), 1e-6, typedkv.cos_sin_cache(64, D), torch.arange(T),
    ...                                  cache_loc, k8, v8, num_kv_heads=H, k_scale_out=k_s, v_scale_out=v_s)
    >>> v = kv[0, 1, H * D : H * D + D]  # V of token 0, layer 1, head 0: slot 5
    >>> torch.equal(v_s[1, 5, 0], v.abs().max() / 127), bool(((v8[1, 5, 0] * v_s[1, 5, 0] - v).abs() <= v_s[1, 5, 0] / 2).all())
    (True, True)
    """
    # In the signature's order (tests/test_compile.py checks the fields against it).
    call = kv_impl.PoolCall(
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool,
        num_kv_heads, rope_style, v_norm_weight, k_scale, v_scale, k_scale_out, v_scale_out, kv_layout,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        return POOL_OPS(call)  # type: ignore[no-any-return]
    return kv_impl.materialize_kv_into_pool(call)


kv_impl.POOL.declare(
    materialize_kv_into_pool,
    scalar_dims={"H": "num_kv_heads"},
    device_of="kv",
    sequence_len={"k_pool": "L", "v_pool": "L", "eps": "L", "k_scale_out": "L", "v_scale_out": "L"},
    storage_of={"k_pool": "kv", "v_pool": "kv"},
    outputs=("k_pool", "v_pool", "k_scale_out", "v_scale_out"),
    rules=(kv_impl.ROTARY_RULE,),
    inner_contiguous=("kv", "k_pool", "v_pool"),
    default_layout="NHD",
    per_row_of={"k_scale_out": "k_pool", "v_scale_out": "v_pool"},
)
POOL_OPS = torch_ops.TorchOps(
    kv_impl.POOL,
    ("materialize_kv_into_pool_stacked", "materialize_kv_into_pool_list"),
    check_kinds=kv_impl.check_pool_kinds,
)
