"""`KVMaterializer`'s fused projection path fuzzed on the CPU (the kernel itself under ``TRITON_INTERPRET=1``).

Hypothesis draws a draft -- storage dtype, head and rotary dims, rope style,
K norm or RoPE only, V normed or not, bias, eps one or per layer (a tensor or a
list), one cos/sin table or one per layer, hidden width -- and a call: T (none included), and where K and V go: outputs the call
allocates, outputs given as views of a larger slab, or a pool of any layout
(flat, NHD or HND pages of any size, per-layer lists, the two halves of one
allocation) in the storage dtype or FP8, with or without scales, or FP8 / int8
with a scale per row written beside it. In production
mode some positions lie outside the cos/sin cache and some slots are negative
or past the pool; debug mode rejects those, so its calls have none. Checked:

- dense outputs hold the float64 oracle's K and V (`test_fused_projection.Draft`:
  V bit for bit, K within one storage ulp), and a slab's other bytes are untouched;
- a pool holds GEMM + kernel's V values (a zero's sign aside; a normed V, like K,
  within one FP8 step in an FP8 pool), K within one FP8 step of its K in an FP8 pool, the rows no token names untouched, and in a
  pool of the storage dtype the oracle's K and V at the named rows (so a
  mistake both paths share shows too). The paths are compared where their
  projections agree: on CUDA, GEMM + kernel's at T = 1 with a bias is rounded
  twice (`_projections_agree`), the fused kernel's still once (the oracle's);
- scales written per row: on each path, the pool's values and scales are the documented rule
  (`test_written_scales.quantized_rows`) applied, bit for bit, to the K and V that path gives as dense
  outputs (float32 kv on CUDA: one step and a few ulps of scale, the dense and pool kernels' norms
  summing in other orders), and an unnormed V's are the same on both paths where their projections agree;
- GEMM + kernel with V written by the GEMM itself (dense outputs, the table that
  picks that way widened to every T) holds the same oracle.

Examples per test: 60 on plain CPU, 12 under the interpreter (each call runs the
kernel there); ``TYPEDKV_FUZZ_EXAMPLES=N`` for a longer or shorter hunt.
Derandomized: CI runs the same examples every time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_fused_projection import DTYPES, INTERPRETED, Draft, H, L, Oracle, P, assert_matches_oracle
from test_written_scales import assert_within_a_step, quantized_rows
from torch import Tensor

import typedkv
from typedkv.projection import layers as projection_layers
from typedkv.projection import tuning
from typedkv.projection.dispatch import ProjectionPath

GUARD = 0x35  # a byte finite in every storage and FP8 dtype
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
POOL_LAYOUTS = ("flat", "NHD", "HND", "list", "list_HND", "combined")

_EXAMPLES = os.environ.get("TYPEDKV_FUZZ_EXAMPLES")
FUZZ = settings(
    max_examples=int(_EXAMPLES or (12 if INTERPRETED else 60)),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GPU_FUZZ = settings(FUZZ, max_examples=int(_EXAMPLES or 100))
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@dataclass
class Case:
    """One drawn call: the draft's settings and where the call writes."""

    dtype: torch.dtype
    head_dim: int
    rotary_dim: int
    rope_style: typedkv.RopeStyle
    norm: bool
    bias: bool
    eps: str  # "one", "tensor" or "list"
    hidden: int
    num_tokens: int
    seed: int
    destination: str  # "new", "views", or a pool layout
    page_size: int
    pool_dtype: torch.dtype
    scales: str  # "none", "float" or "tensor" (FP8), or "written" (a scale per row: FP8 or int8)
    bad_positions: list[int]
    bad_slots: list[int]
    v_norm: bool = False
    layer_tables: bool = False


