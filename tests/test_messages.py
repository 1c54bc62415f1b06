"""Error messages are API: the exact text of every ``InputError`` the public ops raise.

Like jaxtyping's ``test_messages.py``: a change of wording is a change of the
public surface and must show up here. Every shape/dtype/device/layout message is
checked in both modes -- production (the cheap check) must reject the same misuse
with the same words as debug -- and the value checks (which need a device sync)
in debug mode, with production's documented behaviour beside them.

All cases share one geometry, so the numbers in the texts are: ``T=5`` tokens,
``L=3`` layers, ``H=2`` kv heads, ``D=16`` head dims, ``R=16`` rotary dims,
``P=32`` positions, ``S=10`` pool slots, kv in bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import typedkv

T, L, H, D, R, P, S = 5, 3, 2, 16, 16, 32, 10
BF16 = torch.bfloat16

Overrides = Callable[[], dict[str, Any]]

MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


def _base() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1234)
    angles = torch.rand(P, R // 2, generator=gen) * 6.2
    return {
        "kv": torch.randn(T, L, 2 * H * D, generator=gen).to(BF16),
        "k_norm_weight": torch.rand(L, D, generator=gen) + 0.5,
        "eps": 1e-6,
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1),
        "positions": torch.tensor([3, 0, 31, 7, 12]),
        "num_kv_heads": H,
    }


def dense(**overrides: Any) -> tuple[Tensor, Tensor]:
    args = {**_base(), **overrides}
    return typedkv.materialize_kv(
        args.pop("kv"),
        args.pop("k_norm_weight"),
        args.pop("eps"),
        args.pop("cos_sin_cache"),
        args.pop("positions"),
        **args,
    )


def _pool(dtype: torch.dtype = BF16, shape: tuple[int, ...] = (L, S, H, D)) -> Tensor:
    return torch.full(shape, 0.75).to(dtype)


def into_pool(**overrides: Any) -> None:
    args = {
        **_base(),
        "cache_loc": torch.tensor([4, -1, 0, 9, 2]),
        "k_pool": _pool(),
        "v_pool": _pool(),
        **overrides,
    }
    typedkv.materialize_kv_into_pool(
        args.pop("kv"),
        args.pop("k_norm_weight"),
        args.pop("eps"),
        args.pop("cos_sin_cache"),
        args.pop("positions"),
        args.pop("cache_loc"),
        args.pop("k_pool"),
        args.pop("v_pool"),
        **args,
    )


def _out(dtype: torch.dtype = BF16, shape: tuple[int, ...] = (L, T, H, D), device: str = "cpu") -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


ALLOC = "torch.empty(3, 5, 2, 16, dtype=kv.dtype, device=kv.device)"
# What follows "L=5 comes from kv" (or T) when kv is passed layers first.
KV_SWAPPED = (
    "whose dims 0 and 1 look swapped: kv is [T, L, 2*H*D], tokens before layers; "
    "pass kv.transpose(0, 1) (a view: strides are honoured)"
)


def _same_out() -> dict[str, Any]:
    out = _out()
    return {"k_out": out, "v_out": out}


def _case(overrides: Overrides, message: str, id: str) -> Any:
    return pytest.param(overrides, message, id=id)


# --------------------------------------------------------------------------- materialize_kv


DENSE = [
    # outputs: shape
    _case(
        lambda: {"k_out": _out(shape=(T, L, H, D))},
        "k_out: expected shape (L=3, T=5, H=2, D=16), got (5, 3, 2, 16): dims 0 and 1 look swapped; "
        "allocate layers first: torch.empty(3, 5, 2, 16, dtype=kv.dtype, device=kv.device)",
        "k_out-tokens-first",
    ),
    _case(
        lambda: {"v_out": _out(shape=(T, L, H, D))},
        "v_out: expected shape (L=3, T=5, H=2, D=16), got (5, 3, 2, 16): dims 0 and 1 look swapped; "
        "allocate layers first: torch.empty(3, 5, 2, 16, dtype=kv.dtype, device=kv.device)",
        "v_out-tokens-first",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L, T, D, H))},
        "k_out: expected shape (L=3, T=5, H=2, D=16), got (3, 5, 16, 2): dims 2 and 3 look swapped; "
        f"allocate heads first: {ALLOC}",
        "k_out-head-dims-first",
    ),
    _case(
        lambda: {"k_out": _out(shape=(H, T, L, D))},
        "k_out: expected shape (L=3, T=5, H=2, D=16), got (2, 5, 3, 16): dims 0 and 2 look swapped; "
        f"allocate layers first: {ALLOC}",
        "k_out-heads-first",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L, T + 1, H, D))},
        f"k_out: expected shape (L=3, T=5, H=2, D=16), got (3, 6, 2, 16): T=5 comes from kv; allocate it as {ALLOC}, "
        "or pass k_out=None",
        "k_out-other-T",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L + 1, T + 1, H, D))},
        "k_out: expected shape (L=3, T=5, H=2, D=16), got (4, 6, 2, 16): L=3 comes from kv; T=5 comes from kv; "
        f"allocate it as {ALLOC}, or pass k_out=None",
        "k_out-other-L-and-T",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L, T, H + 1, D))},
        "k_out: expected shape (L=3, T=5, H=2, D=16), got (3, 5, 3, 16): H=2 comes from num_kv_heads; "
        f"allocate it as {ALLOC}, or pass k_out=None",
        "k_out-other-H",
    ),
    _case(
        lambda: {"v_out": _out(shape=(L, T, H, D + 1))},
        "v_out: expected shape (L=3, T=5, H=2, D=16), got (3, 5, 2, 17): D=16 comes from k_norm_weight; "
        f"allocate it as {ALLOC}, or pass v_out=None",
        "v_out-other-D",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L, T, H * D))},
        f"k_out: expected shape (L=3, T=5, H=2, D=16), got (3, 5, 32): allocate it as {ALLOC}, or pass k_out=None",
        "k_out-heads-flattened",
    ),
    # outputs: dtype, device, layout
    _case(
        lambda: {"v_out": _out(torch.float32)},
        "v_out: expected dtype bfloat16 on cpu (kv's dtype and device), got dtype float32 on cpu: "
        f"allocate it as {ALLOC}, or pass v_out=None",
        "v_out-float32",
    ),
    _case(
        lambda: {"k_out": _out(torch.float16)},
        "k_out: expected dtype bfloat16 on cpu (kv's dtype and device), got dtype float16 on cpu: "
        f"allocate it as {ALLOC}, or pass k_out=None",
        "k_out-float16",
    ),
    _case(
        lambda: {"v_out": _out(torch.int32)},
        "v_out: expected dtype bfloat16 on cpu (kv's dtype and device), got dtype int32 on cpu: allocate it "
        "as torch.empty(3, 5, 2, 16, dtype=kv.dtype, device=kv.device), or pass v_out=None",
        "v_out-int32",
    ),
    _case(
        lambda: {"k_out": _out(device="meta")},
        "k_out: expected dtype bfloat16 on cpu (kv's dtype and device), got dtype bfloat16 on meta: "
        f"allocate it as {ALLOC}, or pass k_out=None",
        "k_out-other-device",
    ),
    _case(
        lambda: {"k_out": _out(shape=(L, T, H, 2 * D))[..., ::2]},
        "k_out: the last dim must be contiguous (stride 1), got strides (320, 64, 32, 2): allocate it with a "
        "contiguous last dim (k_out.contiguous() would write into a copy)",
        "k_out-strided-last-dim",
    ),
    _case(
        lambda: {"v_out": _out(shape=(L, T, D, H)).transpose(2, 3)},
        "v_out: the last dim must be contiguous (stride 1), got strides (160, 32, 1, 2): allocate it with a "
        "contiguous last dim (v_out.contiguous() would write into a copy)",
        "v_out-transposed-last-dim",
    ),
    _case(_same_out, "v_out: expected a tensor apart from k_out, got one sharing its memory", "k_out-is-v_out"),
    _case(lambda: {"k_out": [0.0]}, "k_out: expected a torch.Tensor or None, got list", "k_out-list"),
    # kv
    _case(
        lambda: {"num_kv_heads": 4},
        "kv: expected shape (T=5, L=3, 2*H*D=128), got (5, 3, 64): the size must be 2*H*D = 2*4*16 = 128; "
        "64 would fit num_kv_heads=2",
        "kv-last-dim-for-other-H",
    ),
    _case(
        lambda: {"num_kv_heads": 3},
        "kv: expected shape (T=5, L=3, 2*H*D=96), got (5, 3, 64): the size must be 2*H*D = 2*3*16 = 96; "
        "64 would fit num_kv_heads=2",
        "kv-last-dim-for-odd-H",
    ),
    _case(
        lambda: {"kv": torch.randn(T, L, 2 * H * D + 2).to(BF16)},
        "kv: expected shape (T=5, L=3, 2*H*D=64), got (5, 3, 66): the size must be 2*H*D = 2*2*16 = 64",
        "kv-last-dim-fits-no-H",
    ),
    _case(
        lambda: {"kv": torch.randn(T, L * 2 * H * D).to(BF16)},
        "kv: expected shape (T, L, 2*H*D), got (5, 192)",
        "kv-2d",
    ),
    # kv layers first binds T and L the wrong way round; the first argument to disagree names kv as the cause.
    _case(
        lambda: {"kv": torch.randn(L, T, 2 * H * D).to(BF16)},
        f"k_norm_weight: expected shape (L=5, D), got (3, 16): L=5 comes from kv, {KV_SWAPPED}",
        "kv-layers-first",
    ),
    _case(
        lambda: {"kv": torch.randn(L, T, 2 * H * D).to(BF16), "k_norm_weight": None},
        f"positions: expected shape (T=3), got (5,): T=3 comes from kv, {KV_SWAPPED}",
        "kv-layers-first-no-norm",
    ),
    _case(
        lambda: {"kv": torch.randn(L, T, 2 * H * D).to(BF16), "k_norm_weight": None, "eps": [1e-6] * L},
        f"eps: expected L=5 per-layer numbers, got 3: L=5 comes from kv, {KV_SWAPPED}",
        "kv-layers-first-eps-list",
    ),
    _case(
        lambda: {"kv": torch.randn(L, T, 2 * H * D).to(BF16), "k_norm_weight": None, "eps": torch.full((L,), 1e-6)},
        f"eps: expected shape (L=5), got (3,): L=5 comes from kv, {KV_SWAPPED}",
        "kv-layers-first-eps-tensor",
    ),
    _case(
        lambda: {"kv": torch.randn(T, L, 2 * H * D, dtype=torch.float64)},
        "kv: expected dtype bfloat16, float16 or float32, got float64: convert it with kv.to(torch.bfloat16)",
        "kv-float64",
    ),
    _case(
        lambda: {"kv": torch.randn(T, L, 2 * H * D).to(torch.float8_e4m3fn)},
        "kv: expected dtype bfloat16, float16 or float32, got float8_e4m3fn: convert it with kv.to(torch.bfloat16)",
        "kv-fp8",
    ),
    _case(
        lambda: {"kv": torch.randn(T, L, 4 * H * D).to(BF16)[..., ::2]},
        "kv: the last dim must be contiguous (stride 1), got strides (384, 128, 2): pass kv.contiguous()",
        "kv-strided-last-dim",
    ),
    _case(lambda: {"kv": [[0.0]]}, "kv: expected a torch.Tensor, got list", "kv-list"),
    _case(
        lambda: {"kv": torch.randn(T, L, 2 * H * D).to(BF16).to("meta")},
        "k_norm_weight: expected device meta (kv's device), got cpu: move it once, outside the hot loop: "
        "k_norm_weight.to(kv.device)",
        "kv-other-device",
    ),
    # k_norm_weight
    _case(
        lambda: {"k_norm_weight": torch.rand(L + 1, D)},
        "k_norm_weight: expected shape (L=3, D), got (4, 16): L=3 comes from kv",
        "k_norm_weight-other-L",
    ),
    _case(
        lambda: {"k_norm_weight": torch.rand(D)},
        "k_norm_weight: expected shape (L=3, D), got (16,)",
        "k_norm_weight-1d",
    ),
    _case(
        lambda: {"k_norm_weight": torch.ones(L, D, dtype=torch.int64)},
        "k_norm_weight: expected dtype bfloat16, float16, float32 or float64, got int64: "
        "convert it with k_norm_weight.to(torch.float32)",
        "k_norm_weight-int64",
    ),
    _case(
        lambda: {"k_norm_weight": [[1.0]]},
        "k_norm_weight: expected a torch.Tensor or None, got list",
        "k_norm_weight-list",
    ),
    # eps
    _case(
        lambda: {"eps": "1e-6"}, "eps: expected a torch.Tensor, a sequence of L numbers or a float, got str", "eps-str"
    ),
    _case(
        lambda: {"eps": True}, "eps: expected a torch.Tensor, a sequence of L numbers or a float, got bool", "eps-bool"
    ),
    _case(
        lambda: {"eps": None},
        "eps: expected a torch.Tensor, a sequence of L numbers or a float, got NoneType: torch.nn.RMSNorm built without "
        "eps keeps None and uses torch.finfo(x.dtype).eps: pass that number (torch.finfo(kv.dtype).eps), or the model's "
        "configured epsilon (Hugging Face RMSNorm modules keep it as .variance_epsilon)",
        "eps-None",
    ),
    _case(
        lambda: {"eps": "1e-6"}, "eps: expected a torch.Tensor, a sequence of L numbers or a float, got str", "eps-str"
    ),
    _case(
        lambda: {"eps": np.float32(1e-6)},
        "eps: expected a torch.Tensor, a sequence of L numbers or a float, got numpy.float32: pass float(eps)",
        "eps-np-float32",
    ),
    _case(
        lambda: {"eps": torch.full((L + 1,), 1e-6)},
        "eps: expected shape (L=3), got (4,): L=3 comes from kv",
        "eps-other-L",
    ),
    _case(
        lambda: {"eps": torch.ones(L, dtype=torch.int32)},
        "eps: expected dtype bfloat16, float16, float32 or float64, got int32: convert it with eps.to(torch.float32)",
        "eps-int32-tensor",
    ),
    # cos_sin_cache
    _case(
        lambda: {"cos_sin_cache": torch.rand(P, 15)},
        "cos_sin_cache: the rotary dim R must be even and 2 <= R <= D, got D=16, R=15",
        "rotary-dim-odd",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.rand(P, 2 * D)},
        "cos_sin_cache: the rotary dim R must be even and 2 <= R <= D, got D=16, R=32: Hugging Face cos and sin "
        "tables side by side? build the cache with typedkv.cos_sin_cache_from_hf(cos, sin)",
        "rotary-dim-above-D",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.rand(P, 0)},
        "cos_sin_cache: the rotary dim R must be even and 2 <= R <= D, got D=16, R=0",
        "rotary-dim-zero",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.rand(R)},
        "cos_sin_cache: expected shape (P, R) or (L=3, P, R), got (16,)",
        "cos_sin_cache-1d",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.ones(P, R, dtype=torch.int64)},
        "cos_sin_cache: expected dtype bfloat16, float16, float32 or float64, got int64: "
        "convert it with cos_sin_cache.to(torch.float32)",
        "cos_sin_cache-int64",
    ),
    # positions
    _case(
        lambda: {"positions": torch.tensor([3.0, 0.0, 31.0, 7.0, 12.0])},
        "positions: expected dtype int32 or int64, got float32: pass positions.long()",
        "positions-float32",
    ),
    _case(
        lambda: {"positions": torch.tensor([3, 0, 31, 7, 12], dtype=torch.int16)},
        "positions: expected dtype int32 or int64, got int16: pass positions.long()",
        "positions-int16",
    ),
    _case(
        lambda: {"positions": torch.tensor([3, 0, 31, 7])},
        "positions: expected shape (T=5), got (4,): T=5 comes from kv",
        "positions-short",
    ),
    _case(
        lambda: {"positions": torch.tensor([[3], [0], [31], [7], [12]])},
        "positions: expected shape (T=5), got (5, 1)",
        "positions-2d",
    ),
    _case(lambda: {"positions": [3, 0, 31, 7, 12]}, "positions: expected a torch.Tensor, got list", "positions-list"),
    _case(
        lambda: {"positions": torch.tensor([3, 0, 31, 7, 12], device="meta")},
        "positions: expected device cpu (kv's device), got meta: move it once, outside the hot loop: "
        "positions.to(kv.device)",
        "positions-other-device",
    ),
    # num_kv_heads
    _case(
        lambda: {"num_kv_heads": 2.0},
        "num_kv_heads: expected an int, got float: a count is an int (// divides to an int, / to a float)",
        "num_kv_heads-float",
    ),
    _case(lambda: {"num_kv_heads": "2"}, "num_kv_heads: expected an int, got str", "num_kv_heads-str"),
    _case(lambda: {"num_kv_heads": True}, "num_kv_heads: expected an int, got bool", "num_kv_heads-bool"),
    _case(
        lambda: {"num_kv_heads": np.int64(2)},
        "num_kv_heads: expected an int, got numpy.int64: pass int(num_kv_heads)",
        "num_kv_heads-np-int64",
    ),
    _case(lambda: {"num_kv_heads": 0}, "num_kv_heads: expected a positive int, got 0", "num_kv_heads-zero"),
    _case(lambda: {"num_kv_heads": -2}, "num_kv_heads: expected a positive int, got -2", "num_kv_heads-negative"),
    # rope_style
    _case(lambda: {"rope_style": "llama"}, "rope_style: expected 'neox' or 'gptj', got 'llama'", "rope_style-unknown"),
    _case(lambda: {"rope_style": "NEOX"}, "rope_style: expected 'neox' or 'gptj', got 'NEOX'", "rope_style-case"),
    _case(lambda: {"rope_style": None}, "rope_style: expected 'neox' or 'gptj', got None", "rope_style-None"),
    # v_norm_weight: [L, D], as K's norm weight
    _case(
        lambda: {"v_norm_weight": torch.ones(L + 1, D)},
        "v_norm_weight: expected shape (L=3, D=16), got (4, 16): L=3 comes from kv",
        "v_norm_weight-extra-layer",
    ),
    _case(
        lambda: {"v_norm_weight": torch.ones(D, L)},
        "v_norm_weight: expected shape (L=3, D=16), got (16, 3): dims 0 and 1 look swapped",
        "v_norm_weight-transposed",
    ),
    _case(
        lambda: {"v_norm_weight": torch.ones(D)},
        "v_norm_weight: expected shape (L=3, D=16), got (16,)",
        "v_norm_weight-one-layer",
    ),
    _case(
        lambda: {"v_norm_weight": torch.ones(L, D, dtype=torch.int64)},
        "v_norm_weight: expected dtype bfloat16, float16, float32 or float64, got int64: "
        "convert it with v_norm_weight.to(torch.float32)",
        "v_norm_weight-int",
    ),
    _case(
        lambda: {"v_norm_weight": torch.ones(L, D, device="meta")},
        "v_norm_weight: expected device cpu (kv's device), got meta: "
        "move it once, outside the hot loop: v_norm_weight.to(kv.device)",
        "v_norm_weight-other-device",
    ),
    # cos_sin_cache: a table per layer, [L, P, R]
    _case(
        lambda: {"cos_sin_cache": torch.randn(L + 1, P, R)},
        "cos_sin_cache: expected shape (L=3, P, R), got (4, 32, 16): L=3 comes from kv",
        "cos_sin_cache-tables-for-other-layers",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.randn(1, L, P, R)},
        "cos_sin_cache: expected shape (P, R) or (L=3, P, R), got (1, 3, 32, 16)",
        "cos_sin_cache-4d",
    ),
    _case(
        lambda: {"cos_sin_cache": torch.randn(L, P, R - 1)},
        "cos_sin_cache: the rotary dim R must be even and 2 <= R <= D, got D=16, R=15",
        "cos_sin_cache-tables-odd-rotary-dim",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("overrides", "message"), DENSE)
def test_materialize_kv_messages(overrides: Overrides, message: str, mode: str) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    with pytest.raises(typedkv.InputError) as excinfo:
        dense(**overrides())
    assert str(excinfo.value) == message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
def test_mla_ckv_layers_first_names_ckv(norm: bool, mode: str) -> None:
    """MLA's ckv is tokens first too: passed layers first, the message names it, not the norm weight."""
    C, R2 = 32, 16  # latent and rope part (tests/test_mla_messages.py has the MLA geometry's other messages)
    ckv = torch.randn(L, T, C + R2).to(BF16)
    weight = torch.ones(L, C) if norm else None
    with pytest.raises(typedkv.InputError) as excinfo:
        typedkv.materialize_mla_kv(ckv, weight, 1e-6, typedkv.cos_sin_cache(P, R2), torch.arange(T), rope_style="gptj")
    swapped = (
        "whose dims 0 and 1 look swapped: ckv is [T, L, C+R], tokens before layers; "
        "pass ckv.transpose(0, 1) (a view: strides are honoured)"
    )
    assert str(excinfo.value) == (
        f"kv_norm_weight: expected shape (L=5, C), got (3, 32): L=5 comes from ckv, {swapped}"
        if norm
        else f"positions: expected shape (T=3), got (5,): T=3 comes from ckv, {swapped}"
    )


