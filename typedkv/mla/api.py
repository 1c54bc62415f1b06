"""The public MLA ops: shapes declared once in the annotations; calls handed on.

A draft of an MLA target (DeepSeek-V3, Kimi-K2) caches one row per token and
layer: the latent ``c_kv`` (``C`` = kv_lora_rank), RMSNorm'ed with the layer's
``kv_a_layernorm``, then the rope part ``k_pe`` (``R``), rotated by RoPE. As in
`typedkv.kv.api`: a function hands its arguments on by name, eager calls to the
checked implementation (`_mla_impl`), calls traced by torch.compile to its torch
ops (`typedkv.core.torch_ops`, schemas from the same annotations); each function's
`Signature` is declared right after it, then its torch ops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import torch
from jaxtyping import UInt8
from torch import Tensor

from typedkv.core import torch_ops
from typedkv.core.tensor_types import FP8_DS_MLA, MLA_WIDTH, PLAIN, CacheFormat, RopeStyle, static_jaxtyping
from typedkv.mla import impl as mla_impl

if TYPE_CHECKING:
    # As in `typedkv.kv.api`: jaxtyping's own names, imported here, for pyrefly.
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as PoolFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, ParamFloat, PoolFloat, StorageFloat


@static_jaxtyping("T L W C P R")
def materialize_mla_kv(
    ckv: Annotated[StorageFloat[Tensor, "T L W"], MLA_WIDTH],
    kv_norm_weight: ParamFloat[Tensor, "L C"] | None,
    eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    positions: Index[Tensor, " T"],
    *,
    rope_style: RopeStyle,
    out: Annotated[StorageFloat[Tensor, "L T W"], MLA_WIDTH] | None = None,
) -> Annotated[StorageFloat[Tensor, "L T W"], MLA_WIDTH]:
    """Materialize the MLA cache rows of every layer: normed latent, then rotated rope part.

    For every token ``t`` and layer ``l``: ``out[l, t, :C]`` is
    ``RMSNorm(ckv[t, l, :C])`` and ``out[l, t, C:]`` is ``RoPE(ckv[t, l, C:])``.
    One Triton launch covers all layers on CUDA.

    Parameters
    ----------
    ckv : Tensor, shape ``[T, L, C+R]``, bfloat16 | float16 | float32
        Each layer's kv_a projection output (its KV rows): the latent ``c_kv``
        (``C`` values), then the rope part ``k_pe`` (``R``). May be a strided
        view (its last dim contiguous).
    kv_norm_weight : Tensor, shape ``[L, C]``, any float dtype, or None
        Each layer's ``kv_a_layernorm`` weight; ``C`` (kv_lora_rank) is read
        from here. ``None``: the latent passes bit for bit, and ``C`` is ckv's
        width minus ``R``.
    eps : float, a sequence of L numbers, or Tensor of shape ``[L]``
        RMSNorm epsilon, one for all layers or one per layer (a sequence is
        copied to the device once per set of values, then reused). Checked but
        unused when ``kv_norm_weight`` is None.
    cos_sin_cache : Tensor, shape ``[P, R]`` or ``[L, P, R]``, any float dtype
        Row ``p`` holds ``cos`` in columns ``[0, R/2)`` and ``sin`` in
        ``[R/2, R)``. ``R`` (the rotary dim, qk_rope_head_dim) is even and at
        least 2; every one of the rope part's ``R`` dims rotates. ``[L, P, R]``:
        a table per layer, layer ``l`` rotated with table ``l``.
    positions : Tensor, shape ``[T]``, int32 | int64
        Each token's position, on ckv's device. A position outside ``[0, P)``
        gives NaN in that token's rope part (debug mode raises instead).
    rope_style : {"gptj", "neox"}
        Required: ``"gptj"`` rotates interleaved pairs (DeepSeek checkpoints in
        vLLM and sglang), ``"neox"`` the two halves.
    out : Tensor, shape ``[L, T, C+R]``, ckv's dtype and device, optional
        Where to write; may be a ``[:, :T]`` view of a larger slab (last dim
        contiguous). Allocated when ``None``.

    Returns
    -------
    Tensor, shape ``[L, T, C+R]``, ckv's dtype
        ``out`` itself when given.

    Raises
    ------
    InputError
        For any shape, dtype, device or layout misuse, before anything is written.

    Examples
    --------
    >>> T, L, C, R = 4, 2, 32, 16
    >>> ckv = torch.randn(T, L, C + R, dtype=torch.bfloat16)
    >>> cos_sin_cache = typedkv.cos_sin_cache(64, R)
    >>> out = typedkv.materialize_mla_kv(ckv, torch.ones(L, C), 1e-6, cos_sin_cache, torch.arange(T), rope_style="gptj")
    >>> out.shape, out.dtype
    (torch.Size([2, 4, 48]), torch.bfloat16)
    >>> torch.equal(out[:, 0, C:], ckv[0, :, C:])  # token 0 is at position 0: its rope part turns by no angle
    True

    Each layer rotated with its own table (``[L, P, R]``):

    >>> tables = torch.stack([typedkv.cos_sin_cache(64, R, base=1e4), typedkv.cos_sin_cache(64, R, base=1e6)])
    >>> typedkv.materialize_mla_kv(ckv, None, 1e-6, tables, torch.arange(T), rope_style="gptj").shape
    torch.Size([2, 4, 48])
    """
    # In the signature's order (tests/test_mla_compile.py checks the fields against it).
    call = mla_impl.DenseCall(ckv, kv_norm_weight, eps, cos_sin_cache, positions, rope_style, out)
    if torch.compiler.is_compiling():
        (written,) = DENSE_OPS(call)
        return written  # type: ignore[no-any-return]
    return mla_impl.materialize_mla_kv(call)


mla_impl.DENSE.declare(
    materialize_mla_kv,
    scalar_dims={},
    device_of="ckv",
    sequence_len={"eps": "L"},
    same_dtype={"out": "ckv"},
    outputs=("out",),
    rules=(mla_impl.ROTARY_RULE,),
    inner_contiguous=("ckv", "out"),
)


def _allocate_out(arguments: list[Any], index: Mapping[str, int]) -> None:
    """Traced calls: an ``[L, T, C+R]`` output when the caller left it None, as the eager op allocates.

    A ckv that cannot size it gets a placeholder: the op's fake implementation
    rejects ckv first, with the eager message.
    """
    if arguments[index["out"]] is None:
        ckv = arguments[index["ckv"]]
        ok = isinstance(ckv, Tensor) and ckv.dim() == 3
        arguments[index["out"]] = (
            torch.empty((ckv.shape[1], ckv.shape[0], ckv.shape[2]), dtype=ckv.dtype, device=ckv.device)
            if ok
            else torch.empty(0)
        )


DENSE_OPS = torch_ops.TorchOps(mla_impl.DENSE, ("materialize_mla_kv_out",), allocate=_allocate_out, returns=("out",))


# An MLA pool's shapes: stacked over layers or a sequence of per-layer tensors;
# slots in a flat dim S, or in N pages of B slots. sglang's [S, 1, C+R] is the
# paged shape with pages of one slot. The same four in bytes hold rows of
# DeepSeek's FP8 format (cache_format="fp8_ds_mla", `DS_MLA_ROW_BYTES`).
@static_jaxtyping("T L W C P R S N B")
def materialize_mla_kv_into_pool(
    ckv: Annotated[StorageFloat[Tensor, "T L W"], MLA_WIDTH],
    kv_norm_weight: ParamFloat[Tensor, "L C"] | None,
    eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
    cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
    positions: Index[Tensor, " T"],
    cache_loc: Index[Tensor, " T"],
    kv_pool: Annotated[
        Annotated[PoolFloat[Tensor, "L S W"], PLAIN]
        | Annotated[PoolFloat[Tensor, "L N B W"], PLAIN]
        | Sequence[Annotated[PoolFloat[Tensor, "S W"], PLAIN]]
        | Sequence[Annotated[PoolFloat[Tensor, "N B W"], PLAIN]]
        | Annotated[UInt8[Tensor, "L S 656"], FP8_DS_MLA]
        | Annotated[UInt8[Tensor, "L N B 656"], FP8_DS_MLA]
        | Sequence[Annotated[UInt8[Tensor, "S 656"], FP8_DS_MLA]]
        | Sequence[Annotated[UInt8[Tensor, "N B 656"], FP8_DS_MLA]],
        MLA_WIDTH,
    ],
    *,
    rope_style: RopeStyle,
    kv_scale: float | ParamFloat[Tensor, " L"] | None = None,
    cache_format: CacheFormat = "plain",
) -> None:
    """Materialize the MLA cache rows of every layer straight into an MLA pool.

    Computes what :func:`materialize_mla_kv` computes and writes token ``t``'s
    row of layer ``l`` to slot ``cache_loc[t]`` of that layer's pool. Rows not
    named by ``cache_loc`` are never touched. One launch for all layers.

    Parameters
    ----------
    ckv, kv_norm_weight, eps, cos_sin_cache, positions
        As in :func:`materialize_mla_kv`.
    cache_loc : Tensor, shape ``[T]``, int32 | int64
        The pool slot of each token. A negative slot skips the token (padding).
        In production a slot ``>= S`` (``N*B`` for a paged pool) is skipped too;
        debug mode raises for it and for a slot used twice.
    kv_pool : Tensor, or a sequence of L per-layer tensors
        The MLA pool, one row of ``C+R`` per slot: stacked ``[L, S, C+R]`` or
        ``[L, N, B, C+R]``; per layer ``[S, C+R]`` or ``[N, B, C+R]`` (vLLM's
        ``[num_blocks, block_size, C+R]``; sglang's ``[S, 1, C+R]`` is pages of
        one slot). Slot ``s`` is page ``s // B``, offset ``s % B``. ckv's dtype,
        or ``float8_e4m3fn`` / ``float8_e5m2``. Any page and slot strides (a view
        into a larger cache), last dim contiguous; per-layer tensors share one
        dtype and one set of strides. Written in place. With
        ``cache_format="fp8_ds_mla"``: ``uint8`` rows of 656 bytes in the same
        four shapes (``[L, S, 656]``, ``[L, N, B, 656]``, ``[S, 656]``,
        ``[N, B, 656]``; sglang-style ``[S, 1, 656]``).
    rope_style : {"gptj", "neox"}
        As in :func:`materialize_mla_kv`.
    kv_scale : float, or Tensor of shape ``[L]``, optional
        FP8 pools only: the stored value is ``x / scale`` (computed as
        ``x * (1 / scale)`` in float32) saturated to the format's finite range.
        A missing scale means 1.0 (values are still saturated). A tensor scale
        is read in the kernel: no host sync. Not taken with
        ``cache_format="fp8_ds_mla"``, whose rows carry their own scales.
    cache_format : {"plain", "fp8_ds_mla"}, default "plain"
        How a row is stored. ``"plain"``: the ``C+R`` values in the pool's
        dtype. ``"fp8_ds_mla"``: DeepSeek's FP8 row (vLLM's
        ``kv_cache_dtype="fp8_ds_mla"``), for ``C = 512`` and ``R = 64`` only:
        bytes ``[0, 512)`` hold the latent in ``float8_e4m3fn``, ``[512, 528)``
        four float32 scales, ``[528, 656)`` the rope part in bfloat16. The
        (normed) latent is rounded to bfloat16, then each tile of 128 values
        is stored as ``x / scale`` saturated, with ``scale = max(amax(|tile|) /
        448, 2**-126)`` (NaN left out of the amax; an all-zero tile gets the
        smallest normal float32 as its scale, as vLLM's kernel gives it). The
        rotated rope part is rounded once, to bfloat16.

    Raises
    ------
    InputError
        For any shape, dtype, device or layout misuse, before anything is written.

    Examples
    --------
    >>> T, L, C, R, S = 4, 2, 32, 16, 8
    >>> ckv = torch.randn(T, L, C + R)
    >>> kv_pool = torch.zeros(L, S, C + R)
    >>> typedkv.materialize_mla_kv_into_pool(ckv, None, 1e-6, typedkv.cos_sin_cache(64, R), torch.arange(T),
    ...                                      torch.tensor([6, 1, 3, -1]), kv_pool, rope_style="gptj")
    >>> torch.equal(kv_pool[:, 6, :C], ckv[0, :, :C])  # no norm weight: the latent is stored as it is
    True
    >>> bool(kv_pool[:, [0, 2, 4, 5, 7]].any())  # slots cache_loc does not name stay untouched
    False

    DeepSeek's FP8 rows (C = 512, R = 64), in a pool of bytes:

    >>> C, R = 512, 64
    >>> ckv = torch.randn(T, L, C + R, dtype=torch.bfloat16)
    >>> ds_pool = torch.zeros(L, S, 656, dtype=torch.uint8)
    >>> typedkv.materialize_mla_kv_into_pool(ckv, torch.ones(L, C), 1e-6, typedkv.cos_sin_cache(64, R),
    ...                                      torch.arange(T), torch.tensor([6, 1, 3, -1]), ds_pool,
    ...                                      rope_style="gptj", cache_format="fp8_ds_mla")
    >>> latent = ds_pool[0, 6, :C].view(torch.float8_e4m3fn).float().view(4, 128)
    >>> latent.abs().amax(dim=1)  # each tile's largest value lands on e4m3's largest, 448
    tensor([448., 448., 448., 448.])
    >>> scales = ds_pool[0, 6, C : C + 16].view(torch.float32)  # one per tile: latent * scale dequantizes
    >>> ds_pool[0, 6, C + 16 :].view(torch.bfloat16).shape  # the rotated rope part
    torch.Size([64])
    """
    # In the signature's order (tests/test_mla_compile.py checks the fields against it).
    call = mla_impl.PoolCall(
        ckv, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, kv_pool, rope_style, kv_scale, cache_format
    )
    if torch.compiler.is_compiling():
        return POOL_OPS(call)  # type: ignore[no-any-return]
    return mla_impl.materialize_mla_kv_into_pool(call)


mla_impl.POOL.declare(
    materialize_mla_kv_into_pool,
    scalar_dims={},
    device_of="ckv",
    sequence_len={"kv_pool": "L", "eps": "L"},
    storage_of={"kv_pool": "ckv"},
    outputs=("kv_pool",),
    rules=(mla_impl.ROTARY_RULE,),
    inner_contiguous=("ckv", "kv_pool"),
)
POOL_OPS = torch_ops.TorchOps(
    mla_impl.POOL, ("materialize_mla_kv_into_pool_stacked", "materialize_mla_kv_into_pool_list")
)