@st.composite
def cases(draw: st.DrawFn, production: bool, pool: bool, max_tokens: int = 24, max_hidden: int = 96) -> Case:
    """A call into dense outputs (``pool`` False) or into a pool; faults only in ``production`` mode."""
    dtype = draw(st.sampled_from(DTYPES))
    head_dim = draw(st.sampled_from([16, 24, 32]))
    rotary_dim = draw(st.sampled_from(sorted({2, 8, 16, head_dim})))
    destination = draw(st.sampled_from(POOL_LAYOUTS if pool else ("new", "views")))
    num_tokens = draw(st.integers(0, max_tokens))
    quantized = pool and draw(st.booleans())
    pool_dtype = draw(st.sampled_from((*FP8, torch.int8))) if quantized else dtype
    fp8 = pool_dtype in FP8
    flawed = st.lists(st.integers(0, max(num_tokens - 1, 0)), max_size=3, unique=True)
    return Case(
        dtype=dtype,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_style=draw(st.sampled_from(["neox", "gptj"])),
        norm=draw(st.booleans()),
        bias=draw(st.booleans()),
        eps=draw(st.sampled_from(["one", "tensor", "list"])),
        hidden=draw(st.integers(1, max_hidden)),
        num_tokens=num_tokens,
        seed=draw(st.integers(0, 2**16)),
        destination=destination,
        page_size=draw(st.sampled_from([1, 4, 8])) if destination in ("NHD", "HND", "list_HND") else 1,
        pool_dtype=pool_dtype,
        # Scales go with FP8 pools, written ones with int8 pools too; a pool of the storage dtype takes none.
        scales=draw(st.sampled_from(["none", "float", "tensor", "written"]))
        if fp8
        else "written"
        if quantized
        else "none",
        bad_positions=draw(flawed) if production and num_tokens else [],
        bad_slots=draw(flawed) if production and pool and num_tokens else [],
        v_norm=draw(st.booleans()),
        layer_tables=draw(st.booleans()),
    )


def _draft(case: Case, device: torch.device) -> Draft:
    """The case's draft, its materializer on ``device`` (its weights and the oracle stay on the CPU)."""
    per_layer = [1e-6, 0.5, 4.0]
    eps: Any = {"one": 0.5, "tensor": torch.tensor(per_layer), "list": per_layer}[case.eps]
    draft = Draft(
        case.dtype, head_dim=case.head_dim, rotary_dim=case.rotary_dim, hidden=case.hidden,
        rope_style=case.rope_style, norm=case.norm, bias=case.bias, eps=eps, seed=case.seed, v_norm=case.v_norm,
        layer_tables=case.layer_tables,
    )  # fmt: skip
    draft.eps = 0.5 if case.eps == "one" else torch.tensor(per_layer, dtype=torch.float64)
    draft.m.to(device)
    return draft


def _positions(case: Case, positions: Tensor) -> Tensor:
    positions = positions.clone()
    for i, token in enumerate(case.bad_positions):
        positions[token] = (-1, P, -1000)[i % 3]
    return positions


# ------------------------------------------------------------------ dense


