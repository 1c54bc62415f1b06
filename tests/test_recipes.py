"""docs/recipes.md against the code: each recipe writes what the draft's own modules compute, and its table of
drafts is the bench's (the same numbers, the same sources).

Every titled Python block runs, in a namespace of small tensors laid out as Hugging Face modules hold them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv.tools import draft_shapes

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
_FENCE = re.compile(r'^```python title="([^"]*)"[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)
L, H, D, HIDDEN, T, S, P = 2, 2, 16, 24, 5, 16, 64


def titled_blocks() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _FENCE.finditer(PAGE.read_text())}


def _linear(gen: torch.Generator, rows: int, width: int, bias: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        weight=torch.randn(rows, width, generator=gen) / width**0.5,
        bias=torch.randn(rows, generator=gen) if bias else None,
    )


def _norm(gen: torch.Generator, width: int, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(weight=(torch.rand(width, generator=gen) + 0.5).to(dtype), variance_epsilon=1e-6)


def _layers(gen: torch.Generator, width: int = HIDDEN, bias: bool = False, count: int = L) -> list[SimpleNamespace]:
    """Qwen3-style layers: ``self_attn`` with ``k_proj``, ``v_proj`` and ``k_norm``."""
    return [
        SimpleNamespace(
            self_attn=SimpleNamespace(
                k_proj=_linear(gen, H * D, width, bias), v_proj=_linear(gen, H * D, width, bias), k_norm=_norm(gen, D)
            )
        )
        for _ in range(count)
    ]


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm in float32, scaled by ``weight`` (float32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _neox(x: Tensor, table: Tensor, positions: Tensor) -> Tensor:
    """``x`` ``[T, H, F]`` float32, its first R dims rotated NeoX-style by the ``[P, R]`` table."""
    half = table.shape[-1] // 2
    cos, sin = table[positions, None, :half], table[positions, None, half:]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def _setup(gen: torch.Generator, width: int = HIDDEN, fp8: bool = False) -> dict[str, Any]:
    """What a KV recipe's namespace holds: the call's tensors, zeroed pools of S slots, one slot skipped."""
    cache_loc = torch.randperm(S, generator=gen)[:T]
    cache_loc[1] = -1
    pool_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    return {
        "torch": torch, "typedkv": typedkv, "num_kv_heads": H, "head_dim": D, "num_layers": L, "max_position": P,
        "cos_sin_cache": typedkv.cos_sin_cache(P, D, 1e6), "hidden": torch.randn(T, width, generator=gen),
        "positions": torch.randint(0, P, (T,), generator=gen), "cache_loc": cache_loc,
        "k_pool": torch.zeros(L, S, H, D).to(pool_dtype), "v_pool": torch.zeros(L, S, H, D).to(pool_dtype),
    }  # fmt: skip


def _check_pools(ns: dict[str, Any], want_k: list[Tensor], want_v: list[Tensor]) -> None:
    """The pools hold each layer's expected K and V at the slots ``cache_loc`` names, and nothing elsewhere."""
    cache_loc = ns["cache_loc"]
    written = [int(s) for s in cache_loc if s >= 0]
    tokens = [t for t, s in enumerate(cache_loc.tolist()) if s >= 0]
    untouched = [s for s in range(S) if s not in written]
    for layer in range(len(want_k)):
        for pool, want in ((ns["k_pool"], want_k[layer]), (ns["v_pool"], want_v[layer])):
            torch.testing.assert_close(pool[layer, written].float(), want[tokens].float(), rtol=1e-5, atol=1e-5)
            assert not pool[layer, untouched].float().any()


def _qwen_style(ns: dict[str, Any], layers: list[SimpleNamespace], x: Tensor, k_weight_of: Any = None) -> None:
    """K = RoPE(RMSNorm(k_proj(x))) (the norm's output stored in x's dtype), V = v_proj(x): what the layers compute."""
    want_k, want_v = [], []
    for layer in layers:
        a = layer.self_attn
        k = torch.nn.functional.linear(x, a.k_proj.weight, a.k_proj.bias).view(-1, H, D)
        v = torch.nn.functional.linear(x, a.v_proj.weight, a.v_proj.bias).view(-1, H, D)
        normed = _rms(k, k_weight_of(a) if k_weight_of else a.k_norm.weight.float(), a.k_norm.variance_epsilon)
        want_k.append(_neox(normed.to(x.dtype).float(), ns["cos_sin_cache"], ns["positions"]))
        want_v.append(v)
    _check_pools(ns, want_k, want_v)