# --------------------------------------------------------------------------- materialize_kv_into_pool


def _fp8_pools(**kw: Any) -> dict[str, Any]:
    return {"k_pool": _pool(torch.float8_e4m3fn), "v_pool": _pool(torch.float8_e4m3fn), **kw}


def _written(**kw: Any) -> dict[str, Any]:
    """int8 pools with their scales written per row (float32 ``[L, S, H]``), ``kw`` replacing any of them."""
    scales = {"k_scale_out": torch.zeros(L, S, H), "v_scale_out": torch.zeros(L, S, H)}
    return {"k_pool": _pool(torch.int8), "v_pool": _pool(torch.int8), **scales, **kw}


def _same_scales() -> dict[str, Any]:
    scales = torch.zeros(L, S, H)
    return _written(k_scale_out=scales, v_scale_out=scales)


def _padded_layer() -> Tensor:
    return _pool(shape=(S, H + 1, D))[:, :H]


def _same_pool() -> dict[str, Any]:
    pool = _pool()
    return {"k_pool": pool, "v_pool": pool}


def _same_layers() -> dict[str, Any]:
    layers = list(_pool())
    return {"k_pool": layers, "v_pool": list(layers)}


SAME_DTYPE = "K and V pools share one dtype"

POOL = [
    # k_pool / v_pool shapes
    _case(
        lambda: {"k_pool": _pool(shape=(L, S, H + 1, D))},
        "k_pool: expected shape (L=3, S, H=2, D=16), got (3, 10, 3, 16): H=2 comes from num_kv_heads",
        "k_pool-other-H",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(L, S, H, D + 1))},
        "k_pool: expected shape (L=3, S, H=2, D=16), got (3, 10, 2, 17): D=16 comes from k_norm_weight",
        "k_pool-other-D",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(L + 1, S, H, D))},
        "k_pool: expected shape (L=3, S, H=2, D=16), got (4, 10, 2, 16): L=3 comes from kv",
        "k_pool-other-L",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(S, L, H, D))},
        "k_pool: expected shape (L=3, S, H=2, D=16), got (10, 3, 2, 16): dims 0 and 1 look swapped; allocate "
        "layers first",
        "k_pool-slots-first",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(L, H, S, D))},
        "k_pool: expected shape (L=3, S, H=2, D=16), got (3, 2, 10, 16): dims 1 and 2 look swapped; allocate "
        "slots first",
        "k_pool-heads-before-slots",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(S, H, D))},
        "k_pool: expected shape (L=3, S, H=2, D=16) or (L=3, N, B, H=2, D=16) for kv_layout='NHD', got (10, 2, 16)",
        "k_pool-one-layer",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(L, S, H * D))},
        "k_pool: expected shape (L=3, S, H=2, D=16) or (L=3, N, B, H=2, D=16) for kv_layout='NHD', got (3, 10, 32)",
        "k_pool-heads-flattened",
    ),
    _case(
        lambda: {"v_pool": _pool(shape=(L, S + 1, H, D))},
        "v_pool: expected shape (L=3, S=10, H=2, D=16), got (3, 11, 2, 16): S=10 comes from k_pool",
        "v_pool-other-S",
    ),
    _case(
        lambda: {"v_pool": _pool(shape=(L, S, H + 1, D))},
        "v_pool: expected shape (L=3, S=10, H=2, D=16), got (3, 10, 3, 16): H=2 comes from num_kv_heads",
        "v_pool-other-H",
    ),
    _case(
        lambda: {"num_kv_heads": 4},
        "kv: expected shape (T=5, L=3, 2*H*D=128), got (5, 3, 64): the size must be 2*H*D = 2*4*16 = 128; "
        "64 would fit num_kv_heads=2",
        "num_kv_heads-wrong",
    ),
    _case(
        lambda: {"k_pool": list(_pool(shape=(L, S, H + 1, D))), "v_pool": list(_pool())},
        "k_pool[0]: expected shape (S, H=2, D=16), got (10, 3, 16): H=2 comes from num_kv_heads",
        "k_pool-layer-other-H",
    ),
    _case(
        lambda: {"k_pool": [_pool(shape=(S, H, D)), _pool(shape=(S + 1, H, D)), _pool(shape=(S, H, D))]},
        "k_pool[1]: expected shape (S=10, H=2, D=16), got (11, 2, 16): S=10 comes from k_pool[0]",
        "k_pool-layers-other-S",
    ),
    _case(
        # A 4-dim layer is a paged [N, B, H, D] pool (one page of 10 slots); V's layers are not paged.
        lambda: {"k_pool": list(_pool(shape=(L, 1, S, H, D))), "v_pool": list(_pool())},
        "v_pool: expected k_pool's layout [N, B, H, D], got [S, H, D]: K and V pools are paged alike",
        "k_pool-paged-v_pool-not",
    ),
    _case(
        lambda: {"k_pool": _pool(shape=(L, S, H, 2 * D))[..., ::2]},
        "k_pool: the last dim must be contiguous (stride 1), got strides (640, 64, 32, 2): allocate it with a"
        " contiguous last dim (k_pool.contiguous() would write into a copy)",
        "k_pool-strided-last-dim",
    ),
    _case(
        lambda: {"k_pool": list(_pool(shape=(L, S, H, 2 * D))[..., ::2]), "v_pool": list(_pool())},
        "k_pool[0]: the last dim must be contiguous (stride 1), got strides (64, 32, 2): allocate it with a "
        "contiguous last dim (k_pool[0].contiguous() would write into a copy)",
        "k_pool-layer-strided-last-dim",
    ),
    # layout kinds, non-tensors
    _case(
        lambda: {"v_pool": list(_pool())},
        "v_pool: expected the same layout as k_pool (a stacked tensor), got list",
        "v_pool-list-k_pool-stacked",
    ),
    _case(
        lambda: {"k_pool": list(_pool())},
        "v_pool: expected the same layout as k_pool (a sequence of per-layer tensors), got Tensor",
        "v_pool-stacked-k_pool-list",
    ),
    _case(
        lambda: {"k_pool": None},
        "k_pool: expected a torch.Tensor or a sequence of L torch.Tensors, got NoneType",
        "k_pool-None",
    ),
    _case(
        lambda: {"v_pool": {}},
        "v_pool: expected a torch.Tensor or a sequence of L torch.Tensors, got dict",
        "v_pool-dict",
    ),
    _case(
        lambda: {"k_pool": [_pool(shape=(S, H, D)), None, _pool(shape=(S, H, D))], "v_pool": list(_pool())},
        "k_pool[1]: expected a torch.Tensor, got NoneType",
        "k_pool-layer-None",
    ),
    # per-layer sequences
    _case(
        lambda: {"k_pool": list(_pool())[:2], "v_pool": list(_pool())},
        "k_pool: expected L=3 per-layer tensors, got 2",
        "k_pool-short-list",
    ),
    _case(
        lambda: {"k_pool": list(_pool()), "v_pool": [*_pool(), _pool(shape=(S, H, D))]},
        "v_pool: expected L=3 per-layer tensors, got 4",
        "v_pool-long-list",
    ),
    _case(
        lambda: {"k_pool": [], "v_pool": []},
        "k_pool: expected L=3 per-layer tensors, got 0",
        "k_pool-empty-list",
    ),
    _case(
        lambda: {"k_pool": [_pool(shape=(S, H, D)), _padded_layer(), _pool(shape=(S, H, D))], "v_pool": list(_pool())},
        "k_pool[1]: expected strides (32, 16, 1) (k_pool[0]'s), got (48, 16, 1): per-layer pools must share one layout",
        "k_pool-layer-strides-differ",
    ),
    _case(
        lambda: {"k_pool": list(_pool()), "v_pool": [_pool(shape=(S, H, D)), _pool(shape=(S, H, D)), _padded_layer()]},
        "v_pool[2]: expected strides (32, 16, 1) (v_pool[0]'s), got (48, 16, 1): per-layer pools must share one layout",
        "v_pool-layer-strides-differ",
    ),
    # dtypes
    _case(
        lambda: {"k_pool": _pool(torch.float16), "v_pool": _pool(torch.float16)},
        "k_pool: expected dtype bfloat16 (kv's), float8_e4m3fn, float8_e5m2 or int8, got float16: allocate the"
        " pool with dtype=kv.dtype, an FP8 dtype, or int8 with its scales written",
        "pool-float16-for-bfloat16-kv",
    ),
    _case(
        lambda: {"k_pool": list(_pool(torch.float32)), "v_pool": list(_pool(torch.float32))},
        "k_pool[0]: expected dtype bfloat16 (kv's), float8_e4m3fn, float8_e5m2 or int8, got float32: allocate the"
        " pool with dtype=kv.dtype, an FP8 dtype, or int8 with its scales written",
        "per-layer-pool-float32-for-bfloat16-kv",
    ),
    _case(
        lambda: {"k_pool": _pool(torch.float64), "v_pool": _pool(torch.float64)},
        "k_pool: expected dtype bfloat16 (kv's), float8_e4m3fn, float8_e5m2 or int8, got float64: allocate the"
        " pool with dtype=kv.dtype, an FP8 dtype, or int8 with its scales written",
        "pool-float64",
    ),
    _case(
        lambda: {"k_pool": _pool(torch.uint8), "v_pool": _pool(torch.uint8)},
        "k_pool: expected dtype bfloat16 (kv's), float8_e4m3fn, float8_e5m2 or int8, got uint8: an FP8 "
        "cache kept as bytes can be passed as k_pool.view(torch.float8_e4m3fn)",
        "pool-uint8",
    ),
    _case(
        lambda: {"v_pool": _pool(torch.float8_e4m3fn)},
        "v_pool: expected dtype bfloat16 (k_pool's), got float8_e4m3fn: every K and V pool tensor shares one dtype",
        "v_pool-fp8-k_pool-bfloat16",
    ),
    _case(
        lambda: {"k_pool": _pool(torch.float8_e4m3fn), "v_pool": _pool(torch.float8_e5m2)},
        "v_pool: expected dtype float8_e4m3fn (k_pool's), got float8_e5m2: every K and V pool tensor shares one dtype",
        "v_pool-e5m2-k_pool-e4m3fn",
    ),
    _case(
        lambda: {
            "k_pool": [_pool(shape=(S, H, D)), _pool(torch.float16, (S, H, D)), _pool(shape=(S, H, D))],
            "v_pool": list(_pool()),
        },
        "k_pool[1]: expected dtype bfloat16 (kv's), float8_e4m3fn, float8_e5m2 or int8, got float16: allocate the "
        "pool with dtype=kv.dtype, an FP8 dtype, or int8 with its scales written",
        "k_pool-layers-dtypes-differ",
    ),
    _case(
        lambda: {
            "k_pool": list(_pool()),
            "v_pool": [_pool(shape=(S, H, D)), _pool(torch.float8_e4m3fn, (S, H, D)), _pool(shape=(S, H, D))],
        },
        "v_pool[1]: expected dtype bfloat16 (k_pool[0]'s), got float8_e4m3fn: every K and V pool tensor "
        "shares one dtype",
        "v_pool-layer-dtype-differs",
    ),
    # scales
    _case(
        lambda: {"k_scale": 0.5},
        "k_scale: expected None for a bfloat16 pool (scales are for FP8 pools), got 0.5",
        "k_scale-for-bfloat16-pool",
    ),
    _case(
        lambda: {"v_scale": torch.ones(L)},
        "v_scale: expected None for a bfloat16 pool (scales are for FP8 pools), got a tensor of shape (3,)",
        "v_scale-for-bfloat16-pool",
    ),
    _case(
        lambda: _fp8_pools(k_scale=torch.ones(L + 1)),
        "k_scale: expected shape (L=3), got (4,): L=3 comes from kv",
        "k_scale-other-L",
    ),
    _case(lambda: _fp8_pools(v_scale=torch.tensor(0.5)), "v_scale: expected shape (L=3), got ()", "v_scale-0d"),
    _case(
        lambda: _fp8_pools(v_scale=torch.ones(L, dtype=torch.int32)),
        "v_scale: expected dtype bfloat16, float16, float32 or float64, got int32: "
        "convert it with v_scale.to(torch.float32)",
        "v_scale-int32-tensor",
    ),
    _case(lambda: _fp8_pools(k_scale="2"), "k_scale: expected a torch.Tensor, a float or None, got str", "k_scale-str"),
    _case(
        lambda: _fp8_pools(v_scale=torch.ones(L, device="meta")),
        "v_scale: expected device cpu (kv's device), got meta: move it once, outside the hot loop: "
        "v_scale.to(kv.device)",
        "v_scale-other-device",
    ),
    # scales written per row
    _case(
        lambda: _written(k_pool=_pool(), v_pool=_pool()),
        "k_scale_out: expected None for a bfloat16 pool (scales are written for FP8 and int8 pools), got a tensor "
        "of shape (3, 10, 2)",
        "k_scale_out-for-bfloat16-pool",
    ),
    _case(
        lambda: _written(k_scale_out=None, v_scale_out=None),
        "k_scale_out: expected a tensor to write K's scales into for an int8 pool, got None: an int8 pool holds row "
        "/ scale, with a scale per (token, layer, head) that the call computes: pass k_scale_out and v_scale_out, "
        "float32, shaped like the pools without their last dim",
        "int8-pool-without-scales",
    ),
    _case(
        lambda: _written(v_scale_out=None),
        "v_scale_out: expected a tensor beside k_scale_out, got None: K's and V's scales are written together (pass "
        "both, or neither)",
        "v_scale_out-missing",
    ),
    _case(
        lambda: _written(k_pool=_pool(torch.float8_e5m2), v_pool=_pool(torch.float8_e5m2), k_scale=2.0),
        "k_scale: expected None beside k_scale_out, got 2.0: the call computes each row's scale and writes it into "
        "k_scale_out; pass scales to apply or tensors to write them into, not both",
        "k_scale-beside-k_scale_out",
    ),
    _case(
        lambda: _written(v_scale_out=torch.zeros(L, S, H, dtype=torch.float16)),
        "v_scale_out: expected dtype float32, got float16: allocate it with one of these dtypes",
        "v_scale_out-float16",
    ),
    _case(
        lambda: _written(k_scale_out=torch.zeros(L, S, H, D)),
        "k_scale_out: expected shape (L=3, S=10, H=2), got (3, 10, 2, 16): one element per row of k_pool, its shape "
        "without the last dim",
        "k_scale_out-with-head-dim",
    ),
    _case(
        lambda: _written(k_scale_out=list(torch.zeros(L, S, H))),
        "k_scale_out: expected the same layout as k_pool (a stacked tensor), got list",
        "k_scale_out-list-beside-stacked-pool",
    ),
    _case(
        lambda: _written(v_scale_out=torch.zeros(L, S, H, device="meta")),
        "v_scale_out: expected device cpu (kv's device), got meta: allocate it on kv.device",
        "v_scale_out-other-device",
    ),
    _case(
        _same_scales,
        "v_scale_out: expected memory apart from k_scale_out, got the same tensor",
        "v_scale_out-is-k_scale_out",
    ),
    # cache_loc
    _case(
        lambda: {"cache_loc": torch.tensor([4.0, -1.0, 0.0, 9.0, 2.0])},
        "cache_loc: expected dtype int32 or int64, got float32: pass cache_loc.long()",
        "cache_loc-float32",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 0, 9, 2], dtype=torch.int16)},
        "cache_loc: expected dtype int32 or int64, got int16: pass cache_loc.long()",
        "cache_loc-int16",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 0, 9])},
        "cache_loc: expected shape (T=5), got (4,): T=5 comes from kv",
        "cache_loc-short",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([[4, -1, 0, 9, 2]])},
        "cache_loc: expected shape (T=5), got (1, 5)",
        "cache_loc-2d",
    ),
    _case(lambda: {"cache_loc": [4, -1, 0, 9, 2]}, "cache_loc: expected a torch.Tensor, got list", "cache_loc-list"),
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 0, 9, 2], device="meta")},
        "cache_loc: expected device cpu (kv's device), got meta: move it once, outside the hot loop: "
        "cache_loc.to(kv.device)",
        "cache_loc-other-device",
    ),
    # aliasing, devices
    _case(_same_pool, "v_pool: expected memory apart from k_pool, got the same tensor", "k_pool-is-v_pool"),
    _case(
        _same_layers, "v_pool[0]: expected memory of its own, got the same memory as k_pool[0]", "same-layer-tensors"
    ),
    _case(
        lambda: {"k_pool": _pool().to("meta")},
        "k_pool: expected device cpu (kv's device), got meta: allocate it on kv.device",
        "k_pool-other-device",
    ),
    _case(
        lambda: {"k_pool": list(_pool().to("meta")), "v_pool": list(_pool())},
        "k_pool[0]: expected device cpu (kv's device), got meta: allocate it on kv.device",
        "k_pool-layer-other-device",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("overrides", "message"), POOL)
