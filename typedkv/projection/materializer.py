"""`KVMaterializer`: a draft model's whole K/V path, built once from its layers' weights.

A call takes one of two paths (``projection_path``). GEMM + kernel: one GEMM for
all layers (``hidden @ W_all.T``, written into a workspace the object keeps) and
one fused launch. The workspace grows to the next power of two of ``T`` and is
reused after that: a decode loop at a fixed ``T`` allocates nothing for it, and
nothing in a call waits for the device, so the call can be captured in a CUDA
graph -- where it writes into rows of the graph's own, never into the eager
workspace (see `typedkv.projection.layers.Workspace`). Fused: one kernel computes the
projection and the K/V epilogue (`typedkv.projection.fused`), no workspace at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, cast, get_args

import torch
import torch.nn.functional as F
from jaxtyping import Float32
from torch import Tensor, nn

from typedkv.core.checking import Bound, CheckedLayouts
from typedkv.core.errors import InputError
from typedkv.core.implementation import Plan
from typedkv.core.memory import Footprint
from typedkv.core.messages import or_list
from typedkv.core.tensor_types import HND, KV_WIDTH, NHD, KVLayout, RopeStyle, static_jaxtyping
from typedkv.kv.impl import DenseCall, PoolCall
from typedkv.projection.dispatch import ProjectionPath, State, Way, takes_fused
from typedkv.projection.dispatch import way as dispatch_way
from typedkv.projection.fused import (
    PROJECTION,
    Launches,
    project_kv_split,
    stand_in,
)
from typedkv.projection.layers import (
    LAYOUTS_KEPT,
    Workspace,
    check_layer_counts,
    check_layer_dtypes,
    eps_of_layers,
    keep_dtypes,
    keep_layers,
    project,
    split_gemm,
    stacked,
)
from typedkv.projection.paths import DENSE_PATH, POOL_PATH, MethodPath
from typedkv.projection.weights import KV_BUFFERS, KV_STACKED_DIMS, KV_WEIGHTS

if TYPE_CHECKING:
    # As in `typedkv.kv.api`: jaxtyping's own names, imported here, for pyrefly.
    from jaxtyping import Float as KVPoolDtype
    from jaxtyping import Float as ParamFloat
    from jaxtyping import Float as StorageFloat
    from jaxtyping import Int as Index
else:
    from typedkv.core.tensor_types import Index, KVPoolDtype, ParamFloat, StorageFloat


class _Kept(NamedTuple):
    """What a materializer keeps for a layout it checked: the op's plan, kv's stand-in (None: GEMM + kernel,
    which checks the GEMM's output), the layout's launches, and the way its calls compute."""

    plan: Plan
    stand_in: Tensor | None
    launches: Launches  # (`typedkv.projection.fused.project_kv`, `project_kv_split`)
    way: Way
    # What the call reads of the materializer (hidden where a kernel reads it while writing: the fused
    # kernel, V's GEMM; GEMM + kernel has read it before) against the tensors it writes: None when it
    # writes none of the caller's. The weights are read by every later call too.
    apart: Footprint | None


@static_jaxtyping("L KV H D hidden")
class KVMaterializer(nn.Module):
    """The K/V path of a draft model's layers: one GEMM for all layers, then one fused launch.

    Built once from the layers' weights; then ``m(hidden, positions)`` gives
    every layer's K (RMSNorm, then RoPE) and V, and ``m.into_pool(...)`` writes
    them straight into a paged pool. Inference only: the weights are detached.

    Parameters
    ----------
    kv_weight : Tensor ``[L, 2*H*D, hidden]``, or a sequence of L tensors ``[2*H*D, hidden]``
        Each layer's K/V projection as ``nn.Linear`` weight rows: K rows first,
        then V rows. bfloat16 | float16 | float32; ``hidden`` must have this dtype.
        Per-layer tensors are copied into one stacked weight; a contiguous
        stacked tensor is used as it is (not copied).
    k_norm_weight : Tensor ``[L, D]``, a sequence of L tensors ``[D]``, or None
        Each layer's K RMSNorm weight, any float dtype. ``D`` (head dim) is read
        from here; ``None`` for a draft without a K norm (K is RoPE(k), ``D`` is
        kv_weight's rows divided by ``2*H``).
    eps : float, a sequence of L numbers, or Tensor ``[L]``
        RMSNorm epsilon, one for all layers or one per layer (K's and V's norms); unused without a norm weight.
    cos_sin_cache : Tensor ``[P, R]``, or ``[L, P, R]`` (a table per layer)
        As in :func:`typedkv.materialize_kv`. Every tensor argument must be on its device.
    num_kv_heads : int
        ``H``.
    rope_style : {"neox", "gptj"}
        As in :func:`typedkv.materialize_kv`.
    kv_bias : Tensor ``[L, 2*H*D]``, or a sequence of L tensors ``[2*H*D]``, optional
        Each layer's projection bias, kv_weight's dtype.
    v_norm_weight : Tensor ``[L, D]``, or a sequence of L tensors ``[D]``, optional
        Each layer's V RMSNorm weight, any float dtype: V is normed as in
        :func:`typedkv.materialize_kv` on every path (a weightless norm is a weight of ones).

    Raises
    ------
    InputError
        For any shape, dtype or device misuse; a layer that disagrees with the
        others is named (``kv_weight[2]: expected shape ...``).

    Notes
    -----
    The GEMM writes into a workspace that grows to the next power of two of
    ``T`` and is then reused, so an eager call at a fixed ``T`` allocates
    nothing but its outputs (none for :meth:`into_pool`) and never waits for
    the device. The workspace is per thread. One thread's calls on several
    CUDA streams share it: a call on another stream than the last makes its
    stream wait for the work queued on the last one so far (on the device, not
    the host; docs/reliability.md). A call captured in a CUDA graph writes into
    rows of its own, allocated from the graph's memory pool (``T * L * 2*H*D``
    elements, reusable by the graph's later ops): eager calls at any ``T``
    before or after the capture never touch what the graph uses. Under
    ``torch.compile`` the GEMM is an ordinary op of the graph and the workspace
    is not used.

    An eager call's layout (its arguments' and the weights' dtypes, shapes,
    strides and devices) is checked in full once; later calls of that layout go
    straight to the GEMM and the launch, with the checks that depend on values
    (outputs or pools sharing memory; debug mode's) still run on every call.
    A buffer replaced after construction (``kv_weight``, ``kv_bias``,
    ``k_norm_weight``, ``v_norm_weight``, ``eps``, ``cos_sin_cache``) is checked against the others
    at the next eager call: one of another shape or dtype is an `InputError`
    naming it. The buffers are the constructor's tensors where they were stacked
    and contiguous, else copies (per-layer lists are always copied): weights
    loaded into the model afterwards reach the materializer only through its
    buffers. Casting the module (``.to(torch.bfloat16)``, ``.half()``) casts the
    weights, bias and norm weight; ``cos_sin_cache`` and ``eps`` keep the dtype
    they were built with and move with the module (a RoPE table rounded to
    bfloat16 moves K by a few ulps). The buffers are not persistent: a
    ``state_dict`` holds none of them.

    ``projection_path`` picks how a call computes the projection: ``"gemm"``
    (the GEMM above, then the K/V kernel), ``"fused"`` (one Triton kernel that
    computes ``hidden @ W^T`` and, in its epilogue, norms, rotates and stores K
    and V: no ``kv`` in memory, no workspace), or ``"auto"`` (the default): the
    fused path where a table measured per GPU and per ``T`` range says it is
    faster (on the H200: ``T < 33``, and ``T < 129`` where the weight's tiles
    load by TMA -- NeoX RoPE, head pieces of powers of two rows, the weight on
    16 bytes; and ``T > 1536`` where a warp-specialised kernel can run: sm_90
    under Triton 3.6, bf16/fp16, no bias, no FP8 pool, NeoX RoPE over the whole
    of a head of 128, ``H*D`` a multiple of 256, rows and outputs laid out for
    TMA; a draft of fewer fused programs, ``L * 2 * H``, than the GPU's table
    asks -- 48 on the H100 -- or of heads over 128 takes GEMM + kernel; a device
    not measured takes GEMM + kernel; see docs/performance.md). Both
    paths check a call alike (the same messages, before anything is written)
    and give the same results up to the GEMM's accumulation order (each K/V
    value is first rounded to the storage dtype, as a stored ``kv`` would be;
    on CUDA at ``T = 1`` with a bias, GEMM + kernel's ``torch.addmm`` rounds
    the product before adding the bias: docs/reliability.md). The fused kernel runs for CUDA
    tensors (and under ``TRITON_INTERPRET=1``); CPU tensors take GEMM + kernel
    whatever the setting. Under ``torch.compile`` a call pinned to ``"fused"``
    is one op of the graph (``torch.ops.typedkv.project_kv_*``), checked while
    tracing; ``"auto"`` compiles GEMM + kernel.

    On the GEMM path (``"gemm"``, or ``"auto"`` outside the fused ranges), an
    eager call into dense outputs at a ``T`` where a second per-GPU table says
    so (on the H200: ``T >= 65536``; a contiguous or absent ``v_out``, no
    ``kv_bias``, no ``v_norm_weight``) splits the GEMM in two batched GEMMs: V's
    rows go straight into ``v_out`` and only K passes through the workspace and
    the kernel, so V is never read back. The results are GEMM + kernel's, up to
    the GEMM's accumulation order. A V norm keeps GEMM + kernel: normed, V must
    be read back anyway, and the split would save nothing.

    Examples
    --------
    >>> L, H, D, hidden_size, T = 2, 2, 16, 24, 4
    >>> kv_weight = torch.randn(L, 2 * H * D, hidden_size)  # each layer's K rows, then its V rows
    >>> m = typedkv.KVMaterializer(kv_weight, torch.ones(L, D), 1e-6, typedkv.cos_sin_cache(64, D), num_kv_heads=H)
    >>> m
    KVMaterializer(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=24, rope_style='neox')
    >>> k, v = m(torch.randn(T, hidden_size), torch.arange(T))
    >>> k.shape, v.shape
    (torch.Size([2, 4, 2, 16]), torch.Size([2, 4, 2, 16]))
    """

    kv_weight: Tensor
    kv_bias: Tensor | None
    k_norm_weight: Tensor | None
    v_norm_weight: Tensor | None
    cos_sin_cache: Tensor
    eps: float | Tensor

    @static_jaxtyping("P R")
    def __init__(
        self,
        kv_weight: Annotated[
            StorageFloat[Tensor, "L KV hidden"] | Sequence[StorageFloat[Tensor, "KV hidden"]], KV_WIDTH
        ],
        k_norm_weight: ParamFloat[Tensor, "L D"] | Sequence[ParamFloat[Tensor, " D"]] | None,
        eps: float | Sequence[float] | ParamFloat[Tensor, " L"],
        cos_sin_cache: ParamFloat[Tensor, "P R"] | ParamFloat[Tensor, "L P R"],
        *,
        num_kv_heads: int,
        rope_style: RopeStyle = "neox",
        kv_bias: Annotated[
            StorageFloat[Tensor, "L KV"] | Sequence[StorageFloat[Tensor, " KV"]] | None, KV_WIDTH
        ] = None,
        v_norm_weight: ParamFloat[Tensor, "L D"] | Sequence[ParamFloat[Tensor, " D"]] | None = None,
    ) -> None:
        """Build the K/V path of ``kv_weight``'s layers, checking every argument once.

        The parameters are the class's (``help(typedkv.KVMaterializer)``):
        ``kv_weight`` ``[L, 2*H*D, hidden]`` or L ``[2*H*D, hidden]``,
        ``k_norm_weight`` ``[L, D]`` or None, ``eps``, ``cos_sin_cache`` ``[P, R]`` or ``[L, P, R]``,
        ``num_kv_heads``, ``rope_style``, ``kv_bias``, ``v_norm_weight``.
        """
        super().__init__()
        check_layer_counts(
            {
                "kv_weight": kv_weight, "k_norm_weight": k_norm_weight, "v_norm_weight": v_norm_weight,
                "kv_bias": kv_bias, "eps": eps, "cos_sin_cache": cos_sin_cache,
            },
            KV_STACKED_DIMS,
        )  # fmt: skip
        layer_eps = eps_of_layers(eps, cos_sin_cache, k_norm_weight if k_norm_weight is not None else v_norm_weight)
        bound = KV_WEIGHTS.check(
            (k_norm_weight, v_norm_weight, cos_sin_cache, kv_weight, kv_bias, layer_eps, num_kv_heads, rope_style)
        )
        norm_weights = {"k_norm_weight": k_norm_weight, "v_norm_weight": v_norm_weight}
        check_layer_dtypes({"kv_weight": kv_weight, **norm_weights, "kv_bias": kv_bias}, "kv_weight", "kv_bias")
        weight = stacked(kv_weight)
        self.num_layers = weight.shape[0]
        self.num_kv_heads = num_kv_heads
        self.head_dim = bound.dims["D"]
        self.hidden_size = bound.dims["hidden"]
        self.rope_style: RopeStyle = rope_style
        keep_layers(
            self, ("kv_weight", "kv_bias", "k_norm_weight"), weight, kv_bias, k_norm_weight, cos_sin_cache,
            cast("float | Tensor", layer_eps),
        )  # fmt: skip
        self.register_buffer(
            "v_norm_weight", None if v_norm_weight is None else stacked(v_norm_weight), persistent=False
        )
        self._dims = (self.num_layers, num_kv_heads, self.head_dim, self.hidden_size)
        self._rows = Workspace()
        self._path: ProjectionPath = "auto"
        self._plans: CheckedLayouts[_Kept] = CheckedLayouts(LAYOUTS_KEPT)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        # The RoPE table and eps keep the dtype they were built with through the module's casts (`keep_dtypes`).
        cast_all = super()._apply  # nn.Module's, untyped
        return keep_dtypes(self, lambda: cast_all(fn, recurse), ("cos_sin_cache", "eps"))  # type: ignore[no-untyped-call]

    @property
    def projection_path(self) -> ProjectionPath:
        """``"auto"`` (default), ``"fused"`` or ``"gemm"``: how calls compute the projection (see the class notes)."""
        return self._path

    @projection_path.setter
    def projection_path(self, path: ProjectionPath) -> None:
        choices = get_args(ProjectionPath)
        if not isinstance(path, str) or path not in choices:
            raise InputError(f"projection_path: expected {or_list([repr(c) for c in choices])}, got {path!r}")
        self._path = path

    @static_jaxtyping("T")
    def forward(
        self,
        hidden: StorageFloat[Tensor, "T hidden"],
        positions: Index[Tensor, " T"],
        k_out: StorageFloat[Tensor, "L T H D"] | None = None,
        v_out: StorageFloat[Tensor, "L T H D"] | None = None,
    ) -> tuple[StorageFloat[Tensor, "L T H D"], StorageFloat[Tensor, "L T H D"]]:
        """K and V of every layer for ``hidden``.

        Parameters
        ----------
        hidden : Tensor, shape ``[T, hidden]``, kv_weight's dtype and device
            The hidden states the layers project K/V from.
        positions : Tensor, shape ``[T]``, int32 | int64
            Each token's position, as in :func:`typedkv.materialize_kv`.
        k_out, v_out : Tensor, shape ``[L, T, H, D]``, hidden's dtype and device, optional
            Where to write, as in :func:`typedkv.materialize_kv`. Allocated when ``None``.

        Returns
        -------
        k, v : Tensor, shape ``[L, T, H, D]``, hidden's dtype
            ``k_out`` and ``v_out`` themselves when given, else newly allocated.

        Raises
        ------
        InputError
            For any shape, dtype or device misuse.
        """
        _, _, k_norm_weight, eps, cos_sin_cache, v_norm_weight = state = self._state()
        # The call as typedkv.materialize_kv takes it, hidden in kv's place until the path fills it in.
        call = DenseCall(
            hidden, k_norm_weight, eps, cos_sin_cache, positions, self.num_kv_heads, self.rope_style, v_norm_weight,
            k_out, v_out,
        )  # fmt: skip
        return self._materialize(call, state, DENSE_PATH)  # type: ignore[no-any-return]

    @static_jaxtyping("T S N B")
    def into_pool(
        self,
        hidden: StorageFloat[Tensor, "T hidden"],
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
        """K and V of every layer for ``hidden``, written straight into a paged pool.

        Parameters
        ----------
        hidden, positions
            As in :meth:`forward`.
        cache_loc, k_pool, v_pool, k_scale, v_scale, k_scale_out, v_scale_out, kv_layout
            As in :func:`typedkv.materialize_kv_into_pool` (stacked, per-layer
            or paged pools; FP8 or int8 pools with a scale written per row).
            The pools (and scale tensors) are written in place, slots named by
            ``cache_loc`` only. Every projection path writes the same bits
            (the fused kernel, or the GEMM then the K/V kernel).

        Raises
        ------
        InputError
            For any shape, dtype, device or layout misuse.
        """
        _, _, k_norm_weight, eps, cos_sin_cache, v_norm_weight = state = self._state()
        call = PoolCall(
            hidden, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_pool, v_pool, self.num_kv_heads,
            self.rope_style, v_norm_weight, k_scale, v_scale, k_scale_out, v_scale_out, kv_layout,
        )  # fmt: skip
        self._materialize(call, state, POOL_PATH)

    def _materialize(self, call: DenseCall | PoolCall, state: State, path: MethodPath) -> Any:
        """One call of either method: ``call`` as the op takes it, with ``hidden`` in kv's place.

        Eagerly, a layout seen before skips the checks that depend on it only
        (`CheckedLayouts`); a new one is checked in full -- the call's own
        arguments first, so that their messages speak of ``hidden`` -- before the
        GEMM runs or anything is written. Under ``torch.compile``: one op.
        """
        hidden = call[0]
        weight, bias = state[0], state[1]
        if torch.compiler.is_compiling():
            if takes_fused(self._path, hidden, state, head_dim=self.head_dim, neox=self.rope_style == "neox"):
                return path.fused_ops((hidden, weight, bias, self.num_layers, *call[1:]))
            return path.ops(type(call)(self._traced_projection(hidden), *call[1:]))
        # The way a call computes follows from projection_path and the layout (device, T,
        # outputs), so it is kept with the layout's plan, not decided per call.
        layout = (self._path, *call, weight, bias)
        kept = self._plans.get(layout)
        if kept is None:
            # The layout includes the buffers: one replaced since construction is checked here.
            KV_BUFFERS.check((state[2], state[5], state[4], weight, bias, state[3], *self._dims))
            # The call's own arguments first: deciding the way reads hidden's sizes.
            cache_loc = call.cache_loc if isinstance(call, PoolCall) else None
            PROJECTION.plan((weight, hidden, call.positions, cache_loc), _checked)
            way = dispatch_way(
                self._path, call, state, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                neox=self.rope_style == "neox",
            )  # fmt: skip
        else:
            way = kept.way
        # GEMM + kernel checks the GEMM's output; the others check a stand-in for kv, before any GEMM runs.
        kv = self._gemm(hidden, state) if way == "gemm" else self._stand_in(hidden, kept)
        call = type(call)(kv, *call[1:])
        written: tuple[Tensor | Sequence[Tensor] | None, ...]
        names: tuple[str, ...]
        if isinstance(call, DenseCall):
            written, names = (call.k_out, call.v_out), ("k_out", "v_out")
        else:
            written = (call.k_pool, call.v_pool, *call.written_scales.values())
            names = ("k_pool", "v_pool", *call.written_scales)
        if kept is None:
            # The op's production check, as the public function runs it.
            plan = path.layout(call)
            apart = None
            if any(w is not None for w in written):
                apart = Footprint(
                    ("hidden", "kv_weight", "kv_bias", *names), frozenset(names),
                    (None if way == "gemm" else hidden, weight, bias, *written), each_other=False,
                )  # fmt: skip
            kept = self._plans.keep(layout, _Kept(plan, None if way == "gemm" else kv, Launches(), way, apart))
        if kept.apart is not None:
            kept.apart.check((hidden, weight, bias, *written))
        if way == "fused":
            return path.project(call, hidden, weight, bias, kept.plan, kept.launches)
        if way == "split":
            gemms = functools.partial(self._split_gemm, hidden, weight)
            return project_kv_split(cast(DenseCall, call), gemms, kept.plan, kept.launches)
        # Right after the GEMM: a plain launch (`typedkv.core.launcher.KernelLaunch`).
        return path.planned(call, kept.plan, True)

    if TYPE_CHECKING:
        # nn.Module.__call__ is untyped (it runs hooks, then forward): to a type
        # checker a call is forward itself, arguments and result checked.
        __call__ = forward

    def extra_repr(self) -> str:
        return (
            f"num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"hidden_size={self.hidden_size}, rope_style={self.rope_style!r}"
        )

    def _stand_in(self, hidden: Tensor, kept: _Kept | None) -> Tensor:
        """kv's place in the op's checks: ``[T, L, 2*H*D]``, hidden's dtype and device (see `stand_in`).

        The one kept with the layout's plan, else a new one: a view of a row of its own (never read),
        not of the weights, so that a replaced weight buffer is not kept alive with the plan.
        """
        if kept is not None and kept.stand_in is not None:
            return kept.stand_in
        width = 2 * self.num_kv_heads * self.head_dim
        row = torch.empty(width, dtype=hidden.dtype, device=hidden.device)
        return stand_in(row, hidden.shape[0], self.num_layers, width)

    def _state(self) -> State:
        """``(kv_weight, kv_bias, k_norm_weight, eps, cos_sin_cache, v_norm_weight)``, eagerly read without
        nn.Module's attribute lookup."""
        if torch.compiler.is_compiling():
            return self.kv_weight, self.kv_bias, self.k_norm_weight, self.eps, self.cos_sin_cache, self.v_norm_weight
        buffers = self._buffers
        eps = buffers["eps"] if "eps" in buffers else self.__dict__["eps"]
        return (
            cast(Tensor, buffers["kv_weight"]), buffers["kv_bias"], buffers["k_norm_weight"], cast("float | Tensor", eps),
            cast(Tensor, buffers["cos_sin_cache"]), buffers["v_norm_weight"],
        )  # fmt: skip

    def _gemm(self, hidden: Tensor, state: State) -> Tensor:
        """``[T, L, 2*H*D]``, eagerly: every layer's K/V projection of ``hidden``, one GEMM into the workspace.

        The caller has checked the call (`PROJECTION`, for a layout not seen before).
        """
        return project(self._rows, hidden, state[0], state[1], (self.num_layers, 2 * self.num_kv_heads * self.head_dim))

    def _split_gemm(self, hidden: Tensor, weight: Tensor, v_rows: Tensor) -> Tensor:
        """V's rows ``[L, T, H*D]`` of every layer into ``v_rows``, K's into the workspace, returned (`split_gemm`).

        The call was checked (`typedkv.projection.fused.project_kv_split` calls it).
        """
        k_rows = self._rows.rows(hidden.shape[0], weight).view(-1)[: v_rows.numel()].view(v_rows.shape)
        split_gemm(hidden, weight, k_rows, v_rows)
        return k_rows

    def _traced_projection(self, hidden: Tensor) -> Tensor:
        """``[T, L, 2*H*D]`` under ``torch.compile``: one GEMM, its output the graph's (the op then checks the call)."""
        # The workspace is state a compiled graph must not bake in; the graph plans its own buffers.
        kv = F.linear(hidden, self.kv_weight, self.kv_bias)
        return kv.view(hidden.shape[0], self.num_layers, 2 * self.num_kv_heads * self.head_dim)

    @property
    def _workspace(self) -> Tensor | None:
        """The eager GEMM's output buffer (None before the first eager call)."""
        return self._rows.buffer


def _checked(bound: Bound, args: object) -> bool:
    return True
