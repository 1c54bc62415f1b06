"""``typedkv.KVMaterializer``: one GEMM for all layers into a reused workspace, then the fused op.

The oracle is the GEMM done with ``F.linear`` on the stacked weights, then
``typedkv.materialize_kv``: the materializer must give the same bits. The same
file runs under ``TRITON_INTERPRET=1`` (the fused op then runs Triton's
interpreter), so shapes are tiny and the op calls few.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import typedkv

L, H, D, HIDDEN, P = 3, 2, 16, 24, 64
ROWS = 2 * H * D
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "draft_model.py"


@dataclass(frozen=True)
class Layers:
    """Per-layer weights as a model holds them (nn.Linear rows, K then V)."""

    kv_weight: list[Tensor]
    k_norm_weight: list[Tensor]
    kv_bias: list[Tensor]
    cos_sin_cache: Tensor


def make_layers(dtype: torch.dtype = torch.float32, seed: int = 0) -> Layers:
    g = torch.Generator().manual_seed(seed)
    return Layers(
        [torch.randn(ROWS, HIDDEN, generator=g).div(HIDDEN**0.5).to(dtype) for _ in range(L)],
        [(torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(L)],
        [torch.randn(ROWS, generator=g).to(dtype) for _ in range(L)],
        torch.randn(P, D, generator=g),
    )


def make_call(num_tokens: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=g).to(dtype), torch.randint(0, P, (num_tokens,), generator=g)


def oracle(
    layers: Layers, hidden: Tensor, positions: Tensor, eps: float | Tensor, bias: bool, rope_style: typedkv.RopeStyle
) -> tuple[Tensor, Tensor]:
    weight = torch.cat(layers.kv_weight)
    kv = F.linear(hidden, weight, torch.cat(layers.kv_bias) if bias else None).view(hidden.shape[0], L, ROWS)
    return typedkv.materialize_kv(
        kv, torch.stack(layers.k_norm_weight), eps, layers.cos_sin_cache, positions,
        num_kv_heads=H, rope_style=rope_style,
    )  # fmt: skip


def assert_equal(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


# ------------------------------------------------------------------ results


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_matches_gemm_then_op(stacked: bool, bias: bool) -> None:
    """Stacked or per-layer weights, with or without bias: the GEMM-then-op result, bit for bit."""
    layers = make_layers()
    kv_weight: Tensor | list[Tensor] = torch.stack(layers.kv_weight) if stacked else layers.kv_weight
    k_norm_weight: Tensor | list[Tensor] = torch.stack(layers.k_norm_weight) if stacked else layers.k_norm_weight
    kv_bias: Tensor | list[Tensor] | None = None
    if bias:
        kv_bias = torch.stack(layers.kv_bias) if stacked else layers.kv_bias
    m = typedkv.KVMaterializer(
        kv_weight, k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H, rope_style="gptj", kv_bias=kv_bias
    )
    hidden, positions = make_call(5)
    k, v = m(hidden, positions)
    assert k.shape == v.shape == (L, 5, H, D)
    assert_equal((k, v), oracle(layers, hidden, positions, 1e-6, bias, "gptj"))


@pytest.mark.parametrize("form", ["float", "tensor", "floats"])
def test_eps_forms(form: str) -> None:
    """eps as one float, an [L] tensor, or a sequence of L floats (one per layer)."""
    layers = make_layers()
    per_layer = [1e-6, 1e-2, 0.5]
    forms: dict[str, float | Tensor | list[float]] = {
        "float": 0.5,
        "tensor": torch.tensor(per_layer),
        "floats": per_layer,
    }
    eps = forms[form]
    m = typedkv.KVMaterializer(layers.kv_weight, layers.k_norm_weight, eps, layers.cos_sin_cache, num_kv_heads=H)
    hidden, positions = make_call(4)
    want_eps = 0.5 if form == "float" else torch.tensor(per_layer)
    assert_equal(m(hidden, positions), oracle(layers, hidden, positions, want_eps, False, "neox"))


def test_into_pool_stacked_and_per_layer() -> None:
    """into_pool writes the rows m(...) returns, into a stacked pool and into per-layer pools."""
    layers = make_layers()
    m = typedkv.KVMaterializer(
        layers.kv_weight, layers.k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H, kv_bias=layers.kv_bias
    )
    hidden, positions = make_call(4)
    cache_loc = torch.tensor([7, -1, 0, 3])
    k_pool, v_pool = torch.zeros(L, 9, H, D), torch.zeros(L, 9, H, D)
    m.into_pool(hidden, positions, cache_loc, k_pool, v_pool)
    k_layers, v_layers = [torch.zeros(9, H, D) for _ in range(L)], [torch.zeros(9, H, D) for _ in range(L)]
    m.into_pool(hidden, positions, cache_loc, k_layers, v_layers)
    k, v = oracle(layers, hidden, positions, 1e-6, True, "neox")
    kept = cache_loc >= 0
    want_k, want_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    want_k[:, cache_loc[kept]] = k[:, kept]
    want_v[:, cache_loc[kept]] = v[:, kept]
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert torch.equal(torch.stack(k_layers), want_k) and torch.equal(torch.stack(v_layers), want_v)


@pytest.mark.parametrize("stacked", [False, True], ids=["per_layer", "stacked"])
def test_rope_only(stacked: bool) -> None:
    """k_norm_weight=None: D from kv_weight's rows; forward and into_pool (paged, both layouts) agree with the op."""
    layers = make_layers()
    kv_weight: Tensor | list[Tensor] = torch.stack(layers.kv_weight) if stacked else layers.kv_weight
    m = typedkv.KVMaterializer(kv_weight, None, float("nan"), layers.cos_sin_cache, num_kv_heads=H, rope_style="gptj")
    assert m.head_dim == D and m.k_norm_weight is None
    hidden, positions = make_call(5)
    kv = F.linear(hidden, torch.cat(layers.kv_weight)).view(5, L, ROWS)
    want = typedkv.materialize_kv(kv, None, 0.0, layers.cos_sin_cache, positions, num_kv_heads=H, rope_style="gptj")
    assert_equal(m(hidden, positions), want)
    cache_loc = torch.tensor([9, -1, 0, 5, 2])
    layouts: tuple[tuple[typedkv.KVLayout, tuple[int, ...]], ...] = (("NHD", (L, 3, 4, H, D)), ("HND", (L, 3, H, 4, D)))
    for kv_layout, shape in layouts:
        cache = torch.zeros(2, *shape)
        m.into_pool(hidden, positions, cache_loc, cache[0], cache[1], kv_layout=kv_layout)
        flat = cache.transpose(3, 4) if kv_layout == "HND" else cache
        flat = flat.reshape(2, L, 12, H, D)
        kept = cache_loc >= 0
        assert torch.equal(flat[0][:, cache_loc[kept]], want[0][:, kept])
        assert torch.equal(flat[1][:, cache_loc[kept]], want[1][:, kept])
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[cache_loc[kept]] = False
        assert not flat[:, :, untouched].any()