def test_materialize_kv_into_pool_messages(overrides: Overrides, message: str, mode: str) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    with pytest.raises(typedkv.InputError) as excinfo:
        into_pool(**overrides())
    assert str(excinfo.value) == message


_SHARED = {"kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "num_kv_heads", "rope_style", "v_norm_weight"}
# Where the pool op says something else, and why.
# (Nothing now: the inputs, kv among them, are checked before the pools they are written to.)
_POOL_SAYS: dict[str, str] = {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(case.values[0], _POOL_SAYS.get(case.id, case.values[1]), id=case.id)
        for case in DENSE
        if set(case.values[0]()) <= _SHARED
    ],
)
def test_shared_arguments_read_the_same_in_both_ops(overrides: Overrides, message: str, mode: str) -> None:
    """An argument both ops take is rejected in the same words by both."""
    with pytest.raises(typedkv.InputError) as excinfo:
        into_pool(**overrides())
    assert str(excinfo.value) == message


# --------------------------------------------------------------------------- value checks (debug)


VALUES_DENSE = [
    _case(
        lambda: {"positions": torch.tensor([3, 0, 32, 7, 12])},
        "positions: expected values in [0, P=32), got 32 at token 2: extend cos_sin_cache to cover every position",
        "position-at-P",
    ),
    _case(
        lambda: {"positions": torch.tensor([3, 400, 32, 7, 12], dtype=torch.int32)},
        "positions: expected values in [0, P=32), got 400 at token 1: extend cos_sin_cache to cover every position",
        "position-far-past-P",
    ),
    _case(
        lambda: {"positions": torch.tensor([3, 0, 31, -1, 12])},
        "positions: expected values in [0, P=32), got -1 at token 3: positions are never negative",
        "position-negative",
    ),
]

