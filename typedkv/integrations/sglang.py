"""sglang's DFlash KV materialization, served by typedkv.

`FusedKVMaterializeHelper` takes the constructor and ``materialize`` call of
sglang's helper of the same name (``sglang.kernels.ops.speculative.fused_kv_materialize``),
so a DFlash worker switches by changing one import. It builds one
`typedkv.KVMaterializer` from the draft layers, and adds
`FusedKVMaterializeHelper.materialize_into_pool`: every draft layer written
straight into sglang's token pool in one launch.

sglang is not imported: its objects are read by the attributes sglang 0.5.23
gives them (a layer's ``self_attn.qkv_proj.weight``, ``self_attn.k_norm``, the
rotary module's ``cos_sin_cache``; a pool's ``k_buffer`` / ``v_buffer`` lists).
What typedkv cannot serve is a `typedkv.InputError` naming the attribute, raised
where sglang's worker already catches errors and falls back to its per-layer path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import typedkv
from typedkv.integrations.sglang_objects import (
    F32,
    attribute,
    integer,
    is_integer,
    layer_scales,
    number,
    one_per_token,
    projection_rows,
    read_layer_id,
)

__all__ = ["FusedKVMaterializeHelper"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# sglang's pool layouts typedkv writes: token rows [S, H, D], or pages [N, H, B, D] (SGLANG_USE_HND_KVCACHE).
_POOL_LAYOUTS: dict[str, typedkv.KVLayout] = {"nhd": "NHD", "hnd": "HND"}


class FusedKVMaterializeHelper:
    """sglang's DFlash ``FusedKVMaterializeHelper``, computed by one typedkv launch.

    Built once from the draft layers. `materialize` keeps sglang's contract
    (dense K/V handed to a per-layer callback); `materialize_into_pool` writes
    every layer straight into sglang's token pool instead.

    Parameters
    ----------
    layers : sequence of L sglang decoder layers
        Each is read through ``layer.self_attn``: ``qkv_proj.weight``
        ``[q_size + 2*kv_size, hidden]`` (its K then V rows, after ``q_size``,
        are the layer's projection) and ``qkv_proj.bias`` when present,
        ``k_norm.weight`` ``[head_dim]`` and ``k_norm.variance_epsilon``,
        ``num_kv_heads``, ``head_dim``, ``q_size``, ``kv_size``, ``rotary_emb``,
        and for the pool path ``attn.layer_id``, ``attn.k_scale``, ``attn.v_scale``.
    rotary_emb : sglang rotary embedding module
        Read for ``cos_sin_cache`` ``[P, rotary_dim]`` (cos then sin),
        ``rotary_dim`` (default ``head_dim``) and ``is_neox_style`` (default
        True; False is GPT-J RoPE, which typedkv serves too).
    num_kv_heads : int
        ``H``, the KV heads of every layer (on this rank).
    head_dim : int
        ``D``, every layer's head dim.
    device : torch.device or str
        Where the weights, the RoPE table and every call's tensors live.
    max_position_hint : int, optional
        The number of positions calls will use. The RoPE table is extended to
        cover it once, here (through the rotary module's own
        ``_ensure_cos_sin_cache_length``), as sglang's helper does. Without it,
        `materialize` reads the largest position of each call (a device sync,
        as sglang's helper does) and `materialize_into_pool` uses the table as it is.

    Raises
    ------
    typedkv.InputError
        For a layer typedkv cannot serve, naming the layer and attribute: a
        quantized projection (``quant_method`` other than sglang's unquantized
        one, or a weight that is not float16/bfloat16/float32), a bias that
        cannot be sliced like the weight, a Gemma-style or biased K norm, a value
        scale (``self_attn.v_scale``), a layer whose heads, head dim, RoPE or
        weight dtypes differ from the others', an attribute that is not a
        number, an eps that is negative or not finite, or an FP8 scale (``attn.k_scale`` /
        ``attn.v_scale``) that is not a positive number in float32's normal
        range (tensor scales are read with one device sync, here).

    Notes
    -----
    Numerics are typedkv's: V is the projection output bit for bit; K is
    RMSNorm rounded to the weights' dtype, then RoPE (as the unfused model path
    computes it), where sglang's kernel rounds once after RoPE. The two K differ
    by at most a few units in the last place (docs/sglang.md).

    Examples
    --------
    Stand-ins carrying only the attributes the helper reads play sglang's layer
    and rotary module here (one layer, 2 query and 2 KV heads of 16, hidden 24):

    >>> from types import SimpleNamespace as Stub
    >>> from typedkv.integrations.sglang import FusedKVMaterializeHelper
    >>> rope = Stub(cos_sin_cache=typedkv.cos_sin_cache(64, 16))
    >>> attn = Stub(num_kv_heads=2, head_dim=16, q_size=32, kv_size=32, rotary_emb=rope, attn=Stub(layer_id=0),
    ...             qkv_proj=Stub(weight=torch.randn(96, 24)),  # q rows, then K, then V
    ...             k_norm=Stub(weight=torch.ones(16), variance_epsilon=1e-6))
    >>> helper = FusedKVMaterializeHelper([Stub(self_attn=attn)], rope, num_kv_heads=2, head_dim=16, device="cpu")
    >>> helper.materialize(torch.randn(3, 24), torch.arange(3), lambda i, k, v: print(i, k.shape, v.shape))
    0 torch.Size([3, 2, 16]) torch.Size([3, 2, 16])
    """

    def __init__(
        self,
        layers: Sequence[Any],
        rotary_emb: Any,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        max_position_hint: int | None = None,
    ) -> None:
        """Read and stack the draft layers' weights once; the parameters are the class's."""
        if len(layers) == 0:
            raise typedkv.InputError("layers: expected at least one draft layer, got none")
        self.num_kv_heads = integer(num_kv_heads, "num_kv_heads")
        self.head_dim = integer(head_dim, "head_dim")
        self.n_layers = len(layers)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise typedkv.InputError(
                f"device: expected a torch.device or a device string ('cuda:0'), got {device!r}"
            ) from None
        self.rotary_emb = rotary_emb
        self.rotary_dim = integer(getattr(rotary_emb, "rotary_dim", self.head_dim), "rotary_emb.rotary_dim")
        self.is_neox_style = bool(getattr(rotary_emb, "is_neox_style", True))
        # sglang's convention: a hint of n positions means positions up to n - 1.
        self.max_position_hint = (
            None if max_position_hint is None else max(integer(max_position_hint, "max_position_hint") - 1, 0)
        )
        self._layers = list(layers)
        weights: list[Tensor] = []
        biases: list[Tensor | None] = []
        norms: list[Tensor] = []
        eps: list[float] = []
        for i, layer in enumerate(self._layers):
            weight, bias, norm, layer_eps = self._read_layer(i, layer)
            weights.append(weight)
            biases.append(bias)
            norms.append(norm)
            eps.append(layer_eps)
        # Stacking layers of mixed dtypes would promote them all (to float32) without a word. (Each bias
        # has its own weight's dtype, checked per layer.)
        for attr, tensors, why in (
            ("qkv_proj.weight", weights, "projects every draft layer in one GEMM"),
            ("k_norm.weight", norms, "stacks every draft layer's K norm"),
        ):
            for i, tensor in enumerate(tensors):
                if tensor.dtype != tensors[0].dtype:
                    raise typedkv.InputError(
                        f"layers[{i}].self_attn.{attr}: expected dtype {tensors[0].dtype} (layer 0's), "
                        f"got {tensor.dtype}: the fused path {why}"
                    )
        for i, bias in enumerate(biases):
            if (bias is None) != (biases[0] is None):
                want, got = ("None", "a bias") if biases[0] is None else ("a bias", "None")
                raise typedkv.InputError(
                    f"layers[{i}].self_attn.qkv_proj.bias: expected {want} (as layer 0), got {got}: "
                    "every draft layer has a bias or none does"
                )
        # Stacked here, once: KVMaterializer takes a contiguous stacked weight as it is.
        self._kv_weight = torch.stack(weights).contiguous()
        self._kv_bias = None if biases[0] is None else torch.stack([b for b in biases if b is not None])
        self._k_norm_weight = torch.stack(norms).contiguous()
        self._eps = eps
        self._k_scale, self._v_scale = layer_scales(self._layers, self.device)
        self._layer_ids = [read_layer_id(i, layer) for i, layer in enumerate(self._layers)]
        self._cos_sin_source: Tensor | None = None
        self._materializer: typedkv.KVMaterializer | None = None
        self._pool_views: tuple[tuple[object, ...], list[Tensor], list[Tensor]] | None = None
        self._ensure_rope_cache(self.max_position_hint)
        self._materializer_for_table()

    def materialize(
        self,
        ctx_hidden: Tensor,
        positions: Tensor,
        write_layer_kv: Callable[[int, Tensor, Tensor], None],
    ) -> None:
        """Every layer's K and V for ``ctx_hidden``, handed to ``write_layer_kv`` layer by layer.

        sglang's contract: ``write_layer_kv(i, k, v)`` once per layer ``i`` in
        order, with ``k`` and ``v`` ``[T, H, D]`` in the weights' dtype (the
        callback may modify them in place). ``T == 0`` calls nothing.

        Parameters
        ----------
        ctx_hidden : Tensor, shape ``[T, hidden]``, float dtype
            Moved to the helper's device and cast to the weights' dtype if needed.
        positions : Tensor, shape ``[T]`` (or any shape of ``T`` elements), any integer dtype
            Each token's position; reshaped to ``[T]`` and cast to int64 on the
            device if needed.
        write_layer_kv : callable ``(int, Tensor [T, H, D], Tensor [T, H, D]) -> None``
            Called once per layer with its index, K and V, in the weights' dtype
            (float16, bfloat16 or float32).

        Raises
        ------
        typedkv.InputError
            For ``ctx_hidden`` other than ``[T, hidden]``, positions of a
            non-integer dtype or a count other than ``T``, or any shape misuse.
        """
        if isinstance(ctx_hidden, Tensor) and ctx_hidden.ndim > 0 and ctx_hidden.shape[0] == 0:
            return  # before any argument handling, as sglang's helper
        ctx_hidden, positions = self._call_inputs(ctx_hidden, positions)
        if self.max_position_hint is None:
            # As sglang's helper: the table must cover this call's largest position (one device sync).
            self._ensure_rope_cache(int(positions.max().item()))
        k, v = self._materializer_for_table()(ctx_hidden, positions)
        for i in range(self.n_layers):
            write_layer_kv(i, k[i], v[i])

    def materialize_into_pool(
        self,
        ctx_hidden: Tensor,
        positions: Tensor,
        cache_loc: Tensor,
        token_to_kv_pool: Any,
    ) -> None:
        """Every layer's K and V for ``ctx_hidden``, written straight into sglang's token pool.

        What ``materialize`` followed by the pool's ``set_kv_buffer`` at
        ``cache_loc`` stores, in one launch for all layers: no dense K/V, no
        per-layer loop, no device sync, so it can be captured in a CUDA graph.
        Layer ``i`` goes to the pool's buffers of ``layers[i].self_attn.attn.layer_id``
        (minus the pool's ``start_layer``). FP8 pools (kept as uint8) store
        ``K / k_scale`` and ``V / v_scale``, each layer's ``attn.k_scale`` /
        ``attn.v_scale`` (1 when None), saturated.

        Parameters
        ----------
        ctx_hidden, positions
            As in `materialize`.
        cache_loc : Tensor, shape ``[T]`` (or any shape of ``T`` elements), int32 | int64
            Each token's pool slot (sglang's ``out_cache_loc``); a negative slot
            skips the token.
        token_to_kv_pool : sglang ``MHATokenToKVPool``
            Read for ``k_buffer`` / ``v_buffer`` (per-layer ``[S, H, D]``, or
            ``[N, H, B, D]`` with ``kv_cache_layout == "hnd"``), ``dtype``,
            ``store_dtype`` and ``start_layer``. Written in place, at the slots
            of ``cache_loc`` only.

        Raises
        ------
        typedkv.InputError
            For a pool without those attributes, a quantized (FP4/MXFP8) or
            other-layout pool, a pool dtype other than the weights' or
            float8_e4m3fn/float8_e5m2, a layer id outside the pool, a
            ``cache_loc`` count other than ``T``, or any misuse `materialize`
            refuses.
        """
        k_pool, v_pool, layout, fp8 = self._pool_of(token_to_kv_pool)
        ctx_hidden, positions = self._call_inputs(ctx_hidden, positions)
        if not isinstance(cache_loc, Tensor):
            raise typedkv.InputError(
                f"cache_loc: expected an int32 or int64 tensor of T={ctx_hidden.shape[0]} slots, "
                f"got {type(cache_loc).__name__}"
            )
        cache_loc = one_per_token("cache_loc", cache_loc, ctx_hidden.shape[0], "slots")
        if ctx_hidden.shape[0] == 0:
            return
        if cache_loc.device != self.device:
            cache_loc = cache_loc.to(self.device, non_blocking=True)
        self._materializer_for_table().into_pool(
            ctx_hidden, positions, cache_loc, k_pool, v_pool,
            k_scale=self._k_scale if fp8 else None, v_scale=self._v_scale if fp8 else None,
            kv_layout=layout,
        )  # fmt: skip

    def _read_layer(self, i: int, layer: Any) -> tuple[Tensor, Tensor | None, Tensor, float]:
        """Layer ``i``'s K/V weight rows ``[2*H*D, hidden]``, bias rows, K norm weight ``[D]`` and eps."""
        name = f"layers[{i}].self_attn"
        attn = attribute(layer, "self_attn", f"layers[{i}]")
        for attr, want in (("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim)):
            value = integer(attribute(attn, attr, name), f"{name}.{attr}")
            if value != want:
                raise typedkv.InputError(
                    f"{name}.{attr}: expected {want} (the helper's {attr}), got {value}: "
                    "the fused path needs every draft layer alike"
                )
        rotary = attribute(attn, "rotary_emb", name)
        rope = (
            integer(getattr(rotary, "rotary_dim", self.head_dim), f"{name}.rotary_emb.rotary_dim"),
            bool(getattr(rotary, "is_neox_style", True)),
        )
        if rope != (self.rotary_dim, self.is_neox_style):
            raise typedkv.InputError(
                f"{name}.rotary_emb: expected rotary_dim={self.rotary_dim}, is_neox_style={self.is_neox_style} "
                f"(rotary_emb's), got rotary_dim={rope[0]}, is_neox_style={rope[1]}"
            )
        value_scale = getattr(attn, "v_scale", None)
        if value_scale is not None:
            raise typedkv.InputError(
                f"{name}.v_scale: expected None, got {value_scale!r}: the fused path stores V as projected; "
                "a draft with an attention value scale takes the per-layer path"
            )
        weight, rows, bias = projection_rows(attn, name, self.num_kv_heads * self.head_dim)
        if bias is not None:
            bias = self._on_device(bias.detach()[rows], f"{name}.qkv_proj.bias")
        norm = attribute(attn, "k_norm", name)
        if type(norm).__name__ == "GemmaRMSNorm" or getattr(norm, "bias", None) is not None:
            raise typedkv.InputError(
                f"{name}.k_norm: expected an RMSNorm (x * weight / rms), got {type(norm).__name__}"
                + (" with a bias" if getattr(norm, "bias", None) is not None else "")
                + ": the fused path computes a plain RMSNorm"
            )
        norm_weight = attribute(norm, "weight", f"{name}.k_norm")
        if not isinstance(norm_weight, Tensor) or norm_weight.shape != (self.head_dim,):
            got = f"shape {tuple(norm_weight.shape)}" if isinstance(norm_weight, Tensor) else repr(norm_weight)
            raise typedkv.InputError(f"{name}.k_norm.weight: expected shape ({self.head_dim},) (head_dim), got {got}")
        where = f"{name}.k_norm.variance_epsilon"
        eps = number(attribute(norm, "variance_epsilon", f"{name}.k_norm"), where)
        if not 0.0 <= eps <= F32.max:
            # typedkv would refuse it too, but as eps[i]: name the attribute sglang's user knows. (The kernel
            # adds eps in float32: a larger finite eps would be infinite there.)
            raise typedkv.InputError(
                f"{where}: expected a number >= 0 within float32's range (at most {F32.max:.3g}), got {eps!r}: "
                "RMSNorm divides by sqrt(mean square + eps)"
            )
        return (
            self._on_device(weight.detach()[rows], f"{name}.qkv_proj.weight"),
            bias,
            self._on_device(norm_weight.detach(), f"{name}.k_norm.weight"),
            eps,
        )

    def _on_device(self, tensor: Tensor, where: str) -> Tensor:
        """``tensor`` on the helper's device, where layers may sit on any devices (stacked after this)."""
        if tensor.is_meta and self.device.type != "meta":
            raise typedkv.InputError(
                f"{where}: expected a tensor with data, got one on the meta device: load the draft's weights "
                f"before building the helper (for {self.device})"
            )
        return tensor.to(self.device)

    def _call_inputs(self, ctx_hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """sglang's argument handling: positions flattened, both on the device, hidden in the weights' dtype."""
        # Checked here, not left to typedkv's call, whose messages would name its own arguments (hidden).
        if not isinstance(ctx_hidden, Tensor) or ctx_hidden.ndim != 2:
            got = f"shape {tuple(ctx_hidden.shape)}" if isinstance(ctx_hidden, Tensor) else type(ctx_hidden).__name__
            raise typedkv.InputError(f"ctx_hidden: expected a 2-dim tensor [T, hidden], got {got}")
        hidden = self._kv_weight.shape[-1]
        if ctx_hidden.shape[1] != hidden:
            raise typedkv.InputError(
                f"ctx_hidden: expected shape (T, hidden={hidden}) (qkv_proj.weight's columns), "
                f"got {tuple(ctx_hidden.shape)}"
            )
        if not isinstance(positions, Tensor) or not is_integer(positions.dtype):
            got = f"dtype {positions.dtype}" if isinstance(positions, Tensor) else type(positions).__name__
            # sglang's helper casts them to int64; a float position would be truncated without a word.
            raise typedkv.InputError(
                f"positions: expected an integer tensor, got {got}: positions index the RoPE table; "
                "a cast would truncate them"
            )
        positions = one_per_token("positions", positions, ctx_hidden.shape[0], "positions")
        if ctx_hidden.device != self.device:
            ctx_hidden = ctx_hidden.to(self.device, non_blocking=True)
        if ctx_hidden.dtype != self._kv_weight.dtype:
            ctx_hidden = ctx_hidden.to(self._kv_weight.dtype)
        if positions.device != self.device or positions.dtype != torch.int64:
            positions = positions.to(device=self.device, dtype=torch.int64, non_blocking=True)
        return ctx_hidden, positions

    def _ensure_rope_cache(self, max_position: int | None) -> None:
        """Extend the rotary module's table to cover ``max_position``, as sglang's helper does."""
        table = getattr(self.rotary_emb, "cos_sin_cache", None)
        if not isinstance(table, Tensor):
            raise typedkv.InputError(
                f"rotary_emb.cos_sin_cache: expected a tensor [P, rotary_dim], got {type(table).__name__}"
            )
        if max_position is None or max_position < table.shape[0]:
            return
        extend = getattr(self.rotary_emb, "_ensure_cos_sin_cache_length", None)
        if callable(extend):
            extend(max_position)
            table = self.rotary_emb.cos_sin_cache
        if max_position >= table.shape[0]:
            raise typedkv.InputError(
                f"rotary_emb.cos_sin_cache: expected at least {max_position + 1} positions "
                f"(max_position_hint or the largest position), got {table.shape[0]}: extend the rotary table"
            )

    def _materializer_for_table(self) -> typedkv.KVMaterializer:
        """The KVMaterializer over the rotary module's current table (rebuilt when sglang replaces it)."""
        table = self.rotary_emb.cos_sin_cache
        if self._materializer is None or table is not self._cos_sin_source:
            self._materializer = typedkv.KVMaterializer(
                self._kv_weight, self._k_norm_weight, self._eps, table.to(self.device),
                num_kv_heads=self.num_kv_heads, rope_style="neox" if self.is_neox_style else "gptj",
                kv_bias=self._kv_bias,
            )  # fmt: skip
            self._cos_sin_source = table
        return self._materializer

    def _pool_of(self, pool: Any) -> tuple[list[Tensor], list[Tensor], typedkv.KVLayout, bool]:
        """The draft layers' K and V buffers of an sglang token pool, as typedkv pools, its layout, and FP8 or not."""
        missing = [a for a in ("k_buffer", "v_buffer", "dtype", "store_dtype", "start_layer") if not hasattr(pool, a)]
        if missing:
            raise typedkv.InputError(
                f"token_to_kv_pool: expected an sglang MHATokenToKVPool (per-layer k_buffer and v_buffer lists, "
                f"dtype, store_dtype, start_layer), got {type(pool).__name__} without {', '.join(missing)}: "
                "use materialize() with the pool's set_kv_buffer"
            )
        if getattr(pool, "is_quantized_kv_cache", False):
            method = getattr(pool, "quant_method", None)
            how = f" (quant_method {type(method).__name__})" if method is not None else ""
            raise typedkv.InputError(
                f"token_to_kv_pool.is_quantized_kv_cache: expected False (an unquantized KV cache), got True{how}: "
                "quantized KV caches store through their own recipe; use materialize() with the pool's set_kv_buffer"
            )
        layout_name = getattr(pool, "kv_cache_layout", "nhd")
        if layout_name not in _POOL_LAYOUTS:
            raise typedkv.InputError(
                f"token_to_kv_pool.kv_cache_layout: expected 'nhd' or 'hnd', got {layout_name!r}: "
                "use materialize() with the pool's set_kv_buffer"
            )
        for attr, want in (("head_num", self.num_kv_heads), ("head_dim", self.head_dim), ("v_head_dim", self.head_dim)):
            value = getattr(pool, attr, want)
            if value != want:
                raise typedkv.InputError(
                    f"token_to_kv_pool.{attr}: expected {want} (the draft layers'), got {value}: "
                    "the pool must hold the draft layers' K and V heads"
                )
        dtype, store_dtype = pool.dtype, pool.store_dtype
        fp8 = dtype in _FP8
        if dtype != self._kv_weight.dtype and not fp8:
            raise typedkv.InputError(
                f"token_to_kv_pool.dtype: expected {self._kv_weight.dtype} (the weights' dtype), "
                f"torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
            )
        key = (pool, pool.k_buffer, pool.v_buffer, *pool.k_buffer, *pool.v_buffer)
        cached = self._pool_views
        if (
            cached is not None
            and len(cached[0]) == len(key)
            and all(a is b for a, b in zip(cached[0], key, strict=True))
        ):
            return cached[1], cached[2], _POOL_LAYOUTS[layout_name], fp8
        start, count = int(pool.start_layer), len(pool.k_buffer)
        k_pool, v_pool = [], []
        for i, layer_id in enumerate(self._layer_ids):
            index = layer_id - start
            if not 0 <= index < count or index >= len(pool.v_buffer):
                raise typedkv.InputError(
                    f"layers[{i}].self_attn.attn.layer_id: expected a layer of token_to_kv_pool "
                    f"(start_layer={start}, {count} layers), got {layer_id}"
                )
            k, v = pool.k_buffer[index], pool.v_buffer[index]
            # FP8 pools keep their bytes as uint8 (store_dtype): the same memory, seen as the FP8 dtype.
            k_pool.append(k.view(dtype) if store_dtype != dtype else k)
            v_pool.append(v.view(dtype) if store_dtype != dtype else v)
        # Holding the pool's buffers (as sglang's pool does) keeps the views valid while they are reused.
        self._pool_views = (key, k_pool, v_pool)
        return k_pool, v_pool, _POOL_LAYOUTS[layout_name], fp8
