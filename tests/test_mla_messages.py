"""The exact text of every ``InputError`` the MLA ops raise, in production and debug mode alike.

As tests/test_messages.py for the K/V ops. One geometry: ``T=5`` tokens, ``L=3``
layers, latent ``C=32``, rope part ``R=16``, ``P=40`` positions, ``S=10`` pool
slots, ckv in bfloat16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv

T, L, C, R, P, S = 5, 3, 32, 16, 40, 10
BF16 = torch.bfloat16
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]


def _base() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "ckv": torch.randn(T, L, C + R, generator=g).to(BF16),
        "kv_norm_weight": torch.ones(L, C),
        "eps": 1e-6,
        "cos_sin_cache": torch.randn(P, R, generator=g),
        "positions": torch.arange(T),
        "rope_style": "gptj",
    }


def dense(**overrides: Any) -> Tensor:
    args = {**_base(), **overrides}
    return typedkv.materialize_mla_kv(
        args.pop("ckv"), args.pop("kv_norm_weight"), args.pop("eps"), args.pop("cos_sin_cache"),
        args.pop("positions"), **args,
    )  # fmt: skip


def into_pool(**overrides: Any) -> None:
    args = {**_base(), "cache_loc": torch.arange(T), "kv_pool": torch.zeros(L, S, C + R, dtype=BF16), **overrides}
    typedkv.materialize_mla_kv_into_pool(
        args.pop("ckv"), args.pop("kv_norm_weight"), args.pop("eps"), args.pop("cos_sin_cache"),
        args.pop("positions"), args.pop("cache_loc"), args.pop("kv_pool"), **args,
    )  # fmt: skip


def _layers(*widths: int, dtype: torch.dtype = BF16) -> list[Tensor]:
    return [torch.zeros(S, w, dtype=dtype)[:, : C + R] for w in widths]


DENSE_CASES: list[tuple[dict[str, Any], str]] = [
    (
        {"out": torch.empty(T, L, C + R, dtype=BF16)},
        "out: expected shape (L=3, T=5, C+R=48), got (5, 3, 48): dims 0 and 1 look swapped; "
        "allocate layers first: torch.empty(3, 5, 48, dtype=ckv.dtype, device=ckv.device)",
    ),
    (
        {"out": torch.empty(L, T, C + R, dtype=torch.float16)},
        "out: expected dtype bfloat16 on cpu (ckv's dtype and device), got dtype float16 on cpu: "
        "allocate it as torch.empty(3, 5, 48, dtype=ckv.dtype, device=ckv.device), or pass out=None",
    ),
    (
        {"kv_norm_weight": torch.ones(L + 1, C)},
        "kv_norm_weight: expected shape (L=3, C), got (4, 32): L=3 comes from ckv",
    ),
    (
        {"kv_norm_weight": torch.ones(L, C + 8)},
        "ckv: expected shape (T=5, L=3, C+R=56), got (5, 3, 48): the size must be C+R = 40+16 = 56; "
        "C=40 comes from kv_norm_weight, R=16 from cos_sin_cache",
    ),
    (
        {"cos_sin_cache": torch.randn(P, 64)},
        "ckv: expected shape (T=5, L=3, C+R=96), got (5, 3, 48): the size must be C+R = 32+64 = 96; "
        "C=32 comes from kv_norm_weight, R=64 from cos_sin_cache",
    ),
    (
        {"cos_sin_cache": torch.randn(P, 64), "kv_norm_weight": None},
        "ckv: expected shape (T=5, L=3, C+R), got (5, 3, 48): the size must be C+R with C >= 0, at least 64; "
        "R=64 comes from cos_sin_cache",
    ),
    (
        {"cos_sin_cache": torch.randn(P, 15), "kv_norm_weight": None},
        "cos_sin_cache: the rotary dim R must be even and at least 2, got R=15",
    ),
    (
        {"cos_sin_cache": torch.randn(P, 0), "kv_norm_weight": None},
        "cos_sin_cache: the rotary dim R must be even and at least 2, got R=0",
    ),
    ({"positions": torch.arange(T + 1)}, "positions: expected shape (T=5), got (6,): T=5 comes from ckv"),
    (
        {"positions": torch.arange(T).float()},
        "positions: expected dtype int32 or int64, got float32: pass positions.long()",
    ),
    ({"eps": torch.ones(L + 1)}, "eps: expected shape (L=3), got (4,): L=3 comes from ckv"),
    ({"eps": [1e-6] * (L + 1)}, "eps: expected L=3 per-layer numbers, got 4"),
    ({"eps": [1e-6, "1e-6", 1e-6]}, "eps[1]: expected a float or an int, got str"),
    ({"rope_style": "rope"}, "rope_style: expected 'neox' or 'gptj', got 'rope'"),
    (
        {"ckv": torch.randn(T, L, C + R, dtype=torch.float64)},
        "ckv: expected dtype bfloat16, float16 or float32, got float64: convert it with ckv.to(torch.bfloat16)",
    ),
    (
        {"ckv": torch.randn(T, L, 2 * (C + R)).to(BF16)[..., ::2]},
        "ckv: the last dim must be contiguous (stride 1), got strides (288, 96, 2): pass ckv.contiguous()",
    ),
]

POOL_CASES: list[tuple[dict[str, Any], str]] = [
    ({"cache_loc": torch.arange(T + 2)}, "cache_loc: expected shape (T=5), got (7,): T=5 comes from ckv"),
    (
        {"cache_loc": torch.arange(T).float()},
        "cache_loc: expected dtype int32 or int64, got float32: pass cache_loc.long()",
    ),
    (
        {"kv_pool": torch.zeros(L, S, C, dtype=BF16)},
        "kv_pool: expected shape (L=3, S, C+R=48), got (3, 10, 32): the size must be C+R = 32+16 = 48; "
        "C=32 comes from kv_norm_weight, R=16 from cos_sin_cache",
    ),
    (
        {"kv_pool": torch.zeros(L, S, C, dtype=BF16), "kv_norm_weight": None},
        "kv_pool: expected shape (L=3, S, C+R=48), got (3, 10, 32): the size must be C+R = 32+16 = 48; "
        "C=32 is ckv's width less R=16 from cos_sin_cache",
    ),
    (
        {"kv_pool": torch.zeros(L + 1, S, C + R, dtype=BF16)},
        "kv_pool: expected shape (L=3, S, C+R=48), got (4, 10, 48): L=3 comes from ckv",
    ),
    ({"kv_pool": _layers(*[C + R] * (L + 1))}, "kv_pool: expected L=3 per-layer tensors, got 4"),
    (
        {"kv_pool": torch.zeros(S, L, C + R, dtype=BF16)},
        "kv_pool: expected shape (L=3, S, C+R=48), got (10, 3, 48): dims 0 and 1 look swapped; allocate layers first",
    ),
    (
        {"kv_pool": torch.zeros(L, S, C + R, dtype=torch.float16)},
        "kv_pool: expected dtype bfloat16 (ckv's), float8_e4m3fn or float8_e5m2, got float16: "
        "allocate the pool with dtype=ckv.dtype or an FP8 dtype",
    ),
    (
        {"kv_pool": _layers(*[C + R] * L, dtype=torch.float16)},
        "kv_pool[0]: expected dtype bfloat16 (ckv's), float8_e4m3fn or float8_e5m2, got float16: "
        "allocate the pool with dtype=ckv.dtype or an FP8 dtype",
    ),
    (
        {"kv_pool": torch.zeros(L, S, C + R, dtype=torch.uint8)},
        "kv_pool: expected dtype bfloat16 (ckv's), float8_e4m3fn or float8_e5m2, got uint8: "
        "an FP8 cache kept as bytes can be passed as kv_pool.view(torch.float8_e4m3fn)",
    ),
    (
        {"kv_pool": torch.zeros(L, 4, 2, 2, C + R, dtype=BF16)},
        "kv_pool: expected shape (L=3, S, C+R=48) or (L=3, N, B, C+R=48) for cache_format='plain', got (3, 4, 2, 2, 48): "
        "an MLA pool holds one row of C+R per slot, with no head dim (sglang's [S, 1, C+R] is pages of one slot)",
    ),
    (
        {"kv_pool": [torch.zeros(4, 2, 2, C + R, dtype=BF16) for _ in range(L)]},
        "kv_pool[0]: expected shape (S, C+R=48) or (N, B, C+R=48) for cache_format='plain', got (4, 2, 2, 48): "
        "an MLA pool holds one row of C+R per slot, with no head dim (sglang's [S, 1, C+R] is pages of one slot)",
    ),
    (
        {"kv_pool": [torch.zeros(S, C + R, dtype=BF16)] * L},
        "kv_pool[1]: expected memory of its own, got the same memory as kv_pool[0]",
    ),
    (
        {"kv_pool": [*_layers(C + R), torch.zeros(S, C + R, dtype=torch.float8_e4m3fn), *_layers(C + R)]},
        "kv_pool[1]: expected dtype bfloat16 (kv_pool[0]'s), got float8_e4m3fn: every layer's pool shares one dtype",
    ),
    (
        {"kv_pool": _layers(C + R, C + R + 8, C + R)},
        "kv_pool[1]: expected strides (48, 1) (kv_pool[0]'s), got (56, 1): per-layer pools must share one layout",
    ),
    ({"kv_scale": 0.5}, "kv_scale: expected None for a bfloat16 pool (scales are for FP8 pools), got 0.5"),
    (
        {"kv_pool": torch.zeros(L, S, C + R, dtype=torch.float8_e4m3fn), "kv_scale": torch.ones(L + 1)},
        "kv_scale: expected shape (L=3), got (4,): L=3 comes from ckv",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 2 * (C + R), dtype=BF16)[..., ::2]},
        "kv_pool: the last dim must be contiguous (stride 1), got strides (960, 96, 2): "
        "allocate it with a contiguous last dim (kv_pool.contiguous() would write into a copy)",
    ),
]


def ds_into_pool(**overrides: Any) -> None:
    """A ``cache_format="fp8_ds_mla"`` call: DeepSeek's geometry, C = 512 and R = 64, into rows of 656 bytes."""
    g = torch.Generator().manual_seed(1)
    args = {
        "ckv": torch.randn(T, L, 512 + 64, generator=g).to(BF16),
        "kv_norm_weight": torch.ones(L, 512),
        "eps": 1e-6,
        "cos_sin_cache": torch.randn(P, 64, generator=g),
        "positions": torch.arange(T),
        "cache_loc": torch.arange(T),
        "kv_pool": torch.zeros(L, S, 656, dtype=torch.uint8),
        "rope_style": "gptj",
        "cache_format": "fp8_ds_mla",
        **overrides,
    }
    typedkv.materialize_mla_kv_into_pool(
        args.pop("ckv"), args.pop("kv_norm_weight"), args.pop("eps"), args.pop("cos_sin_cache"),
        args.pop("positions"), args.pop("cache_loc"), args.pop("kv_pool"), **args,
    )  # fmt: skip