def recipe_dflash(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    layers = _layers(gen)
    ns = {**_setup(gen), "layers": layers}
    return ns, lambda ns: _qwen_style(ns, layers, ns["hidden"])


def recipe_eagle3(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    layers = _layers(gen, width=2 * HIDDEN, count=1)
    ns = {**_setup(gen), "layers": layers}
    ns["k_pool"], ns["v_pool"] = ns["k_pool"][:1].clone(), ns["v_pool"][:1].clone()  # its one layer's cache
    ns["normed_embeds"], ns["normed_hidden"] = (
        torch.randn(T, HIDDEN, generator=gen),
        torch.randn(T, HIDDEN, generator=gen),
    )

    def check(ns: dict[str, Any]) -> None:
        a = layers[0].self_attn
        x = torch.cat((ns["normed_embeds"], ns["normed_hidden"]), dim=-1)
        k = (x @ a.k_proj.weight.t()).view(T, H, D)
        _check_pools(ns, [_neox(k, ns["cos_sin_cache"], ns["positions"])], [(x @ a.v_proj.weight.t()).view(T, H, D)])

    return ns, check


def recipe_bias(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    layers = _layers(gen, bias=True)
    for layer in layers:
        layer.self_attn.k_norm.variance_epsilon = 1e-5  # gpt-oss's rms_norm_eps, which the recipe passes
    ns = {**_setup(gen), "layers": layers}
    return ns, lambda ns: _qwen_style(ns, layers, ns["hidden"])


def recipe_gemma_one_plus_w(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """Gemma's checkpoints keep the norm's weight in bfloat16, centred on zero."""
    layers = _layers(gen)
    for layer in layers:
        # Small values with low bits set: 1 + w rounded to bfloat16 would lose them.
        layer.self_attn.k_norm.weight = (torch.randn(D, generator=gen) * 0.3).to(torch.bfloat16)
    ns = {**_setup(gen), "layers": layers}
    ns["kv_weight"] = torch.stack([torch.cat((a.self_attn.k_proj.weight, a.self_attn.v_proj.weight)) for a in layers])

    def check(ns: dict[str, Any]) -> None:
        ns["m"].into_pool(ns["hidden"], ns["positions"], ns["cache_loc"], ns["k_pool"], ns["v_pool"])
        # Gemma3RMSNorm: output * (1.0 + self.weight.float()).
        _qwen_style(ns, layers, ns["hidden"], k_weight_of=lambda a: 1.0 + a.k_norm.weight.float())

    return ns, check


def recipe_gemma4(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    layers = _layers(gen)
    ns = {**_setup(gen), "layers": layers}

    def check(ns: dict[str, Any]) -> None:
        want_k, want_v = [], []
        for layer in layers:
            k = (ns["hidden"] @ layer.self_attn.k_proj.weight.t()).view(T, H, D)
            normed = _rms(k, layer.self_attn.k_norm.weight, 1e-6)
            want_k.append(_neox(normed, ns["cos_sin_cache"], ns["positions"]))
            want_v.append(_rms(k, torch.ones(D), 1e-6))  # V: the same projection, normed without a scale
        _check_pools(ns, want_k, want_v)
        freqs = ns["cos_sin_cache"][1, : D // 2].acos()
        assert freqs[D // 8 :].eq(0).all() and freqs[: D // 8].gt(0).all()  # a quarter of the frequencies turn

    return ns, check


def _stacked_materializer(gen: torch.Generator, ns: dict[str, Any]) -> tuple[list[SimpleNamespace], Any]:
    layers = _layers(gen)
    weight = torch.stack([torch.cat((a.self_attn.k_proj.weight, a.self_attn.v_proj.weight)) for a in layers])
    norm = torch.stack([a.self_attn.k_norm.weight for a in layers])
    return layers, typedkv.KVMaterializer(weight, norm, 1e-6, ns["cos_sin_cache"], num_kv_heads=H)


def recipe_fp8_scales(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns = _setup(gen, fp8=True)
    _, ns["m"] = _stacked_materializer(gen, ns)

    def check(ns: dict[str, Any]) -> None:
        written = [int(s) for s in ns["cache_loc"] if s >= 0]
        for pool, scales in ((ns["k_pool"], ns["k_scales"]), (ns["v_pool"], ns["v_scales"])):
            rows = pool[:, written].float()
            # Each written row's largest value reaches 448 (its scale is its largest magnitude over 448).
            assert rows.abs().amax(-1).eq(448).all() and scales[:, written].gt(0).all()

    return ns, check


def recipe_per_layer_rope(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns = _setup(gen)
    layers = _layers(gen)
    ns["kv_weight"] = torch.stack([torch.cat((a.self_attn.k_proj.weight, a.self_attn.v_proj.weight)) for a in layers])
    ns["k_norm_weight"] = torch.stack([a.self_attn.k_norm.weight for a in layers])
    ns["rope_thetas"] = [1e4, 1e6]

    def check(ns: dict[str, Any]) -> None:
        ns["m"].into_pool(ns["hidden"], ns["positions"], ns["cache_loc"], ns["k_pool"], ns["v_pool"])
        want_k, want_v = [], []
        for layer, table in zip(layers, ns["cos_sin_cache"], strict=True):
            a = layer.self_attn
            k = (ns["hidden"] @ a.k_proj.weight.t()).view(T, H, D)
            want_k.append(_neox(_rms(k, a.k_norm.weight, 1e-6), table, ns["positions"]))
            want_v.append((ns["hidden"] @ a.v_proj.weight.t()).view(T, H, D))
        _check_pools(ns, want_k, want_v)

    return ns, check


def _mla_setup(gen: torch.Generator, num_layers: int, ds_mla: bool) -> dict[str, Any]:
    C, R, B = (512, 64, 4) if ds_mla else (32, 16, 4)
    slot_mapping = torch.randperm(4 * B, generator=gen)[:T]
    slot_mapping[1] = -1
    attn = SimpleNamespace(kv_a_proj_with_mqa=_linear(gen, C + R, HIDDEN), kv_a_layernorm=_norm(gen, C))
    dtype = torch.bfloat16 if ds_mla else torch.float32
    return {
        "torch": torch, "typedkv": typedkv, "layers": [SimpleNamespace(self_attn=attn)], "num_layers": num_layers,
        "num_blocks": 4, "block_size": B, "cos_sin_cache": typedkv.cos_sin_cache(P, R),
        "hidden": torch.randn(T, HIDDEN, generator=gen).to(dtype), "positions": torch.randint(0, P, (T,), generator=gen),
        "slot_mapping": slot_mapping, "kv_cache": torch.zeros(num_layers, 4, B, C + R).to(dtype),
    }  # fmt: skip


def _mla_check(ns: dict[str, Any], rows: Callable[[Tensor], Tensor]) -> None:
    """The cache holds materialize_mla_kv's rows of ``kv_a_proj_with_mqa(hidden)`` at the named slots (``rows``
    turns a stored row back into values), and nothing elsewhere."""
    a = ns["layers"][0].self_attn
    ckv = (ns["hidden"] @ a.kv_a_proj_with_mqa.weight.t().to(ns["hidden"].dtype))[:, None]
    want = typedkv.materialize_mla_kv(
        ckv, a.kv_a_layernorm.weight[None], 1e-6, ns["cos_sin_cache"], ns["positions"], rope_style="gptj"
    )
    flat = ns["kv_cache"].flatten(1, 2)
    written = [t for t, s in enumerate(ns["slot_mapping"].tolist()) if s >= 0]
    slots = ns["slot_mapping"][written]
    quantized = flat.dtype == torch.uint8
    torch.testing.assert_close(
        rows(flat[0, slots]),
        want[0, written].float(),
        rtol=0.13 if quantized else 1e-5,
        atol=1e-2 if quantized else 1e-5,
    )
    assert not flat[0, [s for s in range(flat.shape[1]) if s not in slots.tolist()]].float().any()


def recipe_mtp(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns = _mla_setup(gen, 1, ds_mla=False)
    return ns, lambda ns: _mla_check(ns, lambda rows: rows.float())


def recipe_ds_mla(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns = _mla_setup(gen, 1, ds_mla=True)
    a = ns["layers"][0].self_attn
    ns["m"] = typedkv.MLAKVMaterializer(
        a.kv_a_proj_with_mqa.weight[None].to(torch.bfloat16), a.kv_a_layernorm.weight[None], 1e-6, ns["cos_sin_cache"],
        rope_style="gptj",
    )  # fmt: skip

    def decoded(rows: Tensor) -> Tensor:
        scales = rows[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, -1)
        latent = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float() * scales
        return torch.cat((latent, rows[:, 528:].contiguous().view(torch.bfloat16).float()), dim=-1)

    return ns, lambda ns: _mla_check(ns, decoded)


def recipe_tree(gen: torch.Generator) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns = _setup(gen)
    layers, ns["m"] = _stacked_materializer(gen, ns)
    ns["accepted"] = torch.tensor([True, False, True, True, False])
    ns["verified_slots"] = torch.randperm(S, generator=gen)[:T]
    ns["verified_hidden"], ns["verified_positions"] = ns["hidden"], ns["positions"]

    def check(ns: dict[str, Any]) -> None:
        assert ns["cache_loc"].tolist() == torch.where(ns["accepted"], ns["verified_slots"], -1).tolist()
        _qwen_style(ns, layers, ns["hidden"])  # the accepted tokens at their slots; no rejected token's slot

    return ns, check


# Each block's namespace and check.
RECIPES: dict[str, Callable[[torch.Generator], Any]] = {
    "DFlash: K norm, RoPE, into the engine's pools": recipe_dflash,
    "EAGLE-3: no K norm, K and V from 2 * hidden_size": recipe_eagle3,
    "gpt-oss DFlash: the projection's bias": recipe_bias,
    "Gemma-4 DSpark: K = V, a V norm without scale": recipe_gemma4,
    "Gemma (1 + w) norms: pass 1 + w in float32": recipe_gemma_one_plus_w,
    "FP8 pools: scales written per row": recipe_fp8_scales,
    "A RoPE table per layer": recipe_per_layer_rope,
    "DeepSeek-V3 MTP: the latent into vLLM's paged cache": recipe_mtp,
    "fp8_ds_mla: 656-byte rows": recipe_ds_mla,
    "Committing a tree's accepted tokens": recipe_tree,
}


def test_every_recipe_is_run() -> None:
    assert set(titled_blocks()) == set(RECIPES)


@pytest.mark.parametrize("title", list(RECIPES))
def test_recipe(title: str) -> None:
    """The block, run as written, writes what the draft's own modules compute (checked independently of typedkv's
    reference where the recipe's point is the model's math: Gemma's norms, K = V)."""
    ns, check = RECIPES[title](torch.Generator().manual_seed(len(title)))
    exec(compile(titled_blocks()[title], f"{PAGE}:{title}", "exec"), ns)
    check(ns)


def _table() -> dict[str, dict[str, str]]:
    """The page's table of drafts: each row's cells by column name, by draft name."""
    page = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(page) if line.startswith("| Draft | L |"))
    lines = list(itertools.takewhile(lambda line: line.startswith("| "), page[start:]))
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_the_table_of_drafts_is_the_benchs() -> None:
    """Each draft the bench times (its feature variants aside) has a row with its layers, heads, head dim and
    width, and every URL and file its source names is cited on the page."""
    table = _table()
    page = PAGE.read_text()
    for draft in draft_shapes.DRAFTS:
        names = [name for name in table if draft.name.startswith(name)]
        assert names, f"{draft.name}: no row in docs/recipes.md"
        row = table[max(names, key=len)]
        assert int(row["L"]) == draft.num_layers and int(row["hidden"].split()[0]) == draft.hidden, draft.name
        if draft.kv_lora_rank:
            assert row["KV heads"] == f"MLA: C = {draft.kv_lora_rank}" and f"R = {draft.rotary_dim}" in row["RoPE"]
        else:
            assert int(row["KV heads"]) == draft.num_kv_heads and int(row["D"]) == draft.head_dim, draft.name
        for cited in re.findall(r"https://\S+?(?=[ ;,)]|$)|[\w./-]+\.(?:json|py)", draft.source):
            assert cited.rstrip(".") in page, f"{draft.name}: {cited} is not cited on the page"
