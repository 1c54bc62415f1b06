"""A dry run on the meta device (a model built under ``torch.device("meta")`` to check its shapes): every
public call takes tensors with no values there, as it does on a real device -- shapes, dtypes and numbers
checked, outputs of the right shapes returned, nothing to write into pools -- and a misuse is still the
`InputError` a real device gets.

Meta tensors have no memory (each storage's address is 0), so the check that outputs lie apart from the
inputs (`typedkv.core.memory`) takes no part there: it would see every pair of tensors overlap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_tensor_kinds import CALLS, MODES, D, H, L, T

import typedkv

META = torch.device("meta")
# cos_sin_cache_from_hf compares the two tables' halves: it refuses meta tensors (docs/errors.md).
DRY_RUNS = [name for name in CALLS if name != "cos_sin_cache_from_hf"]


def on_meta(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return value.to(META)
    if isinstance(value, list):
        return [on_meta(v) for v in value]
    return value


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DRY_RUNS)
def test_every_call_takes_meta_tensors(name: str, mode: str) -> None:
    make, call = CALLS[name]
    args = {key: on_meta(value) for key, value in make().items()}
    result = call(args)
    if name in ("materialize_kv", "KVMaterializer"):
        k, v = result
        assert k.is_meta and v.is_meta and k.shape == v.shape == (L, T, H, D)
    for value in args.values():
        pools = value if isinstance(value, list) else [value]
        assert all(not isinstance(p, torch.Tensor) or p.is_meta for p in pools)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["materialize_kv_into_pool", "per-layer pools", "KVMaterializer.into_pool"])
def test_a_misuse_on_meta_is_refused(name: str, mode: str) -> None:
    make, call = CALLS[name]
    args = {key: on_meta(value) for key, value in make().items()}
    args["cache_loc"] = args["cache_loc"][:-1]
    with pytest.raises(typedkv.InputError, match="cache_loc"):
        call(args)