def test_rope_only_width_not_a_multiple() -> None:
    """Without a norm weight D is solved from kv_weight's rows: rows that are no 2*H*D are named."""
    with pytest.raises(typedkv.InputError) as info:
        typedkv.KVMaterializer(torch.zeros(L, 62, HIDDEN), None, 1e-6, torch.zeros(P, 8), num_kv_heads=H)
    assert str(info.value) == (
        "kv_weight: expected shape (L=3, 2*H*D, hidden=24), got (3, 62, 24): the size must be 2*H*D = 4*D; "
        "62 is not a multiple of 4"
    )


def test_no_tokens() -> None:
    layers = make_layers()
    m = typedkv.KVMaterializer(layers.kv_weight, layers.k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H)
    k, v = m(*make_call(0))
    assert k.shape == v.shape == (L, 0, H, D)


def test_moved_with_to() -> None:
    """An nn.Module: .to() converts the weights, and the workspace follows on the next call."""
    layers = make_layers()
    m = typedkv.KVMaterializer(layers.kv_weight, layers.k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H)
    m(*make_call(2))
    m.to(torch.bfloat16)
    hidden, positions = make_call(2, torch.bfloat16)
    k, v = m(hidden, positions)
    assert k.dtype == v.dtype == torch.bfloat16
    assert m._workspace is not None and m._workspace.dtype == torch.bfloat16


def test_parameters_and_inference_mode() -> None:
    """nn.Linear parameters are taken detached; a workspace first made under inference_mode serves later calls."""
    linears = [torch.nn.Linear(HIDDEN, ROWS, bias=False) for _ in range(L)]
    layers = make_layers()
    m = typedkv.KVMaterializer(
        [lin.weight for lin in linears], layers.k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H
    )
    assert not m.kv_weight.requires_grad
    hidden, positions = make_call(3)
    with torch.inference_mode():
        first = m(hidden, positions)
    with torch.no_grad():
        assert_equal(m(hidden, positions), first)