VALUES_POOL = [
    *VALUES_DENSE,
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 10, 9, 2])},
        "cache_loc: expected slots below S=10 (or negative to skip), got 10 at token 2",
        "slot-at-S",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 0, 2**40, 12])},
        "cache_loc: expected slots below S=10 (or negative to skip), got 1099511627776 at token 3",
        "slot-far-past-S",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([4, -1, 4, 9, 2], dtype=torch.int32)},
        "cache_loc: expected distinct slots, got slot 4 for tokens [0, 2]: two tokens written to one slot race",
        "slot-twice",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([9, 2, 2, 9, 9])},
        "cache_loc: expected distinct slots, got slot 2 for tokens [1, 2]: two tokens written to one slot race",
        "slots-several-times",
    ),
    _case(
        lambda: {"cache_loc": torch.tensor([0, -1, -1, -1, -1]), "k_pool": _pool(shape=(L, 0, H, D))},
        "cache_loc: expected slots below S=0 (or negative to skip), got 0 at token 0",
        "empty-pool",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), VALUES_DENSE)
def test_materialize_kv_value_messages(overrides: Overrides, message: str) -> None:
    assert typedkv.debug_enabled()
    with pytest.raises(typedkv.InputError) as excinfo:
        dense(**overrides())
    assert str(excinfo.value) == message


