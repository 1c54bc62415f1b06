"""What a new user meets first: eps in every spelling, the cos/sin cache helpers, KVMaterializer
outputs, inference-only results, the command line and the debug switch.

Runs on the reference path and, with ``TRITON_INTERPRET=1``, on the Triton kernel.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

import typedkv
from typedkv.core import config

T, L, H, D, P, S, HIDDEN = 5, 3, 2, 16, 32, 12, 24


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, L, 2 * H * D, generator=g).to(dtype)
    weight = torch.rand(L, D, generator=g) + 0.5
    cos_sin = typedkv.cos_sin_cache(P, D)
    positions = torch.randint(0, P, (T,), generator=g)
    return kv, weight, cos_sin, positions


# ---------------------------------------------------------------------------------- eps


@pytest.mark.parametrize("spelling", ["list", "tuple", "ints"])
def test_eps_sequence_equals_eps_tensor(spelling: str) -> None:
    """A sequence of L numbers (ints among them) is the [L] tensor of those values, in both ops."""
    kv, weight, cos_sin, positions = _inputs(1)
    values = [1e-6, 0.5, 2] if spelling == "ints" else [1e-6, 0.5, 0.25]
    eps = tuple(values) if spelling == "tuple" else list(values)
    as_tensor = torch.tensor([float(v) for v in values])
    want = typedkv.materialize_kv(kv, weight, as_tensor, cos_sin, positions, num_kv_heads=H)
    got = typedkv.materialize_kv(kv, weight, eps, cos_sin, positions, num_kv_heads=H)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Each value is used: another value for the last layer changes only that layer's K.
    other = typedkv.materialize_kv(kv, weight, [*values[:2], 100.0], cos_sin, positions, num_kv_heads=H)
    assert torch.equal(other[0][:2], got[0][:2]) and not torch.equal(other[0][2], got[0][2])
    k_pool, v_pool = torch.zeros(L, S, H, D), torch.zeros(L, S, H, D)
    cache_loc = torch.randperm(S)[:T]
    typedkv.materialize_kv_into_pool(kv, weight, eps, cos_sin, positions, cache_loc, k_pool, v_pool, num_kv_heads=H)
    assert torch.equal(k_pool[:, cache_loc], want[0]) and torch.equal(v_pool[:, cache_loc], want[1])


def test_eps_int_alone_and_in_materializer() -> None:
    """An int eps, and a per-layer list with an int, are accepted by every entry point alike."""
    kv, weight, cos_sin, positions = _inputs(2)
    zero = typedkv.materialize_kv(kv, weight, 0, cos_sin, positions, num_kv_heads=H)
    torch.testing.assert_close(
        zero[0], typedkv.materialize_kv(kv, weight, 0.0, cos_sin, positions, num_kv_heads=H)[0], rtol=0, atol=0
    )
    g = torch.Generator().manual_seed(3)
    kv_weight = torch.randn(L, 2 * H * D, HIDDEN, generator=g)
    hidden = torch.randn(T, HIDDEN, generator=g)
    m = typedkv.KVMaterializer(kv_weight, weight, [1e-6, 0, 1], cos_sin, num_kv_heads=H)
    k, _ = m(hidden, positions)
    kv_ = (hidden @ kv_weight.reshape(-1, HIDDEN).t()).view(T, L, -1)
    torch.testing.assert_close(
        k, typedkv.materialize_kv(kv_, weight, [1e-6, 0.0, 1.0], cos_sin, positions, num_kv_heads=H)[0]
    )


@pytest.mark.parametrize(
    ("eps", "message"),
    [
        ([1e-6, "1e-6", 1e-6], "eps[1]: expected a float or an int, got str"),
        ([1e-6, True, 1e-6], "eps[1]: expected a float or an int, got bool"),
        ([1e-6] * 2, "eps: expected L=3 per-layer numbers, got 2"),
    ],
)
def test_eps_sequence_misuse(eps: list[object], message: str) -> None:
    kv, weight, cos_sin, positions = _inputs()
    with pytest.raises(typedkv.InputError) as info:
        typedkv.materialize_kv(kv, weight, eps, cos_sin, positions, num_kv_heads=H)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated", "ignore:dynamo_pgo force disabled")
def test_eps_sequence_under_torch_compile() -> None:
    """torch.compile(fullgraph=True) takes the per-layer list too, with the eager result."""
    kv, weight, cos_sin, positions = _inputs(4)
    eps = [1e-6, 0.5, 0.25]

    def step(kv: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return typedkv.materialize_kv(kv, weight, eps, cos_sin, positions, num_kv_heads=H)

    got = torch.compile(step, fullgraph=True)(kv, positions)
    want = step(kv, positions)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------- cos/sin cache


def test_cos_sin_cache_is_standard_rope() -> None:
    """Row p: cos(p * base**(-2j/R)), then the sines, j < R/2 (float32 math, then the asked dtype)."""
    cache = typedkv.cos_sin_cache(7, 6, base=500.0, dtype=torch.float64)
    assert cache.shape == (7, 6) and cache.dtype == torch.float64
    for p in range(7):
        for j in range(3):
            angle = p * 500.0 ** (-2 * j / 6)
            assert math.isclose(cache[p, j].item(), math.cos(angle), abs_tol=1e-6)
            assert math.isclose(cache[p, 3 + j].item(), math.sin(angle), abs_tol=1e-6)
    assert typedkv.cos_sin_cache(4, 8, dtype=torch.bfloat16).dtype == torch.bfloat16


BASE_RANGE = "base: expected a number in float32's normal range (1.1754943508222875e-38 to 3.4028234663852886e+38)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": math.inf}, f"{BASE_RANGE}, got inf"),
        ({"base": math.nan}, f"{BASE_RANGE}, got nan"),
        ({"base": 0}, f"{BASE_RANGE}, got 0"),
        ({"base": 1e39}, f"{BASE_RANGE}, got 1e+39"),  # infinite in float32: no rotation
        ({"base": 1e-50}, f"{BASE_RANGE}, got 1e-50"),  # 0 in float32: a table of NaN
        ({"base": 10**400}, "base: expected a float, got an int of 401 digits"),  # OverflowError before
        ({"base": "1e4"}, f"{BASE_RANGE}, got '1e4'"),
        ({"dtype": torch.int32}, "dtype: expected float32, bfloat16, float16 or float64, got torch.int32"),
        ({"dtype": torch.float8_e4m3fn}, "dtype: expected float32, bfloat16, float16 or float64, got"),
        ({"max_position": 10**400}, "max_position: expected a positive int below 2**63 (a size), got an int of 401"),
        ({"rotary_dim": 2**64}, "rotary_dim: expected a positive int below 2**63 (a size), got an int of 20 digits"),
    ],
    ids=["base-inf", "base-nan", "base-0", "base-1e39", "base-1e-50", "base-huge-int", "base-str", "int32", "fp8",
         "max_position-huge", "rotary_dim-2**64"],
)  # fmt: skip
def test_cos_sin_cache_refuses_what_the_ops_cannot_use(kwargs: dict[str, Any], message: str) -> None:
    """An integer table would hold cos and sin truncated to -1, 0 and 1; a base infinite in float32 (where
    the table is computed), no rotation; one that is 0 there, NaN."""
    args: dict[str, Any] = {"max_position": 4, "rotary_dim": 8} | kwargs
    with pytest.raises(typedkv.InputError, match="^" + re.escape(message)):
        typedkv.cos_sin_cache(**args)


@pytest.mark.parametrize("base", [1.0, 0.5, torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max, 10**6])
def test_cos_sin_cache_bases_float32_holds(base: float) -> None:
    """Every base in float32's normal range gives a finite table."""
    assert typedkv.cos_sin_cache(16, 8, base).isfinite().all()