# ----------------------------------------------------------------- workspace


def test_workspace_reused_and_grown_geometrically() -> None:
    """One GEMM output buffer: the same storage at a fixed T, grown to the next power of two, never shrunk."""
    layers = make_layers()
    m = typedkv.KVMaterializer(layers.kv_weight, layers.k_norm_weight, 1e-6, layers.cos_sin_cache, num_kv_heads=H)
    hidden, positions = make_call(5)
    m(hidden, positions)
    first = m._workspace
    assert first is not None and first.shape == (8, L * ROWS)
    outputs = m(hidden, positions)
    assert m._workspace is first
    # The outputs never alias the workspace: the next call cannot overwrite them.
    assert all(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in outputs)
    m.into_pool(hidden, positions, torch.arange(5), torch.zeros(L, 5, H, D), torch.zeros(L, 5, H, D))
    m(*make_call(8))
    assert m._workspace is first
    m(*make_call(9))
    grown = m._workspace
    assert grown is not None and grown.shape == (16, L * ROWS)
    m(*make_call(2))
    assert m._workspace is grown


# -------------------------------------------------------------------- errors

_W = make_layers()


def _build(**changes: object) -> None:
    args: dict[str, object] = {
        "kv_weight": _W.kv_weight,
        "k_norm_weight": _W.k_norm_weight,
        "eps": 1e-6,
        "cos_sin_cache": _W.cos_sin_cache,
        "num_kv_heads": H,
    }
    args.update(changes)
    typedkv.KVMaterializer(**args)  # type: ignore[arg-type]


_CONSTRUCTOR_ERRORS = {
    "layer_hidden": (
        {"kv_weight": [*_W.kv_weight[:2], torch.zeros(ROWS, 20)]},
        "kv_weight[2]: expected shape (2*H*D=64, hidden=24), got (64, 20): hidden=24 comes from kv_weight[0]",
    ),
    "layer_rows": (
        {"kv_weight": [_W.kv_weight[0], torch.zeros(60, HIDDEN), _W.kv_weight[2]]},
        "kv_weight[1]: expected shape (2*H*D=64, hidden=24), got (60, 24): the size must be 2*H*D = 2*2*16 = 64",
    ),
    "layer_norm": (
        {"k_norm_weight": [*_W.k_norm_weight[:2], torch.ones(8)]},
        "k_norm_weight[2]: expected shape (D=16), got (8,): D=16 comes from k_norm_weight[0]",
    ),
    "layer_dtype": (
        {"kv_weight": [_W.kv_weight[0], _W.kv_weight[1].half(), _W.kv_weight[2]]},
        "kv_weight[1]: expected dtype float32 (kv_weight[0]'s), got float16: the layers share one dtype",
    ),
    "stacked_rows": (
        {"kv_weight": torch.zeros(L, 60, HIDDEN)},
        "kv_weight: expected shape (L, 2*H*D=64, hidden), got (3, 60, 24): the size must be 2*H*D = 2*2*16 = 64",
    ),
    "heads": (
        {"num_kv_heads": 4},
        "kv_weight[0]: expected shape (2*H*D=128, hidden), got (64, 24): the size must be 2*H*D = 2*4*16 = 128; "
        "64 would fit num_kv_heads=2",
    ),
    "layer_count": (
        {"k_norm_weight": _W.k_norm_weight[:2]},
        "k_norm_weight: expected L=3 layers (kv_weight has 3), got 2",
    ),
    "stacked_layer_count": (
        {"k_norm_weight": torch.ones(4, D)},
        "k_norm_weight: expected L=3 layers (kv_weight has 3), got 4",
    ),
    "eps_count": ({"eps": [1e-6, 1e-6]}, "eps: expected L=3 layers (kv_weight has 3), got 2"),
    "eps_item": ({"eps": [1e-6, 1e-6, "0"]}, "eps[2]: expected a float or an int, got str"),
    "no_layers": ({"kv_weight": []}, "kv_weight: expected at least one layer, got none"),
    "bias_dtype": (
        {"kv_bias": torch.zeros(L, ROWS, dtype=torch.bfloat16)},
        "kv_bias: expected dtype float32 (kv_weight's), got bfloat16: convert it with kv_bias.to(torch.float32)",
    ),
    "bias_shape": (
        {"kv_bias": [torch.zeros(ROWS), torch.zeros(ROWS), torch.zeros(ROWS + 1)]},
        "kv_bias[2]: expected shape (2*H*D=64), got (65,): the size must be 2*H*D = 2*2*16 = 64",
    ),
    "rotary": (
        {"cos_sin_cache": torch.zeros(P, 18)},
        "cos_sin_cache: the rotary dim R must be even and 2 <= R <= D, got D=16, R=18",
    ),
    "rope_style": ({"rope_style": "llama"}, "rope_style: expected 'neox' or 'gptj', got 'llama'"),
}