def check_dense(case: Case, device: torch.device, path: ProjectionPath = "fused") -> Draft:
    """A path's K and V into dense outputs: the oracle's, and nothing written beside the views (the draft
    returned)."""
    draft = _draft(case, device)
    x, positions = draft.call(case.num_tokens, seed=case.seed + 1)
    positions = _positions(case, positions)
    m = draft.m
    m.projection_path = path
    if case.destination == "new":
        k, v = m(x.to(device), positions.to(device))
    else:
        # K and V as views of one slab, each a head_dim-wide window of rows twice as wide.
        d = case.head_dim
        slab = torch.full((2, L, case.num_tokens + 3, H, 2 * d), 3.0, dtype=case.dtype, device=device)
        k_out, v_out = slab[0, :, 2 : 2 + case.num_tokens, :, :d], slab[1, :, 1 : 1 + case.num_tokens, :, d:]
        k, v = m(x.to(device), positions.to(device), k_out=k_out, v_out=v_out)
        assert k is k_out and v is v_out
        rest = torch.ones(slab.shape, dtype=torch.bool, device=device)
        rest[0, :, 2 : 2 + case.num_tokens, :, :d] = False
        rest[1, :, 1 : 1 + case.num_tokens, :, d:] = False
        assert (slab[rest] == 3.0).all(), "written outside the output views"
    assert_matches_oracle((k.cpu(), v.cpu()), draft.oracle(x, positions), case.dtype)
    return draft


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(data=st.data())
def test_dense_outputs_hold_the_oracle(mode: str, data: st.DataObject) -> None:
    check_dense(data.draw(cases(mode == "production", pool=False)), CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@GPU_FUZZ
@given(data=st.data())
def test_dense_outputs_hold_the_oracle_cuda(mode: str, data: st.DataObject) -> None:
    check_dense(data.draw(cases(mode == "production", pool=False, max_tokens=80, max_hidden=300)), CUDA)


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(data=st.data())
def test_gemm_path_with_v_from_the_gemm_holds_the_oracle(mode: str, data: st.DataObject) -> None:
    """GEMM + kernel, where the measured table (widened here to every T) has the GEMM write V straight into
    the outputs and the kernel read K alone (under the interpreter; plain CPU has no kernel: GEMM + reference)."""
    # Without a bias (the GEMM that writes V takes none); outputs given as views stay GEMM + kernel.
    case = data.draw(cases(mode == "production", pool=False).filter(lambda c: not c.bias))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tuning.TUNING, *tuning.measured("cpu", split_gemm_faster=((1, math.inf),)))
        draft = check_dense(case, CPU, "gemm")
    event(f"ways: {sorted(kept.way for kept in draft.m._plans.values())}")


# ------------------------------------------------------------------- pools


def _pools(case: Case, slots: int, device: torch.device) -> tuple[Any, Any, typedkv.KVLayout | None]:
    """A fresh K and V pool of the case's layout on ``device``, every byte `GUARD`."""
    flat = (L, slots, H, case.head_dim)

    def empty(*shape: int) -> Tensor:
        return torch.empty(shape, dtype=case.pool_dtype, device=device)

    def paged(hnd: bool) -> Tensor:
        pages, page = slots // case.page_size, case.page_size
        return empty(L, pages, H, page, case.head_dim) if hnd else empty(L, pages, page, H, case.head_dim)

    made: dict[str, Any] = {
        "flat": lambda: (empty(*flat), empty(*flat), None),
        "NHD": lambda: (paged(False), paged(False), "NHD"),
        "HND": lambda: (paged(True), paged(True), "HND"),
        "list": lambda: (list(empty(*flat)), list(empty(*flat)), None),
        "list_HND": lambda: (list(paged(True)), list(paged(True)), "HND"),
        "combined": lambda: (*empty(2, *flat), None),
    }
    k_pool, v_pool, kv_layout = made[case.destination]()
    for t in _layers(k_pool) + _layers(v_pool):
        t.view(torch.uint8).fill_(GUARD)
    return k_pool, v_pool, kv_layout


def _layers(pool: Tensor | list[Tensor]) -> list[Tensor]:
    return [pool] if isinstance(pool, Tensor) else list(pool)


def _scales_out(pool: Tensor | list[Tensor]) -> Tensor | list[Tensor]:
    """Scale tensors for ``pool``'s rows (float32, its shape without the last dim), every byte `GUARD`."""
    made = [torch.empty(t.shape[:-1], device=t.device) for t in _layers(pool)]
    for t in made:
        t.view(torch.uint8).fill_(GUARD)
    return made[0] if isinstance(pool, Tensor) else made


def _scale_rows(scales: Tensor | list[Tensor], case: Case) -> Tensor:
    """``[L, slots, H]`` on the CPU: every row's scale by slot."""
    stacked = scales if isinstance(scales, Tensor) else torch.stack(scales)
    stacked = stacked.cpu()
    if case.destination in ("HND", "list_HND"):
        stacked = stacked.transpose(2, 3)
    return stacked.reshape(L, -1, H)


