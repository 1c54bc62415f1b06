"""docs/mla.md against the code: each engine snippet writes exactly materialize_mla_kv's rows at the slots it names."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv

PAGE = Path(__file__).resolve().parents[1] / "docs" / "mla.md"
_FENCE = re.compile(r'^```python title="([^"]*)"[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)

# Each snippet's pool, and the row of slot s of layer l in it.
_SLOTS: dict[str, tuple[str, Callable[[Any, int, int], Tensor]]] = {
    "vLLM: one [num_blocks, block_size, C+R] cache per layer": (
        "slot_mapping",
        lambda ns, layer, s: ns["kv_caches"][layer][s // ns["block_size"], s % ns["block_size"]],
    ),
    "sglang: one [size, 1, C+R] buffer per layer": ("out_cache_loc", lambda ns, layer, s: ns["kv_buffer"][layer][s, 0]),
}


def titled_blocks() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _FENCE.finditer(PAGE.read_text())}


_DS_TITLE = "vLLM: fp8_ds_mla caches of the draft's layers"


def test_every_snippet_is_run() -> None:
    assert set(titled_blocks()) == {*_SLOTS, _DS_TITLE}


def test_fp8_ds_mla_snippet() -> None:
    """The fp8_ds_mla snippet writes vLLM's rows of materialize_mla_kv's (tests/test_mla_fp8_ds.py) at its slots."""
    from test_mla_fp8_ds import vllm_ds_mla_rows

    gen = torch.Generator().manual_seed(5)
    L, C, R, P, T, N, B = 2, 512, 64, 64, 6, 3, 4
    angles = torch.rand(P, R // 2, generator=gen) * 6.2
    ckv = torch.randn(T, L, C + R, generator=gen).to(torch.bfloat16)
    slot_mapping = torch.randperm(N * B, generator=gen)[:T]
    slot_mapping[2] = -1  # padding: not written
    namespace: dict[str, Any] = {
        "torch": torch, "typedkv": typedkv, "num_layers": L, "num_blocks": N, "block_size": B, "device": "cpu",
        "ckv": ckv, "kv_norm_weight": torch.rand(L, C, generator=gen) + 0.5, "eps": 1e-6,
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1),
        "positions": torch.randint(0, P, (T,), generator=gen), "slot_mapping": slot_mapping,
    }  # fmt: skip
    rows = typedkv.materialize_mla_kv(
        ckv, namespace["kv_norm_weight"], 1e-6, namespace["cos_sin_cache"], namespace["positions"], rope_style="gptj"
    )
    exec(compile(titled_blocks()[_DS_TITLE], f"{PAGE}:{_DS_TITLE}", "exec"), namespace)
    slots = slot_mapping.tolist()
    for layer in range(L):
        want = vllm_ds_mla_rows(rows[layer, :, :C], rows[layer, :, C:])
        cache = namespace["kv_caches"][layer].view(N * B, 656)
        for slot in range(N * B):
            assert cache[slot].equal(want[slots.index(slot)]) if slot in slots else not cache[slot].any(), slot


@pytest.mark.parametrize("title", list(_SLOTS))
def test_engine_snippet(title: str) -> None:
    slots_name, row = _SLOTS[title]
    gen = torch.Generator().manual_seed(len(title))
    L, C, R, P, T, N, B = 3, 32, 16, 64, 9, 5, 4
    angles = torch.rand(P, R // 2, generator=gen) * 6.2
    ckv = torch.randn(T, L, C + R, generator=gen).to(torch.bfloat16)
    cache_loc = torch.randperm(N * B, generator=gen)[:T]
    cache_loc[2] = -1  # padding: not written
    namespace: dict[str, Any] = {
        "torch": torch, "typedkv": typedkv, "num_layers": L, "kv_lora_rank": C, "rope_dim": R,
        "num_blocks": N, "block_size": B, "size": N * B, "page_size": 1, "dtype": torch.bfloat16, "device": "cpu",
        "ckv": ckv, "kv_norm_weight": torch.rand(L, C, generator=gen) + 0.5, "eps": 1e-6,
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1),
        "positions": torch.randint(0, P, (T,), generator=gen), slots_name: cache_loc,
    }  # fmt: skip
    want = typedkv.materialize_mla_kv(
        ckv, namespace["kv_norm_weight"], 1e-6, namespace["cos_sin_cache"], namespace["positions"], rope_style="gptj"
    )
    exec(compile(titled_blocks()[title], f"{PAGE}:{title}", "exec"), namespace)
    slots = cache_loc.tolist()
    for layer in range(L):
        for slot in range(N * B):
            got = row(namespace, layer, slot)
            if slot in slots:
                assert torch.equal(got, want[layer, slots.index(slot)]), (layer, slot)
            else:
                assert not got.any(), f"slot {slot} of layer {layer} was written"