@pytest.mark.parametrize(
    "device",
    ["bogus", "gpu", "cuda:99", [0], 1.5, *(["cuda", 0] if not torch.cuda.is_available() else [])],
    ids=repr,  # not the bare word gpu: the suite skips tests of that keyword on a machine without one
)
def test_cos_sin_cache_device_torch_cannot_allocate_on(device: Any) -> None:
    """A misspelt device, or one this machine (or this build of torch) lacks, is an InputError whose cause
    is torch's own error (a RuntimeError, AssertionError or TypeError before)."""
    with pytest.raises(typedkv.InputError) as info:
        typedkv.cos_sin_cache(4, 8, device=device)
    assert str(info.value) == (
        "device: expected None or a device torch can allocate on here ('cpu', 'cuda:0' where "
        f"torch.cuda.is_available(), a torch.device), got {device!r}: torch's reason is this error's cause"
    )
    assert info.value.__cause__ is not None


def test_cos_sin_cache_devices_it_has() -> None:
    for device in ("cpu", torch.device("cpu"), None):
        assert typedkv.cos_sin_cache(4, 8, device=device).device.type == "cpu"
    assert typedkv.cos_sin_cache(4, 8, device="meta").is_meta


def test_cos_sin_cache_from_hf_tables() -> None:
    """Hugging Face's duplicated-halves tables give the same cache, and the ops the same K."""
    rotary = 8
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    freqs = torch.outer(torch.arange(P, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # as Hugging Face rotary embeddings build it
    cache = typedkv.cos_sin_cache_from_hf(emb.cos(), emb.sin())
    torch.testing.assert_close(cache, typedkv.cos_sin_cache(P, rotary), rtol=0, atol=0)
    kv, weight, _, positions = _inputs(5)
    with pytest.raises(typedkv.InputError, match=r"R=32: Hugging Face cos and sin tables side by side\?"):
        typedkv.materialize_kv(
            kv, weight, 1e-6, torch.cat((emb.cos(), emb.sin()), -1).repeat(1, 2), positions, num_kv_heads=H
        )
    typedkv.materialize_kv(kv, weight, 1e-6, cache, positions, num_kv_heads=H)


def test_cos_sin_cache_from_hf_misuse() -> None:
    table = torch.ones(P, 8)
    with pytest.raises(typedkv.InputError, match=r"^sin: expected dtype float32 on cpu \(cos's dtype and device\)"):
        typedkv.cos_sin_cache_from_hf(table, table.double())
    with pytest.raises(typedkv.InputError, match=r"^sin: expected shape \(P=32, R=8\), got \(32, 6\)"):
        typedkv.cos_sin_cache_from_hf(table, torch.ones(P, 6))
    with pytest.raises(typedkv.InputError, match=r"^cos: expected an even rotary dim R, at least 2 .*, got R=7$"):
        typedkv.cos_sin_cache_from_hf(torch.ones(P, 7), torch.ones(P, 7))
    # No rotary dims: a table none of the ops takes (they need R >= 2).
    with pytest.raises(typedkv.InputError, match=r"^cos: expected an even rotary dim R, at least 2 .*, got R=0$"):
        typedkv.cos_sin_cache_from_hf(torch.ones(P, 0), torch.ones(P, 0))
    # Meta tensors have no values to compare (NotImplementedError from torch.equal before).
    with pytest.raises(typedkv.InputError, match=r"^cos: expected a tensor with values \(its halves are compared\)"):
        typedkv.cos_sin_cache_from_hf(table.to("meta"), table.to("meta"))


# ------------------------------------------------------------------- KVMaterializer


def test_materializer_call_writes_given_outputs() -> None:
    """m(hidden, positions, k_out=, v_out=) writes into them and returns them, as materialize_kv does."""
    g = torch.Generator().manual_seed(6)
    kv_weight = torch.randn(L, 2 * H * D, HIDDEN, generator=g)
    weight = torch.rand(L, D, generator=g) + 0.5
    hidden = torch.randn(T, HIDDEN, generator=g)
    positions = torch.arange(T)
    m = typedkv.KVMaterializer(kv_weight, weight, 1e-6, typedkv.cos_sin_cache(P, D), num_kv_heads=H)
    slab_k, slab_v = torch.full((L, 2 * T, H, D), 7.0), torch.full((L, 2 * T, H, D), 7.0)
    k, v = m(hidden, positions, k_out=slab_k[:, :T], v_out=slab_v[:, :T])
    assert k.data_ptr() == slab_k.data_ptr() and v.data_ptr() == slab_v.data_ptr()
    want_k, want_v = m(hidden, positions)
    assert torch.equal(slab_k[:, :T], want_k) and torch.equal(slab_v[:, :T], want_v)
    assert (slab_k[:, T:] == 7).all() and (slab_v[:, T:] == 7).all()
    with pytest.raises(
        typedkv.InputError, match=r"^k_out: expected shape \(L=3, T=5, H=2, D=16\), got \(5, 3, 2, 16\)"
    ):
        m(hidden, positions, k_out=torch.empty(T, L, H, D))


# -------------------------------------------------------------------- inference only


def test_results_carry_no_autograd_history() -> None:
    """Inputs that require grad give results without a graph (as the GPU kernel's), in every entry point."""
    kv, weight, cos_sin, positions = _inputs(7)
    kv.requires_grad_(True)
    weight.requires_grad_(True)
    k, v = typedkv.materialize_kv(kv, weight, 1e-6, cos_sin, positions, num_kv_heads=H)
    assert not k.requires_grad and not v.requires_grad and k.grad_fn is None
    k_pool, v_pool = torch.zeros(L, S, H, D), torch.zeros(L, S, H, D)
    typedkv.materialize_kv_into_pool(
        kv, weight, 1e-6, cos_sin, positions, torch.arange(T), k_pool, v_pool, num_kv_heads=H
    )
    assert not k_pool.requires_grad and k_pool.grad_fn is None
    g = torch.Generator().manual_seed(8)
    m = typedkv.KVMaterializer(torch.randn(L, 2 * H * D, HIDDEN, generator=g), weight, 1e-6, cos_sin, num_kv_heads=H)
    hidden = torch.randn(T, HIDDEN, generator=g, requires_grad=True)
    k, _ = m(hidden, positions)
    assert not k.requires_grad


# ------------------------------------------------------------- command line, debug switch


def test_version_flag() -> None:
    run = subprocess.run([sys.executable, "-m", "typedkv", "--version"], capture_output=True, text=True, check=False)
    assert run.returncode == 0 and run.stdout.strip() == f"typedkv {typedkv.__version__}", run.stderr


@pytest.mark.parametrize(
    ("text", "on"),
    [("1", True), ("2", True), ("true", True), ("Yes", True), (" on ", True), ("debug", True),
     ("0", False), ("", False), ("false", False), ("off", False), ("no", False)],
)  # fmt: skip
def test_debug_flag_spellings(text: str, on: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.parse_flag("TYPEDKV_DEBUG", text) is on


def test_debug_flag_unknown_value_warns() -> None:
    with pytest.warns(RuntimeWarning, match=r"TYPEDKV_DEBUG='maybe' is not a flag value .*: debug mode stays off"):
        assert config.parse_flag("TYPEDKV_DEBUG", "maybe") is False
    run = subprocess.run(
        [sys.executable, "-c", "import typedkv; print(typedkv.debug_enabled())"],
        capture_output=True, text=True, check=False, env={**os.environ, "TYPEDKV_DEBUG": "2"},
    )  # fmt: skip
    assert run.stdout.strip() == "True", run.stderr