def _same(got: Tensor, want: Tensor) -> bool:
    """Bit for bit, any NaN matching any NaN."""
    width = {1: torch.uint8, 4: torch.int32}[got.element_size()]
    return bool(((got.view(width) == want.view(width)) | (got.float().isnan() & want.float().isnan())).all())


def _rows(pool: Tensor | list[Tensor], case: Case) -> Tensor:
    """``[L, slots, H, D]`` on the CPU: every row of the pool by slot, in the pool's dtype."""
    layers = _layers(pool)
    stacked = layers[0] if isinstance(pool, Tensor) else torch.stack([t.view(torch.uint8) for t in layers])
    stacked = stacked.view(case.pool_dtype).cpu()
    if case.destination in ("HND", "list_HND"):
        stacked = stacked.transpose(2, 3)
    return stacked.reshape(L, -1, H, case.head_dim)


def _assert_fp8_steps_apart(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """``got`` and ``want`` (FP8) at most one step of ``dtype`` apart, NaN where the other is."""
    a, b = got.float(), want.float()
    assert torch.equal(a.isnan(), b.isnan())
    mantissa = 3 if dtype == torch.float8_e4m3fn else 2
    smallest = 2.0 ** (-9 if dtype == torch.float8_e4m3fn else -16)  # the subnormal step
    step = torch.maximum(a.abs(), b.abs()).nan_to_num() * 2.0**-mantissa + smallest
    assert ((a - b).abs().nan_to_num() <= step).all(), "K more than one FP8 step from GEMM + kernel's"


_SCALES: dict[str, dict[str, Any]] = {
    "none": {},
    "float": {"k_scale": 0.25, "v_scale": 2.0},
    "tensor": {"k_scale": torch.tensor([0.5, 0.125, 1.0]), "v_scale": torch.tensor([2.0, 1.0, 0.25])},
    "written": {},  # tensors of the pools' shape, made per call (`_scales_out`)
}


def _projections_agree(draft: Draft, hidden: Tensor, device: torch.device) -> Tensor:
    """``[L, T]``: whether GEMM + kernel's projection of a layer and token on ``device`` is the exact one
    rounded once (the fused kernel's and the oracle's). On CUDA ``torch.addmm`` at T = 1 (a GEMV) rounds
    the product before adding the bias, as ``F.linear`` does there, so GEMM + kernel then stores another
    V and norms another K; everywhere else, and always on the CPU, the two agree."""
    m, rows = draft.m, 2 * H * draft.head_dim
    exact = torch.einsum("th,lnh->tln", hidden.double(), draft.weight)
    if draft.bias is not None:
        exact = exact + draft.bias
    out = torch.empty(hidden.shape[0], L * rows, dtype=draft.dtype, device=device)
    projection_layers.gemm(hidden.to(device), m.kv_weight, m.kv_bias, out)
    agree = (out.cpu().view(-1, L, rows) == exact.to(draft.dtype)).all(-1).T
    assert device.type != "cpu" or agree.all(), "the CPU's GEMM rounded a projection twice"
    return agree


def check_pools(case: Case, device: torch.device) -> None:
    """The fused path into a pool: GEMM + kernel's V, K as the oracle's (or GEMM + kernel's in FP8), no other row."""
    draft = _draft(case, device)
    x, positions = draft.call(case.num_tokens, seed=case.seed + 1)
    positions = _positions(case, positions)
    slots = 8 * (case.num_tokens // 8 + 2)  # room for every token and rows no token names
    g = torch.Generator().manual_seed(case.seed + 2)
    cache_loc = torch.randperm(slots, generator=g)[: case.num_tokens]
    for i, token in enumerate(case.bad_slots):
        cache_loc[token] = (-1, slots, -7)[i % 3]  # skipped
    written = {}
    scales = {name: s.to(device) if isinstance(s, Tensor) else s for name, s in _SCALES[case.scales].items()}
    kept = (cache_loc >= 0) & (cache_loc < slots)
    named = cache_loc[kept]
    for path in ("fused", "gemm"):
        k_pool, v_pool, kv_layout = _pools(case, slots, device)
        if case.scales == "written":
            scales = {"k_scale_out": _scales_out(k_pool), "v_scale_out": _scales_out(v_pool)}
        draft.m.projection_path = path
        draft.m.into_pool(
            x.to(device), positions.to(device), cache_loc.to(device), k_pool, v_pool, kv_layout=kv_layout, **scales
        )
        written[path] = (_rows(k_pool, case), _rows(v_pool, case))
        if case.scales == "written":
            # The path's own K and V, as its dense outputs, put through the rule.
            dense = draft.m(x.to(device), positions.to(device))
            for rows, pool, name in zip(dense, written[path], ("k_scale_out", "v_scale_out"), strict=True):
                stored, row_scales = quantized_rows(rows[:, kept], case.pool_dtype)
                got_scales = _scale_rows(scales[name], case)
                if case.dtype == torch.float32 and device.type == "cuda":
                    # The pool kernel's float32 norm may differ from the dense one's in its last bits, and
                    # float32 kv rounds nothing away (docs/concepts.md, Numerics): one step, a few ulps.
                    assert_within_a_step(pool[:, named], got_scales[:, named], stored, row_scales)
                else:
                    assert _same(pool[:, named], stored), f"{path}: {name[0]} values not the rule's"
                    assert _same(got_scales[:, named], row_scales), f"{path}: {name} not the rule's"
                others = torch.ones(slots, dtype=torch.bool)
                others[named] = False
                assert (got_scales[:, others].view(torch.uint8) == GUARD).all(), "a scale no token names was written"
    (k_rows, v_rows), (gemm_k, gemm_v) = written["fused"], written["gemm"]
    others = torch.ones(slots, dtype=torch.bool)
    others[named] = False
    for rows in (k_rows, v_rows):
        assert (rows.view(torch.uint8)[:, others] == GUARD).all(), "a row no token names was written"
    agree = _projections_agree(draft, x, device)[:, kept]  # [L, named tokens]

    def paired(rows: Tensor) -> Tensor:
        """The rows of the tokens whose two projections agree, ``[n, H, D]`` in the pool's dtype."""
        return rows.view(torch.uint8)[:, named][agree].view(case.pool_dtype)

    # V is the projection, exact on the grid in any order of accumulation: where the GEMM rounded it once,
    # the same values (a zero may differ in sign: the kernel's sum starts from +0.0, and x * 0 for a negative
    # x is -0.0). K's norm is float32 in both kernels, in another order: K is compared with the oracle, or
    # for FP8 with GEMM + kernel's; so is a normed V.
    if not case.v_norm:
        assert torch.equal(paired(v_rows).float(), paired(gemm_v).float()), "V not GEMM + kernel's values"
    if case.scales == "written":
        # Each path held to its own dense K and V above (those the dense cases hold to the oracle); an unnormed
        # V, and so its scales, the same on both.
        return
    if case.pool_dtype in FP8:
        _assert_fp8_steps_apart(paired(k_rows), paired(gemm_k), case.pool_dtype)
        if case.v_norm:
            _assert_fp8_steps_apart(paired(v_rows), paired(gemm_v), case.pool_dtype)
    else:
        want = draft.oracle(x, positions)
        oracle = Oracle(want[0][:, kept], want[1][:, kept], want.other_k64[:, kept])
        assert_matches_oracle((k_rows[:, named], v_rows[:, named]), oracle, case.dtype)


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(data=st.data())
def test_pools_hold_what_gemm_and_kernel_write(mode: str, data: st.DataObject) -> None:
    check_pools(data.draw(cases(mode == "production", pool=True)), CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@GPU_FUZZ
@given(data=st.data())
def test_pools_hold_what_gemm_and_kernel_write_cuda(mode: str, data: st.DataObject) -> None:
    check_pools(data.draw(cases(mode == "production", pool=True, max_tokens=80, max_hidden=300)), CUDA)