_DS_ALIGNED = "each row holds float32 scales and bfloat16 rope values, written on 4-byte boundaries"

DS_POOL_CASES: list[tuple[dict[str, Any], str]] = [
    ({"cache_format": "fp8"}, "cache_format: expected 'plain' or 'fp8_ds_mla', got 'fp8'"),
    (
        {"kv_scale": 0.5},
        "kv_scale: expected None for cache_format='fp8_ds_mla', got 0.5: each row holds its own scales, "
        "one per 128 latent values",
    ),
    (
        {"kv_scale": torch.ones(L)},
        "kv_scale: expected None for cache_format='fp8_ds_mla', got a tensor of shape (3,): each row holds its own "
        "scales, one per 128 latent values",
    ),
    (
        {"kv_norm_weight": torch.ones(L, 448), "ckv": torch.zeros(T, L, 448 + 64, dtype=BF16)},
        "cache_format: expected C=512 and R=64 for 'fp8_ds_mla', got C=448 (from kv_norm_weight) and R=64 "
        "(from cos_sin_cache): DeepSeek's FP8 rows hold that geometry only; other widths take cache_format='plain'",
    ),
    (
        {"kv_norm_weight": None, "ckv": torch.zeros(T, L, C + R, dtype=BF16), "cos_sin_cache": torch.zeros(P, R)},
        "cache_format: expected C=512 and R=64 for 'fp8_ds_mla', got C=32 (ckv's width less R) and R=16 "
        "(from cos_sin_cache): DeepSeek's FP8 rows hold that geometry only; other widths take cache_format='plain'",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 576, dtype=torch.uint8)},
        "kv_pool: expected shape (L=3, S, 656), got (3, 10, 576): an fp8_ds_mla row is 656 bytes: 512 "
        "float8_e4m3fn latent values, 4 float32 scales (one per 128 values), 64 bfloat16 rope values",
    ),
    (
        {"kv_pool": [torch.zeros(4, 4, 576, dtype=torch.uint8) for _ in range(L)]},
        "kv_pool[0]: expected shape (N, B, 656), got (4, 4, 576): an fp8_ds_mla row is 656 bytes: 512 "
        "float8_e4m3fn latent values, 4 float32 scales (one per 128 values), 64 bfloat16 rope values",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 656, dtype=torch.float8_e4m3fn)},
        "kv_pool: expected dtype uint8, got float8_e4m3fn: an fp8_ds_mla pool holds bytes: "
        "pass kv_pool.view(torch.uint8), the same bytes",
    ),
    (
        {"kv_pool": [torch.zeros(S, 1, 656, dtype=BF16) for _ in range(L)]},
        "kv_pool[0]: expected dtype uint8, got bfloat16: an fp8_ds_mla pool holds bytes: "
        "allocate it with dtype=torch.uint8, 656 bytes a row",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 576, dtype=BF16)},
        "kv_pool: expected shape (L=3, S, 656) for cache_format='fp8_ds_mla', got (3, 10, 576): "
        "that is a plain pool [L, S, C+R]: pass cache_format='plain'",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 656, dtype=torch.uint8), "cache_format": "plain"},
        "kv_pool: expected dtype bfloat16 (ckv's), float8_e4m3fn or float8_e5m2, got uint8: "
        "rows of 656 bytes are DeepSeek's FP8 rows: pass cache_format='fp8_ds_mla'",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 657, dtype=torch.uint8)[..., :656]},
        f"kv_pool: expected strides that are multiples of 4 for cache_format='fp8_ds_mla', got (6570, 657, 1): "
        f"{_DS_ALIGNED}",
    ),
    (
        {"kv_pool": torch.zeros(L, S, 658, dtype=torch.uint8)[..., 2:]},
        f"kv_pool: expected strides that are multiples of 4 for cache_format='fp8_ds_mla', got (6580, 658, 1): "
        f"{_DS_ALIGNED}",
    ),
    (
        {"kv_pool": list(torch.zeros(L * S * 656 + 2, dtype=torch.uint8)[2:].view(L, S, 656))},
        "kv_pool[0]: expected memory starting on a 4-byte boundary for cache_format='fp8_ds_mla', got an address "
        f"2 bytes past one: {_DS_ALIGNED}",
    ),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("overrides", "message"), DS_POOL_CASES)