@pytest.mark.parametrize(("overrides", "message"), VALUES_POOL)
def test_materialize_kv_into_pool_value_messages(overrides: Overrides, message: str) -> None:
    assert typedkv.debug_enabled()
    kwargs = {"k_pool": _pool(), "v_pool": _pool(), **overrides()}
    if kwargs["k_pool"].shape[1] == 0:
        kwargs["v_pool"] = _pool(shape=(L, 0, H, D))
    with pytest.raises(typedkv.InputError) as excinfo:
        into_pool(**kwargs)
    assert str(excinfo.value) == message


@pytest.mark.production
@pytest.mark.parametrize(("overrides", "message"), VALUES_POOL[3:])
def test_production_does_not_check_slot_values(overrides: Overrides, message: str) -> None:
    """Production skips the value checks (they need a device sync); the kernel stays in bounds."""
    kwargs = {"k_pool": _pool(), "v_pool": _pool(), **overrides()}
    if kwargs["k_pool"].shape[1] == 0:
        kwargs["v_pool"] = _pool(shape=(L, 0, H, D))
    into_pool(**kwargs)


@pytest.mark.production
@pytest.mark.parametrize(("overrides", "message"), VALUES_DENSE)
def test_production_does_not_check_positions(overrides: Overrides, message: str) -> None:
    """A position outside [0, P) gives NaN in that token's K instead of an error."""
    positions = overrides()["positions"]
    k, v = dense(positions=positions)
    bad = (positions < 0) | (positions >= P)
    assert bool(k[:, bad].isnan().all()) and not bool(k[:, ~bad].isnan().any())
    assert not bool(v.isnan().any())


