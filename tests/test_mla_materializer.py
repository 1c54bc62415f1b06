"""``typedkv.MLAKVMaterializer``: one GEMM for all layers, then the MLA op.

Its output equals the op on the unfused projection (``hidden @ kv_a_weight[l].T``
stacked per layer) bit for bit -- the GEMM is the same ``torch.mm``/``addmm`` --
and so does what it writes into a pool; misuse is rejected with the argument's
name. Also run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv

L, C, R, HIDDEN, T, P, S = 3, 32, 16, 24, 5, 40, 9
g = torch.Generator().manual_seed(7)
WEIGHT = (torch.randn(L, C + R, HIDDEN, generator=g) / 5).to(torch.float16)
NORM = torch.rand(L, C, generator=g) + 0.5
BIAS = torch.randn(L, C + R, generator=g).to(torch.float16)
CACHE = torch.randn(P, R, generator=g)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
HIDDEN_STATES = torch.randn(T, HIDDEN, generator=g).to(torch.float16)
POSITIONS = torch.tensor([0, 5, 39, 2, 2])


def unfused(bias: Tensor | None, norm: Tensor | None, eps: Any, rope_style: typedkv.RopeStyle) -> Tensor:
    ckv = torch.stack(
        [torch.nn.functional.linear(HIDDEN_STATES, WEIGHT[i], None if bias is None else bias[i]) for i in range(L)], 1
    )
    return typedkv.materialize_mla_kv(ckv, norm, eps, CACHE, POSITIONS, rope_style=rope_style)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("bias", [None, BIAS])
@pytest.mark.parametrize("norm", [NORM, None])
@pytest.mark.parametrize("rope_style", ["gptj", "neox"])
def test_matches_the_unfused_path(stacked: bool, bias: Tensor | None, norm: Tensor | None, rope_style: Any) -> None:
    eps = torch.tensor([1e-6, 1e-3, 1e-2])
    m = typedkv.MLAKVMaterializer(
        WEIGHT if stacked else list(WEIGHT), norm if norm is None or stacked else list(norm), eps, CACHE,
        rope_style=rope_style, kv_a_bias=bias if bias is None or stacked else list(bias),
    )  # fmt: skip
    want = unfused(bias, norm, eps, rope_style)
    assert torch.equal(m(HIDDEN_STATES, POSITIONS), want)
    pool = [torch.full((S, 1, C + R), 3.0, dtype=torch.float16) for _ in range(L)]
    m.into_pool(HIDDEN_STATES, POSITIONS, torch.tensor([8, 0, -1, 4, 2]), pool)
    for layer in range(L):
        assert torch.equal(pool[layer][[8, 0, 4, 2], 0], want[layer, [0, 1, 3, 4]])
        assert bool((pool[layer][[1, 3, 5, 6, 7]] == 3.0).all())


def test_eps_sequence_and_given_out() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, [1e-6, 1e-3, 1e-2], CACHE, rope_style="gptj")
    slab = torch.full((L, T + 2, C + R), 7.0, dtype=torch.float16)
    got = m(HIDDEN_STATES, POSITIONS, out=slab[:, :T])
    assert got.data_ptr() == slab.data_ptr() and bool((slab[:, T:] == 7.0).all())
    assert torch.equal(got, unfused(None, NORM, torch.tensor([1e-6, 1e-3, 1e-2]), "gptj"))


def test_workspace_is_reused_and_grows() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj")
    m(HIDDEN_STATES[:3], POSITIONS[:3])
    first = m._workspace
    assert first is not None and first.shape[0] == 4
    m(HIDDEN_STATES[:4], POSITIONS[:4])
    assert m._workspace is first
    assert torch.equal(m(HIDDEN_STATES, POSITIONS), unfused(None, NORM, 1e-6, "gptj"))
    assert m._workspace is not None and m._workspace.shape[0] == 8


@pytest.mark.production
def test_repeated_calls_reuse_the_checked_layout() -> None:
    """As for KVMaterializer: after a layout's first call, straight to the GEMM and the launch, same bits."""
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj", kv_a_bias=BIAS)
    want = unfused(BIAS, NORM, 1e-6, "gptj")
    pool = torch.zeros(L, S, C + R, dtype=torch.float16)
    for _ in range(3):
        assert torch.equal(m(HIDDEN_STATES, POSITIONS), want)
        m.into_pool(HIDDEN_STATES, POSITIONS, torch.tensor([8, 0, 1, 4, 2]), pool)
        assert torch.equal(pool[:, [8, 0, 1, 4, 2]], want)
    assert len(m._plans) == 2


@pytest.mark.production
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("kv_norm_weight", torch.ones(L, C + 2), "kv_norm_weight: expected shape (L=3, C=32), got (3, 34): C=32 comes from kv_lora_rank"),
        ("kv_a_bias", torch.ones(1, dtype=torch.float16), "kv_a_bias: expected shape (L*(C+R)=144), got (1,): the size must be L*(C+R) = 3*(32+16) = 144"),
        ("kv_a_weight", torch.ones(L * (C + R) + 2, HIDDEN, dtype=torch.float16), "kv_a_weight: expected shape (L*(C+R)=144, hidden=24), got (146, 24): the size must be L*(C+R) = 3*(32+16) = 144"),
    ],
)  # fmt: skip
def test_a_replaced_buffer_is_checked_again(name: str, value: Tensor, message: str) -> None:
    """A buffer replaced after construction is refused by name (before: a bias of one broadcast to every row)."""
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj", kv_a_bias=BIAS)
    m(HIDDEN_STATES, POSITIONS)
    setattr(m, name, value)
    out = torch.zeros(L, T, C + R, dtype=torch.float16)
    with pytest.raises(typedkv.InputError) as caught:
        m(HIDDEN_STATES, POSITIONS, out)
    assert str(caught.value) == message
    assert not out.any()