@pytest.mark.parametrize(("changes", "message"), _CONSTRUCTOR_ERRORS.values(), ids=_CONSTRUCTOR_ERRORS.keys())
def test_constructor_errors(changes: dict[str, object], message: str) -> None:
    """Layers that disagree are named; every message is exact."""
    with pytest.raises(typedkv.InputError) as info:
        _build(**changes)
    assert str(info.value) == message


def test_call_errors() -> None:
    """A call's own arguments are checked against the weights, in the names the caller used."""
    m = typedkv.KVMaterializer(_W.kv_weight, _W.k_norm_weight, 1e-6, _W.cos_sin_cache, num_kv_heads=H)
    hidden, positions = make_call(5)
    pools = (torch.zeros(L, 8, H, D), torch.zeros(L, 8, H, D))
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: m(hidden[:, :20], positions),
            "hidden: expected shape (T, hidden=24), got (5, 20): hidden=24 comes from kv_weight",
        ),
        (
            lambda: m(hidden.double(), positions),
            "hidden: expected dtype float32 on cpu (kv_weight's dtype and device), got dtype float64 on cpu: "
            "convert it where it is made, hidden.to(kv_weight.dtype)",
        ),
        (lambda: m(hidden, positions[:3]), "positions: expected shape (T=5), got (3,): T=5 comes from hidden"),
        (
            lambda: m.into_pool(hidden, positions, torch.arange(4), *pools),
            "cache_loc: expected shape (T=5), got (4,): T=5 comes from hidden",
        ),
    ]
    for call, message in cases:
        with pytest.raises(typedkv.InputError) as info:
            call()
        assert str(info.value) == message


# ------------------------------------------------------- repeated calls


def _stacked_materializer(layers: Layers) -> typedkv.KVMaterializer:
    return typedkv.KVMaterializer(
        torch.stack(layers.kv_weight), torch.stack(layers.k_norm_weight), 1e-6, layers.cos_sin_cache,
        num_kv_heads=H, kv_bias=torch.stack(layers.kv_bias),
    )  # fmt: skip


@pytest.mark.production
def test_repeated_calls_reuse_the_checked_layout() -> None:
    """After its first call a layout goes straight to the GEMM and the launch: every call's own data, same bits."""
    layers = make_layers()
    m = _stacked_materializer(layers)
    k_pool, v_pool = torch.zeros(L, 16, H, D), torch.zeros(L, 16, H, D)
    for seed in range(3):
        hidden, positions = make_call(5, seed=seed)
        want = oracle(layers, hidden, positions, 1e-6, True, "neox")
        assert_equal(m(hidden, positions), want)
        slots = torch.randperm(16, generator=torch.Generator().manual_seed(seed))[:5]
        m.into_pool(hidden, positions, slots, k_pool, v_pool)
        assert_equal(
            (k_pool[:, slots].transpose(0, 1), v_pool[:, slots].transpose(0, 1)),
            (want[0].transpose(0, 1), want[1].transpose(0, 1)),
        )
    assert len(m._plans) == 2  # one dense layout, one pool layout


_REPLACED: dict[str, tuple[str, Callable[[], Tensor], str]] = {
    "weight rows": (
        "kv_weight", lambda: torch.randn(L * ROWS + 2, HIDDEN),
        "kv_weight: expected shape (L*2*H*D=192, hidden=24), got (194, 24): the size must be L*2*H*D = 3*2*2*16 = 192",
    ),
    "weight width": (
        "kv_weight", lambda: torch.randn(L * ROWS, HIDDEN + 1),
        "kv_weight: expected shape (L*2*H*D=192, hidden=24), got (192, 25): hidden=24 comes from hidden_size",
    ),
    "bias of one": (
        "kv_bias", lambda: torch.randn(1),
        "kv_bias: expected shape (L*2*H*D=192), got (1,): the size must be L*2*H*D = 3*2*2*16 = 192",
    ),
    "bias dtype": (
        "kv_bias", lambda: torch.randn(L * ROWS, dtype=torch.float64),
        "kv_bias: expected dtype float32 on cpu (kv_weight's dtype and device), got dtype float64 on cpu: "
        "convert it where it is made, kv_bias.to(kv_weight.dtype)",
    ),
    "norm width": (
        "k_norm_weight", lambda: torch.ones(L, D + 2),
        "k_norm_weight: expected shape (L=3, D=16), got (3, 18): D=16 comes from head_dim",
    ),
}  # fmt: skip