# --------------------------------------------------------------------------- the error type


def test_input_error_is_a_value_error_and_a_type_error() -> None:
    assert issubclass(typedkv.InputError, ValueError)
    assert issubclass(typedkv.InputError, TypeError)
    with pytest.raises(ValueError, match=r"^positions: expected dtype int32 or int64, got float32"):
        dense(positions=torch.zeros(T))
    with pytest.raises(TypeError, match=r"^num_kv_heads: expected an int, got float: "):
        dense(num_kv_heads=2.0)


def test_every_message_names_its_argument_first() -> None:
    names = {
        "kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "num_kv_heads", "rope_style", "v_norm_weight",
        "k_out", "v_out", "cache_loc", "k_pool", "v_pool", "k_scale", "v_scale", "k_scale_out", "v_scale_out",
    }  # fmt: skip
    for case in DENSE + POOL + VALUES_POOL:
        _, message = case.values
        head = message.split(":", 1)[0]
        assert head.split("[", 1)[0] in names, message


# --------------------------------------------------------------------------- nothing written on rejection


def _poisoned(shape: tuple[int, ...] = (L, T, H, D)) -> Tensor:
    return torch.randn(shape).to(BF16)


REJECTED_WITH_OUTPUTS = [
    pytest.param(lambda: {"v_out": _out(torch.float32)}, id="v_out-wrong-dtype"),
    pytest.param(lambda: {"v_out": _out(shape=(T, L, H, D))}, id="v_out-tokens-first"),
    pytest.param(lambda: {"v_out": _out(shape=(L, T, H, 2 * D))[..., ::2]}, id="v_out-strided"),
    pytest.param(lambda: {"positions": torch.tensor([3.0, 0.0, 1.0, 7.0, 12.0])}, id="positions-float"),
    pytest.param(lambda: {"rope_style": "llama"}, id="rope_style-unknown"),
    pytest.param(lambda: {"cos_sin_cache": torch.rand(P, 2 * D)}, id="rotary-dim-above-D"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overrides", REJECTED_WITH_OUTPUTS)
def test_rejected_call_leaves_outputs_untouched(overrides: Overrides, mode: str) -> None:
    k_out = _poisoned()
    v_out = _poisoned()
    before_k, before_v = k_out.clone(), v_out.clone()
    kwargs = {"k_out": k_out, "v_out": v_out, **overrides()}
    with pytest.raises(typedkv.InputError):
        dense(**kwargs)
    assert torch.equal(k_out.view(torch.int16), before_k.view(torch.int16))
    assert torch.equal(v_out.view(torch.int16), before_v.view(torch.int16))


def test_out_of_range_position_leaves_outputs_untouched() -> None:
    """Debug mode's value check comes before any write too."""
    k_out, v_out = _poisoned(), _poisoned()
    before_k, before_v = k_out.clone(), v_out.clone()
    with pytest.raises(typedkv.InputError, match=r"^positions: expected values in \[0, P=32\)"):
        dense(positions=torch.tensor([3, 0, 32, 7, 12]), k_out=k_out, v_out=v_out)
    assert torch.equal(k_out.view(torch.int16), before_k.view(torch.int16))
    assert torch.equal(v_out.view(torch.int16), before_v.view(torch.int16))


@pytest.mark.parametrize("mode", MODES)
def test_same_tensor_for_both_outputs_is_left_untouched(mode: str) -> None:
    # A good call first: the per-layout check cache must not skip the per-call aliasing check.
    dense(k_out=_poisoned(), v_out=_poisoned())
    out = _poisoned()
    before = out.clone()
    with pytest.raises(typedkv.InputError, match=r"^v_out: expected a tensor apart from k_out"):
        dense(k_out=out, v_out=out)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


# --------------------------------------------------------------------------- devices (needs CUDA)


@pytest.mark.gpu
def test_device_messages_on_cuda() -> None:
    cuda = torch.device("cuda", 0)
    base = _base()
    with pytest.raises(typedkv.InputError) as excinfo:
        dense(kv=base["kv"].to(cuda))
    assert str(excinfo.value) == (
        "k_norm_weight: expected device cuda:0 (kv's device), got cpu: move it once, outside the hot loop: "
        "k_norm_weight.to(kv.device)"
    )
    on_cuda = {name: value.to(cuda) for name, value in base.items() if isinstance(value, Tensor)}
    with pytest.raises(typedkv.InputError) as excinfo:
        dense(**{**on_cuda, "positions": base["positions"]})
    assert str(excinfo.value) == (
        "positions: expected device cuda:0 (kv's device), got cpu: move it once, outside the hot loop: "
        "positions.to(kv.device)"
    )
    with pytest.raises(typedkv.InputError) as excinfo:
        dense(**on_cuda, k_out=_out())
    assert str(excinfo.value) == (
        "k_out: expected dtype bfloat16 on cuda:0 (kv's dtype and device), got dtype bfloat16 on cpu: "
        f"allocate it as {ALLOC}, or pass k_out=None"
    )
    with pytest.raises(typedkv.InputError) as excinfo:
        into_pool(**on_cuda, cache_loc=torch.tensor([4, -1, 0, 9, 2], device=cuda), v_pool=_pool().to(cuda))
    assert str(excinfo.value) == "k_pool: expected device cuda:0 (kv's device), got cpu: allocate it on kv.device"