@pytest.mark.production
def test_per_layer_pools_sharing_memory_on_a_checked_layout() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj")
    pool = [torch.zeros(S, C + R, dtype=torch.float16) for _ in range(L)]
    m.into_pool(HIDDEN_STATES, POSITIONS, torch.arange(T), pool)
    with pytest.raises(typedkv.InputError, match="memory of its own"):
        m.into_pool(HIDDEN_STATES, POSITIONS, torch.arange(T), [pool[0], pool[1], pool[0]])


def test_compiled_fullgraph() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT.float(), NORM, 1e-6, CACHE, rope_style="gptj")
    torch._dynamo.reset()
    got = torch.compile(m, fullgraph=True)(HIDDEN_STATES.float(), POSITIONS)
    torch._dynamo.reset()
    assert torch.allclose(got, m(HIDDEN_STATES.float(), POSITIONS), atol=1e-5)


def test_into_pool_compiled_fullgraph() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT.float(), NORM, [1e-6, 1e-3, 1e-2], CACHE, rope_style="neox")
    cache_loc = torch.tensor([8, 0, -1, 4, 2])

    def step(hidden: Tensor, pool: list[Tensor]) -> None:
        m.into_pool(hidden, POSITIONS, cache_loc, pool)

    got = [torch.zeros(S, 1, C + R) for _ in range(L)]
    want = [torch.zeros(S, 1, C + R) for _ in range(L)]
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(HIDDEN_STATES.float(), got)
    torch._dynamo.reset()
    step(HIDDEN_STATES.float(), want)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5) and bool(a.any())


MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({"kv_a_weight": []}, "kv_a_weight: expected at least one layer, got none"),
    ({"kv_norm_weight": [torch.ones(C)] * (L + 1)}, "kv_norm_weight: expected L=3 layers (kv_a_weight has 3), got 4"),
    ({"kv_a_bias": BIAS[:2]}, "kv_a_bias: expected L=3 layers (kv_a_weight has 3), got 2"),
    ({"eps": torch.ones(L + 1)}, "eps: expected L=3 layers (kv_a_weight has 3), got 4"),
    (
        {"kv_a_weight": [WEIGHT[0], WEIGHT[1].float(), WEIGHT[2]]},
        "kv_a_weight[1]: expected dtype float16 (kv_a_weight[0]'s), got float32: the layers share one dtype",
    ),
    (
        {"kv_a_bias": BIAS.float()},
        "kv_a_bias: expected dtype float16 (kv_a_weight's), got float32: convert it with kv_a_bias.to(torch.float16)",
    ),
    (
        {"kv_norm_weight": torch.ones(L, C + 2)},
        "kv_a_weight: expected shape (L=3, C+R=50, hidden), got (3, 48, 24): the size must be C+R = 34+16 = 50",
    ),
    (
        {"cos_sin_cache": torch.randn(P, 15), "kv_norm_weight": None},
        "cos_sin_cache: the rotary dim R must be even and at least 2, got R=15",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), MESSAGES)
def test_constructor_messages(overrides: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "kv_a_weight": WEIGHT,
        "kv_norm_weight": NORM,
        "eps": 1e-6,
        "cos_sin_cache": CACHE,
        **overrides,
    }
    with pytest.raises(typedkv.InputError) as err:
        typedkv.MLAKVMaterializer(
            args["kv_a_weight"], args["kv_norm_weight"], args["eps"], args["cos_sin_cache"], rope_style="gptj",
            kv_a_bias=args.get("kv_a_bias"),
        )  # fmt: skip
    assert str(err.value) == message


def test_call_messages() -> None:
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj")
    with pytest.raises(typedkv.InputError) as err:
        m(torch.randn(T, 2 * HIDDEN).half(), POSITIONS)
    assert str(err.value) == "hidden: expected shape (T, hidden=24), got (5, 48): hidden=24 comes from kv_a_weight"
    with pytest.raises(typedkv.InputError) as err:
        m.into_pool(HIDDEN_STATES, POSITIONS, torch.arange(T), torch.zeros(L, S, C, dtype=torch.float16))
    assert str(err.value) == (
        "kv_pool: expected shape (L=3, S, C+R=48), got (3, 9, 32): the size must be C+R = 32+16 = 48; "
        "C=32 comes from kv_norm_weight, R=16 from cos_sin_cache"
    )


def test_workspace_views_kept_per_token_count() -> None:
    """The GEMM's rows and their ``[T, L, C+R]`` view are made once per ``T`` and reused, also when first made
    under ``torch.inference_mode()`` and written outside it; a larger ``T`` grows the workspace and its views."""
    m = typedkv.MLAKVMaterializer(WEIGHT, NORM, 1e-6, CACHE, rope_style="gptj")
    with torch.inference_mode():
        first = m(HIDDEN_STATES, POSITIONS)
    rows = m._rows.rows(T, WEIGHT.flatten(0, 1))
    again = m(HIDDEN_STATES, POSITIONS)  # outside inference mode, into the views made inside it
    assert torch.equal(first, again)
    assert m._rows.rows(T, WEIGHT.flatten(0, 1)) is rows
    assert m._rows.shaped(rows, (L, C + R)) is m._rows.shaped(rows, (L, C + R))
    more = torch.cat((HIDDEN_STATES, HIDDEN_STATES, HIDDEN_STATES))
    bigger = m(more, POSITIONS.repeat(3))
    assert m._rows.rows(T, WEIGHT.flatten(0, 1)) is not rows  # the workspace grew: its views are new
    assert torch.equal(bigger[:, :T], first)
