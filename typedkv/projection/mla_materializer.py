"""`MLAKVMaterializer`: an MLA draft's whole cache path, built once from its layers' weights.

As `typedkv.KVMaterializer` for per-head K/V: a call is one GEMM for all layers
(``hidden @ W_all.T``, the KV rows of each layer's ``kv_a`` projection) into a
workspace the object keeps, then one fused launch (latent RMSNorm, RoPE of the
rope part, store to ``[L, T, C+R]`` or to the MLA pool). Nothing in a call
waits for the device, and a call captured in a CUDA graph writes into rows of
the graph's own, never into the eager workspace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from jaxtyping import UInt8
from torch import Tensor, nn

from typedkv.core.checking import Bound, CheckedLayouts
from typedkv.core.memory import Footprint
from typedkv.core.tensor_types import MLA_WIDTH, CacheFormat, RopeStyle, static_jaxtyping
from typedkv.mla.api import DENSE_OPS, POOL_OPS
from typedkv.mla.impl import DenseCall, PoolCall, dense_layout, pool_layout
from typedkv.mla.impl import materialize_mla_kv as materialize_mla_kv_planned
from typedkv.mla.impl import materialize_mla_kv_into_pool as materialize_mla_kv_into_pool_planned
from typedkv.projection import layers as projection_layers
from typedkv.projection.layers import (
    Workspace,
    check_layer_counts,
    check_layer_dtypes,
    eps_of_layers,
    keep_dtypes,
    keep_layers,
    stacked,
)
from typedkv.projection.weights import MLA_BUFFERS, MLA_PROJECTION, MLA_STACKED_DIMS, MLA_WEIGHTS

_State = tuple[Tensor, Tensor | None, Tensor | None, float | Tensor, Tensor]
"""``(kv_a_weight, kv_a_bias, kv_norm_weight, eps, cos_sin_cache)``: what a call reads of the materializer."""

if TYPE_CHECKING:
    # As in `typedkv.kv.api`: jaxtyping's own names, imported here, for pyrefly.
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as PoolFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, ParamFloat, PoolFloat, StorageFloat


@static_jaxtyping("L W C hidden")
class MLAKVMaterializer(nn.Module):
    """The MLA cache path of a draft model's layers: one GEMM for all layers, then one fused launch.

    Built once from the layers' weights; then ``m(hidden, positions)`` gives
    every layer's cache rows (``RMSNorm(c_kv)`` then ``RoPE(k_pe)``), and
    ``m.into_pool(...)`` writes them straight into an MLA pool. Inference only:
    the weights are detached.

    Parameters
    ----------
    kv_a_weight : Tensor ``[L, C+R, hidden]``, or a sequence of L tensors ``[C+R, hidden]``
        Each layer's ``kv_a`` projection (``kv_a_proj_with_mqa``) as ``nn.Linear``
        weight rows: the latent's ``C`` rows, then the rope part's ``R``.
        bfloat16 | float16 | float32; ``hidden`` must have this dtype. Per-layer
        tensors are copied into one stacked weight; a contiguous stacked tensor
        is used as it is.
    kv_norm_weight : Tensor ``[L, C]``, a sequence of L tensors ``[C]``, or None
        Each layer's ``kv_a_layernorm`` weight, any float dtype; ``C``
        (kv_lora_rank) is read from here. ``None``: the latent passes as the
        projection gives it, and ``C`` is kv_a_weight's rows less ``R``.
    eps : float, a sequence of L numbers, or Tensor ``[L]``
        RMSNorm epsilon, one for all layers or one per layer.
    cos_sin_cache : Tensor ``[P, R]``, or ``[L, P, R]`` (a table per layer)
        As in :func:`typedkv.materialize_mla_kv`. Every tensor argument must be on its device.
    rope_style : {"gptj", "neox"}
        Required, as in :func:`typedkv.materialize_mla_kv`.
    kv_a_bias : Tensor ``[L, C+R]``, or a sequence of L tensors ``[C+R]``, optional
        Each layer's projection bias, kv_a_weight's dtype.

    Raises
    ------
    InputError
        For any shape, dtype or device misuse; a layer that disagrees with the
        others is named (``kv_a_weight[2]: expected shape ...``).

    Notes
    -----
    The GEMM writes into a workspace that grows to the next power of two of
    ``T`` and is then reused, so an eager call at a fixed ``T`` allocates
    nothing but its output (none for :meth:`into_pool`) and never waits for the
    device. The workspace is per thread, shared by one thread's calls on
    several CUDA streams as `typedkv.KVMaterializer`'s. A call captured in a
    CUDA graph writes into rows of its own, allocated from the graph's memory
    pool. Under ``torch.compile`` the GEMM is an ordinary op of the graph and
    the workspace is not used.

    As with `typedkv.KVMaterializer`: a buffer replaced after construction is
    checked at the next eager call; casting the module keeps ``cos_sin_cache``
    and ``eps`` in the dtype they were built with; the buffers are not persistent.

    Examples
    --------
    >>> L, C, R, hidden_size, T = 2, 32, 16, 24, 4
    >>> kv_a_weight = torch.randn(L, C + R, hidden_size)  # each layer's latent rows, then its rope rows
    >>> cos_sin_cache = typedkv.cos_sin_cache(64, R)
    >>> m = typedkv.MLAKVMaterializer(kv_a_weight, torch.ones(L, C), 1e-6, cos_sin_cache, rope_style="gptj")
    >>> m
    MLAKVMaterializer(num_layers=2, kv_lora_rank=32, rotary_dim=16, hidden_size=24, rope_style='gptj')
    >>> m(torch.randn(T, hidden_size), torch.arange(T)).shape
    torch.Size([2, 4, 48])

    DeepSeek's geometry (C = 512, R = 64) into vLLM's ``fp8_ds_mla`` rows of 656 bytes:

    >>> C, R = 512, 64
    >>> m = typedkv.MLAKVMaterializer(torch.randn(L, C + R, hidden_size), torch.ones(L, C), 1e-6,
    ...                               typedkv.cos_sin_cache(64, R), rope_style="gptj")
    >>> ds_pool = torch.zeros(L, 8, 656, dtype=torch.uint8)
    >>> m.into_pool(torch.randn(T, hidden_size), torch.arange(T), torch.tensor([4, 0, 7, -1]), ds_pool,
    ...             cache_format="fp8_ds_mla")
    >>> ds_pool[:, 4, :C].view(torch.float8_e4m3fn).float().abs().max().item()  # tiles scaled onto e4m3's range
    448.0
    """

    kv_a_weight: Tensor
    kv_a_bias: Tensor | None
    kv_norm_weight: Tensor | None
    cos_sin_cache: Tensor
    eps: float | Tensor

    @static_jaxtyping("P R")
    def __init__(
        self,
        kv_a_weight: Annotated[
            StorageFloat[Tensor, "L W hidden"] | Sequence[StorageFloat[Tensor, "W hidden"]], MLA_WIDTH
        ],
        kv_norm_weight: ParamFloat[Tensor, "L C"] | Sequence[ParamFloat[Tensor, " C"]] | None,
        eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
        cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
        *,
        rope_style: RopeStyle,
        kv_a_bias: Annotated[
            StorageFloat[Tensor, "L W"] | Sequence[StorageFloat[Tensor, " W"]] | None, MLA_WIDTH
        ] = None,
    ) -> None:
        """Build the MLA cache path of ``kv_a_weight``'s layers, checking every argument once.

        The parameters are the class's (``help(typedkv.MLAKVMaterializer)``):
        ``kv_a_weight`` ``[L, C+R, hidden]`` or L ``[C+R, hidden]``,
        ``kv_norm_weight`` ``[L, C]`` or None, ``eps``, ``cos_sin_cache`` ``[P, R]`` or ``[L, P, R]``,
        ``rope_style``, ``kv_a_bias``.
        """
        super().__init__()
        check_layer_counts(
            {
                "kv_a_weight": kv_a_weight, "kv_norm_weight": kv_norm_weight, "kv_a_bias": kv_a_bias, "eps": eps,
                "cos_sin_cache": cos_sin_cache,
            },
            MLA_STACKED_DIMS,
        )  # fmt: skip
        layer_eps = eps_of_layers(eps, cos_sin_cache, kv_norm_weight)
        bound = MLA_WEIGHTS.check((kv_norm_weight, cos_sin_cache, kv_a_weight, kv_a_bias, layer_eps, rope_style))
        check_layer_dtypes(
            {"kv_a_weight": kv_a_weight, "kv_norm_weight": kv_norm_weight, "kv_a_bias": kv_a_bias},
            "kv_a_weight",
            "kv_a_bias",
        )
        weight = stacked(kv_a_weight)
        self.num_layers = weight.shape[0]
        self.kv_lora_rank = bound.dims["C"]
        self.rotary_dim = bound.dims["R"]
        self.hidden_size = bound.dims["hidden"]
        self.rope_style: RopeStyle = rope_style
        keep_layers(
            self, ("kv_a_weight", "kv_a_bias", "kv_norm_weight"), weight, kv_a_bias, kv_norm_weight, cos_sin_cache,
            cast("float | Tensor", layer_eps),
        )  # fmt: skip
        self._dims = (self.num_layers, self.kv_lora_rank, self.rotary_dim, self.hidden_size)
        self._rows = Workspace()
        self._plans: CheckedLayouts[Any] = CheckedLayouts(projection_layers.LAYOUTS_KEPT)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        # The RoPE table and eps keep the dtype they were built with through the module's casts (`keep_dtypes`).
        cast_all = super()._apply  # nn.Module's, untyped
        return keep_dtypes(self, lambda: cast_all(fn, recurse), ("cos_sin_cache", "eps"))  # type: ignore[no-untyped-call]

    @static_jaxtyping("T")
    def forward(
        self,
        hidden: StorageFloat[Tensor, "T hidden"],
        positions: Index[Tensor, " T"],
        out: Annotated[StorageFloat[Tensor, "L T W"], MLA_WIDTH] | None = None,
    ) -> Annotated[StorageFloat[Tensor, "L T W"], MLA_WIDTH]:
        """The cache rows of every layer for ``hidden``.

        Parameters
        ----------
        hidden : Tensor, shape ``[T, hidden]``, kv_a_weight's dtype and device
            The hidden states the layers project from.
        positions : Tensor, shape ``[T]``, int32 | int64
            Each token's position, as in :func:`typedkv.materialize_mla_kv`.
        out : Tensor, shape ``[L, T, C+R]``, hidden's dtype and device, optional
            Where to write, as in :func:`typedkv.materialize_mla_kv`. Allocated when ``None``.

        Returns
        -------
        Tensor, shape ``[L, T, C+R]``, hidden's dtype
            ``out`` itself when given, else newly allocated.

        Raises
        ------
        InputError
            For any shape, dtype or device misuse.
        """
        _, _, kv_norm_weight, eps, cos_sin_cache = state = self._state()
        # The call as typedkv.materialize_mla_kv takes it, hidden in ckv's place until the GEMM fills it in.
        call = DenseCall(hidden, kv_norm_weight, eps, cos_sin_cache, positions, self.rope_style, out)
        return self._materialize(call, state, _DENSE_PATH)  # type: ignore[no-any-return]

    @static_jaxtyping("T S N B")
    def into_pool(
        self,
        hidden: StorageFloat[Tensor, "T hidden"],
        positions: Index[Tensor, " T"],
        cache_loc: Index[Tensor, " T"],
        kv_pool: Annotated[
            PoolFloat[Tensor, "L S W"]
            | PoolFloat[Tensor, "L N B W"]
            | Sequence[PoolFloat[Tensor, "S W"]]
            | Sequence[PoolFloat[Tensor, "N B W"]]
            | UInt8[Tensor, "L S 656"]
            | UInt8[Tensor, "L N B 656"]
            | Sequence[UInt8[Tensor, "S 656"]]
            | Sequence[UInt8[Tensor, "N B 656"]],
            MLA_WIDTH,
        ],
        kv_scale: float | ParamFloat[Tensor, " L"] | None = None,
        *,
        cache_format: CacheFormat = "plain",
    ) -> None:
        """The cache rows of every layer for ``hidden``, written straight into an MLA pool.

        Parameters
        ----------
        hidden, positions
            As in :meth:`forward`.
        cache_loc, kv_pool, kv_scale, cache_format
            As in :func:`typedkv.materialize_mla_kv_into_pool` (stacked, per-layer
            or paged pools, FP8 with a scale, DeepSeek's FP8 rows of 656 bytes with
            ``cache_format="fp8_ds_mla"``). Written in place, slots named by
            ``cache_loc`` only.

        Raises
        ------
        InputError
            For any shape, dtype, device or layout misuse.
        """
        _, _, kv_norm_weight, eps, cos_sin_cache = state = self._state()
        call = PoolCall(
            hidden, kv_norm_weight, eps, cos_sin_cache, positions, cache_loc, kv_pool, self.rope_style, kv_scale,
            cache_format,
        )  # fmt: skip
        self._materialize(call, state, _POOL_PATH)

    def _materialize(self, call: DenseCall | PoolCall, state: _State, path: _Path) -> Any:
        """One call of either method: ``call`` as the op takes it, with ``hidden`` in ckv's place.

        As in `typedkv.KVMaterializer`: eagerly, a layout checked before goes
        straight to the GEMM and the launch; a new one is checked in full -- the
        call's own arguments first, so that their messages speak of ``hidden``
        -- before the GEMM runs. Under ``torch.compile``: the GEMM, then the op.
        """
        hidden = call[0]
        if torch.compiler.is_compiling():
            # The workspace is state a compiled graph must not bake in; the graph plans its own buffers.
            width = self.kv_lora_rank + self.rotary_dim
            ckv = F.linear(hidden, state[0], state[1]).view(hidden.shape[0], self.num_layers, width)
            return path.traced(type(call)(ckv, *call[1:]))
        layout = (*call, state[0], state[1])
        kept = self._plans.get(layout)
        if kept is None:
            # The layout includes the buffers: one replaced since construction is checked here.
            MLA_BUFFERS.check((state[2], state[4], state[0], state[1], state[3], *self._dims))
            cache_loc = call.cache_loc if isinstance(call, PoolCall) else None
            MLA_PROJECTION.plan((state[0], hidden, call.positions, cache_loc), _accepted)
        written = call.out if isinstance(call, DenseCall) else call.kv_pool
        call = type(call)(self._gemm(hidden, state), *call[1:])
        if kept is None:
            name = "out" if isinstance(call, DenseCall) else "kv_pool"
            # The weights, read by this call's GEMM and every later call's, against what it writes.
            apart = None
            if written is not None:
                apart = Footprint(
                    ("kv_a_weight", "kv_a_bias", name), frozenset((name,)), (*state[:2], written), each_other=False
                )
            kept = self._plans.keep(layout, (path.layout(call), apart))
        plan, apart = kept
        if apart is not None:
            apart.check((*state[:2], written))
        # Right after the GEMM: a plain launch (`typedkv.core.launcher.KernelLaunch`).
        return path.planned(call, plan, True)

    if TYPE_CHECKING:
        # As in KVMaterializer: to a type checker a call is forward itself.
        __call__ = forward

    def extra_repr(self) -> str:
        return (
            f"num_layers={self.num_layers}, kv_lora_rank={self.kv_lora_rank}, rotary_dim={self.rotary_dim}, "
            f"hidden_size={self.hidden_size}, rope_style={self.rope_style!r}"
        )

    def _state(self) -> _State:
        """``(kv_a_weight, kv_a_bias, kv_norm_weight, eps, cos_sin_cache)``, eagerly read without nn.Module's attribute lookup."""
        if torch.compiler.is_compiling():
            return self.kv_a_weight, self.kv_a_bias, self.kv_norm_weight, self.eps, self.cos_sin_cache
        buffers = self._buffers
        eps = buffers["eps"] if "eps" in buffers else self.__dict__["eps"]
        return (
            cast(Tensor, buffers["kv_a_weight"]), buffers["kv_a_bias"], buffers["kv_norm_weight"],
            cast("float | Tensor", eps), cast(Tensor, buffers["cos_sin_cache"]),
        )  # fmt: skip

    def _gemm(self, hidden: Tensor, state: _State) -> Tensor:
        """``[T, L, C+R]``, eagerly: every layer's kv_a projection of ``hidden``, one GEMM into the workspace.

        The caller has checked the call (`MLA_PROJECTION`, for a layout not seen before).
        """
        return projection_layers.project(
            self._rows, hidden, state[0], state[1], (self.num_layers, self.kv_lora_rank + self.rotary_dim)
        )

    @property
    def _workspace(self) -> Tensor | None:
        """The eager GEMM's output buffer (None before the first eager call)."""
        return self._rows.buffer


def _accepted(bound: Bound, args: object) -> bool:
    return True


class _Path(NamedTuple):
    """What differs between `MLAKVMaterializer.forward` and `into_pool`: the op they end in."""

    traced: Callable[[Any], Any]  # under torch.compile: the op, as the public function calls it
    layout: Callable[[Any], Any]  # the op's plan of a call's layout (its production check)
    planned: Callable[[Any, Any, bool], Any]  # the op, eagerly, given the plan (and: right after the GEMM)


_DENSE_PATH = _Path(lambda call: DENSE_OPS(call)[0], dense_layout, materialize_mla_kv_planned)
_POOL_PATH = _Path(POOL_OPS, pool_layout, materialize_mla_kv_into_pool_planned)