@pytest.mark.production
@pytest.mark.parametrize("path", ["gemm", "fused"])
@pytest.mark.parametrize("case", list(_REPLACED))
def test_a_replaced_buffer_is_checked_again(case: str, path: str) -> None:
    """The buffers' layouts are part of a kept plan's key: one replaced by another shape or dtype is refused by
    name at the next call (before: a RuntimeError from the GEMM, a bias broadcast to every row, or the fused
    kernel reading past a one-element bias), and nothing is written."""
    name, make, message = _REPLACED[case]
    layers = make_layers()
    m = _stacked_materializer(layers)
    m.projection_path = path  # type: ignore[assignment]
    hidden, positions = make_call(5)
    m(hidden, positions)
    setattr(m, name, make())
    k_out, v_out = torch.zeros(L, 5, H, D), torch.zeros(L, 5, H, D)
    with pytest.raises(typedkv.InputError) as caught:
        m(hidden, positions, k_out, v_out)
    assert str(caught.value) == message
    assert not k_out.any() and not v_out.any()


@pytest.mark.production
def test_per_call_checks_run_on_a_checked_layout() -> None:
    """What a layout cannot tell is checked at every call: outputs or per-layer pools sharing memory."""
    m = _stacked_materializer(make_layers())
    hidden, positions = make_call(5)
    k_out, v_out = torch.empty(L, 5, H, D), torch.empty(L, 5, H, D)
    m(hidden, positions, k_out, v_out)
    with pytest.raises(typedkv.InputError, match="v_out: expected a tensor apart from k_out"):
        m(hidden, positions, k_out, k_out)
    k_layers = [torch.zeros(16, H, D) for _ in range(L)]
    v_layers = [torch.zeros(16, H, D) for _ in range(L)]
    m.into_pool(hidden, positions, torch.arange(5), k_layers, v_layers)
    with pytest.raises(typedkv.InputError, match="memory of its own"):
        m.into_pool(hidden, positions, torch.arange(5), k_layers, [*v_layers[:-1], k_layers[0]])


# ------------------------------------------------------------------- example


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("draft_model_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_example_draft_model_runs_and_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/draft_model.py: the fused draft equals its own unfused forward."""
    main: Callable[[list[str]], None] = _load_example().main
    main([])
    assert "fused and unfused agree" in capsys.readouterr().out


def test_a_cast_keeps_the_rope_table_and_eps() -> None:
    """``.to(torch.bfloat16)`` / ``.half()`` of a draft model cast the weights, not the RoPE table or eps: the cast
    materializer gives what one built from bfloat16 weights with the float32 table gives (before: the table
    rounded to bfloat16, K a few ulps off)."""
    layers = make_layers()
    eps = torch.tensor([1e-6, 1e-5, 1e-6])
    for half in (False, True):
        m = typedkv.KVMaterializer(
            torch.stack(layers.kv_weight), torch.stack(layers.k_norm_weight), eps, layers.cos_sin_cache, num_kv_heads=H
        )
        assert (m.half() if half else m.to(torch.bfloat16)) is m
        dtype = m.kv_weight.dtype
        assert dtype in (torch.bfloat16, torch.float16) and m.k_norm_weight is not None
        assert m.k_norm_weight.dtype == dtype and m.cos_sin_cache.dtype == torch.float32
        assert isinstance(m.eps, Tensor) and m.eps.dtype == torch.float32
        built = typedkv.KVMaterializer(
            torch.stack(layers.kv_weight).to(dtype), torch.stack(layers.k_norm_weight).to(dtype), eps,
            layers.cos_sin_cache, num_kv_heads=H,
        )  # fmt: skip
        hidden, positions = make_call(5, dtype)
        for got, want in zip(m(hidden, positions), built(hidden, positions), strict=True):
            assert torch.equal(got, want)


def test_mla_cast_keeps_the_rope_table() -> None:
    m = typedkv.MLAKVMaterializer(
        torch.randn(2, 24, HIDDEN), torch.rand(2, 16), 1e-6, typedkv.cos_sin_cache(P, 8), rope_style="neox"
    ).to(torch.bfloat16)
    assert m.kv_a_weight.dtype == torch.bfloat16 and m.cos_sin_cache.dtype == torch.float32