def test_fp8_ds_mla_messages(overrides: dict[str, Any], message: str, mode: str) -> None:
    """cache_format="fp8_ds_mla": every refusal before anything is written."""
    pool = overrides.get("kv_pool")
    layers = [pool] if isinstance(pool, Tensor) else pool or []
    before = [t.clone() for t in layers]
    with pytest.raises(typedkv.InputError) as err:
        ds_into_pool(**overrides)
    assert str(err.value) == message
    assert all(a.view(torch.uint8).equal(b.view(torch.uint8)) for a, b in zip(layers, before, strict=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("overrides", "message"), DENSE_CASES)
def test_materialize_mla_kv_messages(overrides: dict[str, Any], message: str, mode: str) -> None:
    with pytest.raises(typedkv.InputError) as err:
        dense(**overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("overrides", "message"), POOL_CASES)
def test_materialize_mla_kv_into_pool_messages(overrides: dict[str, Any], message: str, mode: str) -> None:
    pool = overrides.get("kv_pool")
    before = [t.clone() for t in pool] if isinstance(pool, list) else None if pool is None else pool.clone()
    with pytest.raises(typedkv.InputError) as err:
        into_pool(**overrides)
    assert str(err.value) == message
    # Rejected before anything is written.
    if isinstance(pool, list) and before is not None:
        assert all(a.float().equal(b.float()) for a, b in zip(pool, before, strict=True))
    elif isinstance(pool, Tensor) and isinstance(before, Tensor):
        assert pool.float().equal(before.float())


@pytest.mark.parametrize(("call", "dims"), [(dense, {}), (into_pool, {})])
def test_debug_rejects_positions_outside_the_cache(call: Any, dims: dict[str, Any]) -> None:
    with pytest.raises(typedkv.InputError) as err:
        call(positions=torch.tensor([3, 0, 40, 7, 12]))
    assert (
        str(err.value)
        == "positions: expected values in [0, P=40), got 40 at token 2: extend cos_sin_cache to cover every position"
    )


def test_rope_style_is_required() -> None:
    args = _base()
    del args["rope_style"]
    with pytest.raises(TypeError, match="rope_style"):
        typedkv.materialize_mla_kv(*args.values())  # type: ignore[call-arg]


def test_zero_layers_and_tokens() -> None:
    """T == 0 and L == 0 are valid: outputs of the right shape, nothing launched."""
    out = dense(ckv=torch.zeros(0, L, C + R, dtype=BF16), positions=torch.zeros(0, dtype=torch.int64))
    assert out.shape == (L, 0, C + R)
    out = dense(ckv=torch.zeros(T, 0, C + R, dtype=BF16), kv_norm_weight=torch.ones(0, C), eps=torch.ones(0))
    assert out.shape == (0, T, C + R)
    into_pool(ckv=torch.zeros(T, 0, C + R, dtype=BF16), kv_norm_weight=None, kv_pool=[])
