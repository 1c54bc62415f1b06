"""Property-based fuzzing of both public ops against the float64 oracle.

What is covered
---------------
Hypothesis draws whole calls of ``typedkv.materialize_kv`` and
``typedkv.materialize_kv_into_pool``:

- sizes: ``T`` from 0, ``L`` 1-4, ``num_kv_heads`` 1-4, ``D`` in {16, 32, 64, 80, 96,
  128}, ``rotary_dim`` even in ``[2, D]`` (``R < D`` included), ``P`` from 0;
- dtypes: kv bfloat16/float16/float32; the norm weights, the cos/sin cache, a per-layer
  eps and FP8 scales of any float dtype (float64 included); int32/int64 indices;
- options: a V norm weight (``v_norm_weight``) or none; one cos/sin table, or one per
  layer (``[L, P, R]``);
- layouts: kv as a strided view of a larger buffer (every other token or layer, a
  column window of wider rows, layers-first memory); ``k_out``/``v_out`` as
  ``[:, :T]`` views of larger slabs (padded heads and head dims too); every pool
  layout of ``tests/test_pool.py`` (stacked and per-layer, padded rows and heads,
  K/V halves of one allocation); FP8 pools with float or ``[L]`` scales; FP8 and int8 pools with a
  scale per row written (``k_scale_out``, ``v_scale_out``: float32, plain or with padded heads);
- values: positions outside ``[0, P)``; slots that are negative, ``>= S`` or repeated;
- misuse, in a third of the examples: one argument broken (a wrong shape, rank,
  dtype, layer count or device, swapped dims, a non-contiguous last dim, an aliased
  output, a scale for a 16-bit pool, ...; see `MUTATIONS`).

Every call must end in one of two ways, and no other exception may escape:

(a) it returns, and the result is the unfused path of ``tests/reference64.py``: K
    within the tolerance derived in ``tests/test_numerics.py`` (FP8: within one FP8
    step of ``saturate(ref / scale)``), V bit for bit (FP8: bit for bit
    ``saturate(v / scale)``, ``test_pool.to_fp8``); a normed V the exact norm rounded
    once (``test_numerics.v_normed_ok``; FP8: within one FP8 step, as K); with scales
    written per row, values and scales bit for bit the documented rule
    (``test_written_scales.quantized_rows``) applied to the dense op's K and V (normed
    where the call norms it; the dense op itself held to the oracle by the dense tests);
(b) it raises ``typedkv.InputError`` whose message starts with the argument to blame
    (``k_out:``, ``k_pool[1]:``, ``cache_loc:`` ...), and no output or pool byte changed.

Every output and pool lies inside a larger buffer filled with a sentinel byte pattern
(canary bytes before and after, padding rows, heads and dims between): after a call
each byte of each buffer is compared, and only the elements of the outputs, or the pool
rows that ``cache_loc`` names, may differ. Inputs are never written.

Both modes run, each test once per mode. Production: an out-of-range position gives
NaN in that token's K (its V is still copied); a negative slot or one ``>= S`` skips
the token; two tokens on one slot race, so each element of the row may hold either
token's value. Debug mode raises ``InputError`` naming ``positions`` (first) or
``cache_loc`` for those instead.

Why
---
The parametrised tests pin each behaviour alone; the kernel breaks on combinations (a
strided kv into a padded per-layer FP8 pool with a repeated slot, in production),
and the checking layer on a misuse nobody listed. A drawn call states the whole
contract at once.

Running
-------
On CPU the file runs twice in CI: the PyTorch reference path (60 examples per test)
and the Triton kernel under ``TRITON_INTERPRET=1`` (25 per test: the interpreter takes
0.05-0.6 s per launch at these sizes). Examples are derandomized: every run checks the
same calls, and a failure prints the drawn `Spec`. ``TYPEDKV_FUZZ_EXAMPLES=N`` runs N
per test instead (a deeper hunt). The ``gpu`` tests run the same bodies on CUDA, 200
examples each, ``T`` up to 40 (most examples are a new Triton specialisation: the
first run compiles); ``tests/fuzz_sample.py`` runs a few of them as a script, under
``compute-sanitizer``.

Hypothesis draws only some misuses in the mixed examples; `test_every_misuse` runs each
one on three drawn calls. The ``test_harness_*`` tests break an op on purpose (a byte
past ``k_out``, a wrong K, one V bit, a write before a rejection, ...) and check that
`check` fails: the property can fail.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from memcheck import run_under_memcheck
from reference64 import materialize_kv64
from test_numerics import (
    ELEMENT_ULPS,
    assert_bitwise_equal,
    assert_k_close,
    assert_v_normed,
    bits,
    pair_length,
    v_normed_ok,
)
from test_pool import FP8, LAYOUTS, to_fp8
from test_written_scales import quantized_rows
from torch import Tensor

import typedkv
from typedkv import RopeStyle
from typedkv.core import launcher

STORAGE = (torch.bfloat16, torch.float16, torch.float32)
PARAM_FLOATS = (*STORAGE, torch.float64)
HEAD_DIMS = (16, 32, 64, 80, 96, 128)
STYLES: tuple[RopeStyle, ...] = ("neox", "gptj")
# The pool layouts without page dims: the misuse below is written for [L, S, H, D] pools
# (paged pools have their own misuse and memcheck cases: tests/test_pool.py, tests/test_gpu.py).
POOL_LAYOUTS = {name: layout for name, layout in LAYOUTS.items() if layout.page_size == 1}
KV_LAYOUTS = ("contiguous", "token-stride", "layer-stride", "wide-row", "offset-row", "layer-major")
OUT_KINDS = ("none", "slab", "padded-slab")
POSITION_FAULTS = ("negative", "past", "far-negative", "far-past")
SLOT_FAULTS = ("past", "far-past", "repeat")
# Finite in every pool and output dtype, whatever the element's alignment in the pattern.
PATTERN = (0xA5, 0x5A, 0x3C, 0xC3)
INPUTS = ("k_norm_weight", "v_norm_weight", "eps", "cos_sin_cache", "positions", "cache_loc", "k_scale", "v_scale")
MODES = ["debug", pytest.param("production", marks=pytest.mark.production)]

# Examples per test (and per mode); see the module docstring for the budget.
# TYPEDKV_FUZZ_EXAMPLES=N runs N instead, on the CPU and the GPU (a longer or a shorter hunt).
_EXAMPLES = os.environ.get("TYPEDKV_FUZZ_EXAMPLES")
CPU_EXAMPLES = int(_EXAMPLES or (25 if launcher.INTERPRETED else 60))
GPU_EXAMPLES = int(_EXAMPLES or 200)
CPU_TOKENS = 7  # T <= 7 leaves partial token blocks for BLOCK_T in {2, 4}
GPU_TOKENS = 40

FUZZ = settings(
    max_examples=CPU_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
GPU_FUZZ = settings(FUZZ, max_examples=GPU_EXAMPLES)


ONE_IN_THREE = st.sampled_from((False, True, False))
Blame = tuple[str, ...]
ScaleSpec = float | torch.dtype | None  # a float, an [L] tensor of that dtype, or none


# --------------------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class Spec:
    """One drawn call: everything but the tensor values, which come from ``seed``."""

    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    num_positions: int
    kv_dtype: torch.dtype
    weight_dtype: torch.dtype
    cache_dtype: torch.dtype
    positions_dtype: torch.dtype
    eps: float | torch.dtype  # a float, or the dtype of an [L] tensor
    rope_style: RopeStyle
    kv_layout: str
    position_faults: tuple[str | None, ...]  # per token
    seed: int
    mutation: str | None
    pool: bool
    v_norm: torch.dtype | None = None  # the dtype of a V norm weight, or none
    layer_tables: bool = False  # a cos/sin table per layer, [L, P, R]
    # materialize_kv
    k_out: str = "none"
    v_out: str = "none"
    # materialize_kv_into_pool
    pool_layout: str = "stacked"
    num_slots: int = 0
    pool_dtype: torch.dtype = torch.bfloat16
    k_scale: ScaleSpec = None
    v_scale: ScaleSpec = None
    scale_out: str | None = None  # scales written per row: "plain" or "padded" (heads), float32; None: none
    loc_dtype: torch.dtype = torch.int64
    slot_kinds: tuple[str, ...] = ()  # per token: "slot", "skip" or one of SLOT_FAULTS


@st.composite
def specs(draw: st.DrawFn, *, pool: bool, max_tokens: int) -> Spec:
    """Calls of one op; the misuse, if any, is applied by `check`."""
    # sampled_from: near uniform (integers() favour their lower bound, here T = 0).
    num_tokens = draw(st.sampled_from(range(max_tokens + 1)))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    kv_dtype = draw(st.sampled_from(STORAGE))
    faulty = num_tokens > 0 and draw(ONE_IN_THREE)
    slot_faulty = pool and num_tokens > 0 and draw(ONE_IN_THREE)
    common: dict[str, Any] = {
        "num_tokens": num_tokens,
        "num_layers": draw(st.integers(1, 4)),
        "num_kv_heads": draw(st.integers(1, 4)),
        "head_dim": head_dim,
        "rotary_dim": draw(st.one_of(st.just(head_dim), st.integers(1, head_dim // 2).map(lambda half: 2 * half))),
        "num_positions": draw(st.sampled_from((0, 1, 3, 17, 40, 64, 100))),
        "kv_dtype": kv_dtype,
        "weight_dtype": draw(st.sampled_from(PARAM_FLOATS)),
        "cache_dtype": draw(st.sampled_from(PARAM_FLOATS)),
        "positions_dtype": draw(st.sampled_from((torch.int32, torch.int64))),
        "eps": draw(st.one_of(st.sampled_from((1e-6, 1e-5, 0.25, 2.0, 1)), st.sampled_from(PARAM_FLOATS))),
        "rope_style": draw(st.sampled_from(STYLES)),
        "kv_layout": draw(st.sampled_from(KV_LAYOUTS)),
        "position_faults": tuple(
            draw(st.sampled_from((None, *POSITION_FAULTS))) if faulty else None for _ in range(num_tokens)
        ),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "mutation": draw(st.sampled_from(_mutation_names(pool))) if draw(ONE_IN_THREE) else None,
        "pool": pool,
        "v_norm": draw(st.sampled_from(PARAM_FLOATS)) if draw(ONE_IN_THREE) else None,
        "layer_tables": draw(ONE_IN_THREE),
    }
    if not pool:
        return Spec(**common, k_out=draw(st.sampled_from(OUT_KINDS)), v_out=draw(st.sampled_from(OUT_KINDS)))
    pool_dtype = draw(st.sampled_from((kv_dtype, *FP8, torch.int8)))
    scales = st.one_of(st.none(), st.floats(0.02, 4.0), st.sampled_from(PARAM_FLOATS))
    kinds = ("slot", "slot", "skip", *(SLOT_FAULTS if slot_faulty else ()))
    # An int8 pool always has its scales written; an FP8 pool in a third of the examples.
    written = pool_dtype == torch.int8 or (pool_dtype in FP8 and draw(ONE_IN_THREE))
    given = pool_dtype in FP8 and not written
    return Spec(
        **common,
        pool_layout=draw(st.sampled_from(tuple(POOL_LAYOUTS))),
        num_slots=draw(st.integers(0, 12)),
        pool_dtype=pool_dtype,
        k_scale=draw(scales) if given else None,
        v_scale=draw(scales) if given else None,
        scale_out=draw(st.sampled_from(("plain", "padded"))) if written else None,
        loc_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
        slot_kinds=tuple(draw(st.sampled_from(kinds)) for _ in range(num_tokens)),
    )


# --------------------------------------------------------------------------- guarded memory


class Arena:
    """Outputs and pools, each inside a larger byte buffer filled with `PATTERN`.

    Canary bytes (a random number of elements) sit before and after every
    allocation; `buffers` holds the whole buffers, so a comparison of them sees
    any stray write.
    """

    def __init__(self, device: torch.device, gen: torch.Generator) -> None:
        self.device = device
        self.gen = gen
        self.buffers: list[Tensor] = []

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        size = dtype.itemsize
        front, back = (size * int(n) for n in torch.randint(1, 9, (2,), generator=self.gen))
        payload = math.prod(shape) * size
        total = -(-(front + payload + back) // 8) * 8  # whole elements of every dtype
        pattern = torch.tensor(PATTERN, dtype=torch.uint8)
        buffer = pattern.repeat(total // len(PATTERN)).to(self.device)
        self.buffers.append(buffer)
        return buffer[front : front + payload].view(dtype).view(tuple(shape))

    def snapshot(self) -> list[Tensor]:
        return [buffer.clone() for buffer in self.buffers]

    def mirror(self, view: Tensor, copies: Sequence[Tensor]) -> Tensor:
        """The elements of ``copies`` (a `snapshot`) that ``view`` covers in its buffer."""
        address = view.untyped_storage().data_ptr()
        for buffer, copy in zip(self.buffers, copies, strict=True):
            if buffer.untyped_storage().data_ptr() == address:
                return copy.view(view.dtype).as_strided(view.shape, view.stride(), view.storage_offset())
        raise AssertionError("the view is not in the arena")

    def assert_equal(self, expected: Sequence[Tensor], what: str) -> None:
        for i, (buffer, want) in enumerate(zip(self.buffers, expected, strict=True)):
            differ = (buffer != want).nonzero().flatten()
            assert differ.numel() == 0, (
                f"{what}: buffer {i} ({buffer.numel()} bytes) differs at {differ.numel()} bytes, "
                f"first at byte {int(differ[0])}"
            )


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# --------------------------------------------------------------------------- one call


@dataclass
class Call:
    """A built call: its arguments by name, its memory, and what its values break."""

    spec: Spec
    args: dict[str, Any]
    arena: Arena
    inputs: list[Tensor]  # never written: kv's whole buffer, the parameters, the indices
    device: torch.device
    bad_positions: bool
    bad_slots: bool  # a slot >= S, or one used twice

    @property
    def other_device(self) -> torch.device:
        return torch.device("meta" if self.device.type == "cpu" else "cpu")

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        spec = self.spec
        return spec.num_layers, spec.num_tokens, spec.num_kv_heads, spec.head_dim

    @property
    def stacked(self) -> bool:
        return isinstance(self.args["k_pool"], Tensor)

    def run(self) -> tuple[Tensor, Tensor] | None:
        if self.spec.pool:
            typedkv.materialize_kv_into_pool(**self.args)
            return None
        return typedkv.materialize_kv(**self.args)

    def pool_like(
        self,
        *,
        layers: int | None = None,
        slots: int | None = None,
        heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> Tensor | list[Tensor]:
        """A pool of the call's kind (stacked or per-layer) with the given sizes changed."""
        spec = self.spec
        row = (
            spec.num_slots if slots is None else slots,
            spec.num_kv_heads if heads is None else heads,
            spec.head_dim if head_dim is None else head_dim,
        )
        num_layers = spec.num_layers if layers is None else layers
        dtype = self.args["k_pool"][0].dtype if dtype is None else dtype
        if self.stacked:
            return self.arena.alloc((num_layers, *row), dtype)
        return [self.arena.alloc(row, dtype) for _ in range(num_layers)]


def _place_kv(kv: Tensor, layout: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """``kv``'s values in a view of a larger NaN-filled buffer; returns ``(view, buffer)``."""
    num_tokens, num_layers, width = kv.shape
    shape = {
        "contiguous": (num_tokens, num_layers, width),
        "token-stride": (2 * num_tokens, num_layers, width),
        "layer-stride": (num_tokens, 2 * num_layers, width),
        "wide-row": (num_tokens, num_layers, width + 24),
        "offset-row": (num_tokens, num_layers, width + 40),
        "layer-major": (num_layers, num_tokens, width),
    }[layout]
    base = torch.full(shape, math.nan, dtype=kv.dtype, device=device)
    view = {
        "contiguous": lambda: base,
        "token-stride": lambda: base[::2],  # every other token
        "layer-stride": lambda: base[:, 1::2],  # every other layer
        "wide-row": lambda: base[:, :, :width],  # K/V columns of a wider projection
        "offset-row": lambda: base[:, :, 40:],  # after a Q block
        "layer-major": lambda: base.transpose(0, 1),  # stored [L, T, 2*H*D]
    }[layout]()
    view.copy_(kv)
    return view, base


def _scale(spec: ScaleSpec, num_layers: int, gen: torch.Generator, device: torch.device) -> float | Tensor | None:
    if spec is None or isinstance(spec, float):
        return spec
    return (torch.rand(num_layers, generator=gen, dtype=torch.float64) * 3.98 + 0.02).to(spec).to(device)


def build(spec: Spec, device: torch.device) -> Call:
    """The tensors of ``spec``: random values (never zeros) from its seed, on ``device``."""
    gen = torch.Generator().manual_seed(spec.seed)
    num_tokens, num_layers, heads, head_dim = spec.num_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim
    num_positions = spec.num_positions
    # Each (token, layer, K/V, head) row its own power-of-two scale: a norm taken
    # over the wrong axis shows.
    kv = torch.randn(num_tokens, num_layers, 2, heads, head_dim, generator=gen, dtype=torch.float64)
    kv = kv * torch.exp2(torch.randint(-4, 5, (num_tokens, num_layers, 2, heads, 1), generator=gen))
    kv_view, kv_base = _place_kv(
        kv.reshape(num_tokens, num_layers, 2 * heads * head_dim).to(spec.kv_dtype), spec.kv_layout, device
    )
    weight = (torch.rand(num_layers, head_dim, generator=gen, dtype=torch.float64) + 0.5).to(spec.weight_dtype)
    eps: float | Tensor
    if isinstance(spec.eps, torch.dtype):  # one per layer, 1e-6 to 1
        eps = torch.exp2(-20 * torch.rand(num_layers, generator=gen, dtype=torch.float64)).to(spec.eps).to(device)
    else:
        eps = spec.eps
    tables = (num_layers,) if spec.layer_tables else ()
    half = spec.rotary_dim // 2
    angles = torch.rand(*tables, num_positions, half, generator=gen, dtype=torch.float64) * (2 * math.pi)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(spec.cache_dtype)
    positions = torch.randint(0, max(num_positions, 1), (num_tokens,), generator=gen)
    big = 2**31 - 1 if spec.positions_dtype == torch.int32 else 2**40
    for token, fault in enumerate(spec.position_faults):
        if fault is not None:
            near = int(torch.randint(0, 3, (), generator=gen))
            faults = {"negative": -1 - near, "past": num_positions + near, "far-negative": -big - 1, "far-past": big}
            positions[token] = faults[fault]
    positions = positions.to(spec.positions_dtype)
    v_weight = None
    if spec.v_norm is not None:
        v_weight = (torch.rand(num_layers, head_dim, generator=gen, dtype=torch.float64) + 0.5).to(spec.v_norm)
    args: dict[str, Any] = {
        "kv": kv_view,
        "k_norm_weight": weight.to(device),
        "eps": eps,
        "cos_sin_cache": cache.to(device),
        "positions": positions.to(device),
        "num_kv_heads": heads,
        "rope_style": spec.rope_style,
        "v_norm_weight": None if v_weight is None else v_weight.to(device),
    }
    arena = Arena(device, gen)
    bad_positions = bool(((positions < 0) | (positions >= num_positions)).any())
    bad_slots = False
    if spec.pool:
        bases = POOL_LAYOUTS[spec.pool_layout].alloc(num_layers, spec.num_slots, heads, head_dim, spec.pool_dtype)
        guarded = [arena.alloc(base.shape, spec.pool_dtype) for base in bases]
        args["k_pool"], args["v_pool"] = POOL_LAYOUTS[spec.pool_layout].view(guarded, heads, head_dim)
        args["cache_loc"], bad_slots = _cache_loc(spec, gen)
        args["cache_loc"] = args["cache_loc"].to(device)
        args["k_scale"] = _scale(spec.k_scale, num_layers, gen, device)
        args["v_scale"] = _scale(spec.v_scale, num_layers, gen, device)
        for name, pool in (("k_scale_out", args["k_pool"]), ("v_scale_out", args["v_pool"])):
            args[name] = _scales_out(spec.scale_out, pool, arena)
    else:
        for name, kind in (("k_out", spec.k_out), ("v_out", spec.v_out)):
            if kind == "slab":
                slab = arena.alloc((num_layers, num_tokens + 3, heads, head_dim), spec.kv_dtype)
                args[name] = slab[:, :num_tokens]
            elif kind == "padded-slab":
                slab = arena.alloc((num_layers, num_tokens + 3, heads + 1, head_dim + 16), spec.kv_dtype)
                args[name] = slab[:, 1 : num_tokens + 1, :heads, :head_dim]
            else:
                args[name] = None
    inputs = [kv_base, *(arg for name in INPUTS if isinstance(arg := args.get(name), Tensor))]
    return Call(spec, args, arena, inputs, device, bad_positions, bad_slots)


def _scales_out(kind: str | None, pool: Tensor | Sequence[Tensor], arena: Arena) -> Tensor | list[Tensor] | None:
    """Scale tensors written per row for ``pool`` (``[L, S, H]``, or ``[S, H]`` per layer), in the arena: ``kind``
    "plain", or "padded" (each slot's row of scales one head wider); None without."""
    if kind is None:
        return None

    def one(shape: Sequence[int]) -> Tensor:
        if kind == "plain":
            return arena.alloc(shape, torch.float32)
        return arena.alloc((*shape[:-1], shape[-1] + 1), torch.float32)[..., 1:]

    if isinstance(pool, Tensor):
        return one(pool.shape[:-1])
    return [one(layer.shape[:-1]) for layer in pool]


def _cache_loc(spec: Spec, gen: torch.Generator) -> tuple[Tensor, bool]:
    """``cache_loc`` for ``spec.slot_kinds``, and whether debug mode must reject it."""
    num_slots = spec.num_slots
    free = torch.randperm(num_slots, generator=gen).tolist()
    big = 2**31 - 1 if spec.loc_dtype == torch.int32 else 2**40
    skips = (-1, -7, -big - 1)
    slots: list[int] = []
    for kind in spec.slot_kinds:
        used = [s for s in slots if s >= 0]
        pick = int(torch.randint(0, 1 << 30, (), generator=gen))
        if kind == "repeat" and used:
            slots.append(used[pick % len(used)])
        elif kind in ("slot", "repeat") and free:
            slots.append(free.pop())
        elif kind == "past":
            slots.append(num_slots + pick % 3)
        elif kind == "far-past":
            slots.append(big)
        else:
            slots.append(skips[pick % len(skips)])
    kept = [s for s in slots if s >= 0]
    bad = any(s >= num_slots for s in kept) or len(set(kept)) != len(kept)
    return torch.tensor(slots, dtype=spec.loc_dtype), bad


# --------------------------------------------------------------------------- misuse

Mutation = Callable[[Call], Blame | None]  # None: does not apply to this call (it stays valid)


def _put(call: Call, name: str, value: object, *blame: str) -> Blame:
    """Replace one argument; the error must then name ``blame`` (default: that argument) first."""
    call.args[name] = value
    return blame or (name,)


def _other_storage(dtype: torch.dtype) -> torch.dtype:
    return next(d for d in STORAGE if d != dtype)


def _out(call: Call, shape: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
    return call.arena.alloc(shape, call.spec.kv_dtype if dtype is None else dtype)


def _kv_strided_rows(call: Call) -> Blame | None:
    kv: Tensor = call.args["kv"]
    if kv.numel() == 0:
        return None  # an empty tensor has no stride to get wrong
    wide = torch.empty((*kv.shape[:2], 2 * kv.shape[2]), dtype=kv.dtype, device=call.device)[..., ::2]
    return _put(call, "kv", wide.copy_(kv))


def _pool_shape(call: Call) -> tuple[int, int, int, int]:
    spec = call.spec
    return spec.num_layers, spec.num_slots, spec.num_kv_heads, spec.head_dim


def _pool_strided_rows(call: Call) -> Blame | None:
    if call.spec.num_slots == 0:
        return None
    pool = call.pool_like(head_dim=2 * call.spec.head_dim)
    return _put(call, "k_pool", pool[..., ::2] if isinstance(pool, Tensor) else [t[..., ::2] for t in pool])


def _v_pool_layer_strides(call: Call) -> Blame | None:
    spec = call.spec
    if call.stacked or spec.num_layers == 1:
        return None
    layers = list(call.args["v_pool"])
    # H + 3 heads: a row stride no layout of test_pool gives (they pad by 1 head, 16 or 32 elements).
    padded = call.arena.alloc((spec.num_slots, spec.num_kv_heads + 3, spec.head_dim), layers[0].dtype)
    layers[-1] = padded[:, : spec.num_kv_heads]
    return _put(call, "v_pool", layers)


def _pool_other_device(call: Call) -> Blame:
    num_layers, *row = _pool_shape(call)
    dtype = call.args["k_pool"][0].dtype
    if call.stacked:
        return _put(call, "k_pool", torch.empty((num_layers, *row), dtype=dtype, device=call.other_device))
    return _put(call, "k_pool", [torch.empty(row, dtype=dtype, device=call.other_device) for _ in range(num_layers)])


def _swapped_pool(call: Call) -> Blame | None:
    num_layers, num_slots, heads, head_dim = _pool_shape(call)
    if not call.stacked or num_slots == num_layers:
        return None
    return _put(call, "k_pool", call.arena.alloc((num_slots, num_layers, heads, head_dim), call.args["k_pool"].dtype))


def _other_kind_pool(call: Call) -> Blame:
    """A per-layer V pool beside a stacked K pool, or the other way round."""
    if call.stacked:
        return _put(call, "v_pool", list(call.args["v_pool"]))
    return _put(call, "v_pool", call.arena.alloc(_pool_shape(call), call.args["v_pool"][0].dtype))


def _retyped_pools(call: Call, dtype: torch.dtype, blame: str = "k_pool") -> Blame:
    call.args["k_pool"] = call.pool_like(dtype=dtype)
    return _put(call, "v_pool", call.pool_like(dtype=dtype), blame)


def _scale_misuse(call: Call) -> Blame:
    if call.args["k_pool"][0].dtype not in FP8:
        return _put(call, "k_scale", 0.5)  # scales are for FP8 pools (and none beside scales written per row)
    return _put(call, "k_scale", torch.ones(call.spec.num_layers + 1, device=call.device))


def _written_scales(call: Call) -> tuple[Any, Any]:
    """Scale tensors written per row for the call's pools: float32, their shape without the last dim."""
    return tuple(_scales_out("plain", call.args[name], call.arena) for name in ("k_pool", "v_pool"))  # type: ignore[return-value]


def _scales_for_storage_pool(call: Call) -> Blame | None:
    """Scales written per row beside pools of kv's dtype (an FP8 or int8 pool takes them)."""
    if call.args["k_pool"][0].dtype != call.spec.kv_dtype:
        return None
    call.args["k_scale_out"], v_scales = _written_scales(call)
    return _put(call, "v_scale_out", v_scales, "k_scale_out")


def _retyped_int8(call: Call) -> Blame | None:
    """int8 pools, which take no call without scales written per row."""
    if call.spec.scale_out is not None:
        return None  # the call writes its scales: int8 pools are as valid as its own
    return _retyped_pools(call, torch.int8, "k_scale_out")


COMMON_MUTATIONS: dict[str, Mutation] = {
    "kv-float64": lambda c: _put(c, "kv", c.args["kv"].double()),
    "kv-int16": lambda c: _put(c, "kv", c.args["kv"].to(torch.int16)),
    "kv-flat": lambda c: _put(c, "kv", c.args["kv"].flatten(1)),
    "kv-narrow-rows": lambda c: _put(c, "kv", c.args["kv"][..., :-2]),
    "kv-strided-rows": _kv_strided_rows,
    "kv-tokens-layers-swapped": lambda c: (
        _put(c, "kv", c.args["kv"].transpose(0, 1), "kv", "k_norm_weight")
        if c.spec.num_tokens != c.spec.num_layers
        else None
    ),
    "k_norm_weight-extra-layer": lambda c: _put(
        c, "k_norm_weight", torch.rand(c.spec.num_layers + 1, c.spec.head_dim, device=c.device) + 0.5
    ),
    "k_norm_weight-transposed": lambda c: _put(c, "k_norm_weight", c.args["k_norm_weight"].t()),
    "k_norm_weight-int": lambda c: _put(c, "k_norm_weight", c.args["k_norm_weight"].to(torch.int32)),
    "k_norm_weight-1d": lambda c: _put(c, "k_norm_weight", c.args["k_norm_weight"][0]),
    "eps-extra-layer": lambda c: _put(c, "eps", torch.full((c.spec.num_layers + 1,), 1e-6, device=c.device)),
    "eps-int-tensor": lambda c: _put(c, "eps", torch.ones(c.spec.num_layers, dtype=torch.int32, device=c.device)),
    "eps-2d": lambda c: _put(c, "eps", torch.full((c.spec.num_layers, 1), 1e-6, device=c.device)),
    "eps-str": lambda c: _put(c, "eps", "1e-6"),
    "eps-bool": lambda c: _put(c, "eps", True),
    "eps-nan": lambda c: _put(c, "eps", float("nan")),
    "eps-negative-layer": lambda c: _put(c, "eps", [1e-6] * (c.spec.num_layers - 1) + [-1e-6]),
    "eps-none": lambda c: _put(c, "eps", None),
    "cos_sin_cache-odd-rotary-dim": lambda c: _put(c, "cos_sin_cache", c.args["cos_sin_cache"][..., :-1]),
    "cos_sin_cache-extra-layer": lambda c: _put(
        c, "cos_sin_cache", torch.rand(c.spec.num_layers + 1, c.spec.num_positions, c.spec.rotary_dim, device=c.device)
    ),
    "v_norm_weight-extra-layer": lambda c: _put(
        c, "v_norm_weight", torch.rand(c.spec.num_layers + 1, c.spec.head_dim, device=c.device) + 0.5
    ),
    "v_norm_weight-head-dim": lambda c: _put(
        c, "v_norm_weight", torch.rand(c.spec.num_layers, c.spec.head_dim + 8, device=c.device) + 0.5
    ),
    "v_norm_weight-int": lambda c: _put(
        c, "v_norm_weight", torch.ones(c.spec.num_layers, c.spec.head_dim, dtype=torch.int32, device=c.device)
    ),
    "v_norm_weight-other-device": lambda c: _put(
        c, "v_norm_weight", torch.ones(c.spec.num_layers, c.spec.head_dim, device=c.other_device)
    ),
    "cos_sin_cache-wider-than-head": lambda c: _put(
        c, "cos_sin_cache", torch.rand(c.spec.num_positions, c.spec.head_dim + 2, device=c.device)
    ),
    "cos_sin_cache-flat": lambda c: _put(c, "cos_sin_cache", c.args["cos_sin_cache"].flatten()),
    "cos_sin_cache-int": lambda c: _put(c, "cos_sin_cache", c.args["cos_sin_cache"].to(torch.int32)),
    "cos_sin_cache-other-device": lambda c: _put(c, "cos_sin_cache", c.args["cos_sin_cache"].to(c.other_device)),
    "positions-float": lambda c: _put(c, "positions", c.args["positions"].float()),
    "positions-int16": lambda c: _put(c, "positions", c.args["positions"].to(torch.int16)),
    "positions-extra-token": lambda c: _put(c, "positions", torch.nn.functional.pad(c.args["positions"], (0, 1))),
    "positions-2d": lambda c: _put(c, "positions", c.args["positions"][:, None]),
    "positions-list": lambda c: _put(c, "positions", c.args["positions"].tolist()),
    "positions-other-device": lambda c: _put(c, "positions", c.args["positions"].to(c.other_device)),
    "num_kv_heads-plus-one": lambda c: _put(
        c, "num_kv_heads", c.spec.num_kv_heads + 1, "kv", "k_out", "v_out", "k_pool", "v_pool"
    ),
    "num_kv_heads-zero": lambda c: _put(c, "num_kv_heads", 0),
    "num_kv_heads-float": lambda c: _put(c, "num_kv_heads", float(c.spec.num_kv_heads)),
    "num_kv_heads-bool": lambda c: _put(c, "num_kv_heads", True),
    "rope_style-unknown": lambda c: _put(c, "rope_style", "NeoX" if c.spec.rope_style == "neox" else "gpt-j"),
}


def _swapped_out(call: Call) -> Blame | None:
    num_layers, num_tokens, heads, head_dim = call.out_shape
    if num_tokens == num_layers:
        return None  # the swap would be invisible
    return _put(call, "k_out", _out(call, (num_tokens, num_layers, heads, head_dim)))


def _strided_out(call: Call) -> Blame | None:
    num_layers, num_tokens, heads, head_dim = call.out_shape
    if num_tokens == 0:
        return None
    return _put(call, "v_out", _out(call, (num_layers, num_tokens, heads, 2 * head_dim))[..., ::2])


def _expanded_out(call: Call) -> Blame | None:
    num_layers, num_tokens, heads, head_dim = call.out_shape
    if num_tokens < 2:
        return None  # one token: a broadcast dim of size 1 is an ordinary one
    return _put(call, "k_out", _out(call, (num_layers, 1, heads, head_dim)).expand(call.out_shape))


def _folded(call: Call, like: Tensor) -> Tensor | None:
    """A tensor of ``like``'s shape and dtype whose dim -2 has dim -3's stride: element ``(.., i + 1, j)`` is
    element ``(.., i, j + 1)`` (heads folded onto tokens or slots, or a page's slots onto its heads). None when
    those dims cannot fold (size 1)."""
    shape = tuple(like.shape)
    if len(shape) < 3 or shape[-2] < 2 or shape[-3] < 2 or 0 in shape:
        return None
    strides = [0] * len(shape)
    strides[-1], strides[-2], strides[-3] = 1, shape[-1], shape[-1]
    for i in range(len(shape) - 4, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1] + shape[-1] * shape[-2]
    extent = sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1
    return _out(call, (extent,), like.dtype).as_strided(shape, strides)


def _folded_out(call: Call) -> Blame | None:
    folded = _folded(call, torch.empty(call.out_shape, device="meta"))
    return None if folded is None else _put(call, "k_out", folded)


def _folded_pool(call: Call) -> Blame | None:
    """V's pool (its first layer, per layer) with elements at one address."""
    v_pool = call.args["v_pool"]
    folded = _folded(call, v_pool if call.stacked else v_pool[0])
    if folded is None:
        return None
    return _put(call, "v_pool", folded if call.stacked else [folded, *v_pool[1:]])


def _aliased_out(call: Call) -> Blame | None:
    if call.spec.num_tokens == 0:
        return None  # no element to share
    call.args["k_out"] = _out(call, call.out_shape)
    return _put(call, "v_out", call.args["k_out"])


def _overlapping_outs(call: Call) -> Blame | None:
    """v_out one element on from k_out in one buffer: their elements meet."""
    if call.spec.num_tokens == 0:
        return None  # no element to share
    n = math.prod(call.out_shape)
    flat = _out(call, (n + 1,))
    call.args["k_out"] = flat[:n].view(call.out_shape)
    return _put(call, "v_out", flat[1:].view(call.out_shape))


def _out_over_kv(call: Call) -> Blame | None:
    """k_out laid over kv from its first element on (a contiguous ``[L, T, H, D]`` fits in kv's span)."""
    kv: Tensor = call.args["kv"]
    if kv.numel() == 0:
        return None
    shape = call.out_shape
    strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    return _put(call, "k_out", kv.as_strided(shape, strides, kv.storage_offset()))


def _overlapping_pools(call: Call) -> Blame | None:
    """V's pool (its first layer's, per layer) one element on from K's in one buffer: their elements meet."""
    if call.spec.num_slots == 0 or call.spec.num_layers == 0:
        return None
    k_pool, v_pool = call.args["k_pool"], call.args["v_pool"]
    first = k_pool if call.stacked else k_pool[0]
    flat = _out(call, (first.numel() + 1,), first.dtype)
    k_first, v_first = flat[:-1].view(first.shape), flat[1:].view(first.shape)
    if call.stacked:
        call.args["k_pool"] = k_first
        return _put(call, "v_pool", v_first)
    call.args["k_pool"] = [k_first, *k_pool[1:]]
    return _put(call, "v_pool", [v_first, *v_pool[1:]])


def _resized_out(name: str, *, heads: int = 0, head_dim: int = 1) -> Mutation:
    """``name`` allocated with ``heads`` more heads or ``head_dim`` times the head dim."""

    def mutate(call: Call) -> Blame:
        num_layers, num_tokens, num_kv_heads, dim = call.out_shape
        return _put(call, name, _out(call, (num_layers, num_tokens, num_kv_heads + heads, dim * head_dim)))

    return mutate


def _retyped_out(name: str, dtype: torch.dtype | None = None) -> Mutation:
    """``name`` allocated with ``dtype`` (default: a storage dtype other than kv's)."""
    return lambda call: _put(call, name, _out(call, call.out_shape, dtype or _other_storage(call.spec.kv_dtype)))


DENSE_MUTATIONS: dict[str, Mutation] = {
    "k_out-tokens-layers-swapped": _swapped_out,
    "k_out-dtype": _retyped_out("k_out"),
    "v_out-float64": _retyped_out("v_out", torch.float64),
    "k_out-heads": _resized_out("k_out", heads=1),
    "v_out-head-dim": _resized_out("v_out", head_dim=2),
    "k_out-3d": lambda c: _put(c, "k_out", _out(c, (c.out_shape[0] * c.out_shape[1], *c.out_shape[2:]))),
    "k_out-list": lambda c: _put(c, "k_out", list(_out(c, c.out_shape))),
    "v_out-strided-rows": _strided_out,
    "k_out-expanded": _expanded_out,
    "k_out-folded": _folded_out,
    "v_out-is-k_out": _aliased_out,
    "v_out-overlaps-k_out": _overlapping_outs,
    "k_out-over-kv": _out_over_kv,
    "k_out-other-device": lambda c: _put(
        c, "k_out", torch.empty(c.out_shape, dtype=c.spec.kv_dtype, device=c.other_device)
    ),
}

POOL_MUTATIONS: dict[str, Mutation] = {
    "cache_loc-int16": lambda c: _put(c, "cache_loc", c.args["cache_loc"].to(torch.int16)),
    "cache_loc-float": lambda c: _put(c, "cache_loc", c.args["cache_loc"].double()),
    "cache_loc-extra-token": lambda c: _put(c, "cache_loc", torch.nn.functional.pad(c.args["cache_loc"], (0, 1))),
    "cache_loc-2d": lambda c: _put(c, "cache_loc", c.args["cache_loc"][None]),
    "cache_loc-list": lambda c: _put(c, "cache_loc", c.args["cache_loc"].tolist()),
    "cache_loc-other-device": lambda c: _put(c, "cache_loc", c.args["cache_loc"].to(c.other_device)),
    "k_pool-heads": lambda c: _put(c, "k_pool", c.pool_like(heads=c.spec.num_kv_heads + 1)),
    "k_pool-head-dim": lambda c: _put(c, "k_pool", c.pool_like(head_dim=2 * c.spec.head_dim)),
    "v_pool-slots": lambda c: _put(c, "v_pool", c.pool_like(slots=c.spec.num_slots + 1)),
    "k_pool-slots-layers-swapped": _swapped_pool,
    "k_pool-extra-layer": lambda c: _put(c, "k_pool", c.pool_like(layers=c.spec.num_layers + 1)),
    "k_pool-missing-layer": lambda c: _put(c, "k_pool", c.args["k_pool"][:-1]),
    "k_pool-layer-none": lambda c: _put(c, "k_pool", None if c.stacked else [None, *c.args["k_pool"][1:]]),
    "v_pool-other-kind": _other_kind_pool,
    "pools-other-storage-dtype": lambda c: _retyped_pools(c, _other_storage(c.spec.kv_dtype)),
    "pools-int8": _retyped_int8,
    "v_pool-dtype": lambda c: _put(
        c, "v_pool", c.pool_like(dtype=c.spec.kv_dtype if c.args["k_pool"][0].dtype in FP8 else FP8[0])
    ),
    "k_scale-misuse": _scale_misuse,
    "v_scale-int-tensor": lambda c: _put(
        c, "v_scale", torch.ones(c.spec.num_layers, dtype=torch.int32, device=c.device)
    ),
    "v_scale-2d": lambda c: _put(c, "v_scale", torch.ones(c.spec.num_layers, 1, device=c.device)),
    "k_scale-str": lambda c: _put(c, "k_scale", "0.5"),
    "v_scale-zero": lambda c: _put(c, "v_scale", 0.0) if c.args["k_pool"][0].dtype in FP8 else None,
    "k_pool-strided-rows": _pool_strided_rows,
    "v_pool-layer-strides": _v_pool_layer_strides,
    "v_pool-is-k_pool": lambda c: _put(c, "v_pool", c.args["k_pool"]) if c.spec.num_slots > 0 else None,
    "v_pool-overlaps-k_pool": _overlapping_pools,
    "v_pool-folded": _folded_pool,
    "k_pool-other-device": _pool_other_device,
    "scales-written-for-storage-pool": _scales_for_storage_pool,
    "v_scale_out-missing": lambda c: _put(c, "v_scale_out", None) if c.spec.scale_out else None,
    "k_scale-beside-written": lambda c: _put(c, "k_scale", 0.5) if c.spec.scale_out else None,
    "k_scale_out-bfloat16": lambda c: (
        _put(c, "k_scale_out", _retyped_scales(c.args["k_scale_out"])) if c.spec.scale_out else None
    ),
    "v_scale_out-other-kind": lambda c: (
        _put(c, "v_scale_out", _other_kind(c.args["v_scale_out"], c)) if c.spec.scale_out else None
    ),
}


def _retyped_scales(scales: Tensor | Sequence[Tensor]) -> Tensor | list[Tensor]:
    if isinstance(scales, Tensor):
        return scales.to(torch.bfloat16)
    return [t.to(torch.bfloat16) for t in scales]


def _other_kind(scales: Tensor | Sequence[Tensor], call: Call) -> Tensor | list[Tensor]:
    """Per-layer scale tensors beside stacked pools, or a stacked one beside per-layer pools."""
    if isinstance(scales, Tensor):
        return list(scales)
    return call.arena.alloc((len(scales), *scales[0].shape), torch.float32)


def _mutation_names(pool: bool) -> tuple[str, ...]:
    return (*COMMON_MUTATIONS, *(POOL_MUTATIONS if pool else DENSE_MUTATIONS))


MUTATIONS = {**COMMON_MUTATIONS, **DENSE_MUTATIONS, **POOL_MUTATIONS}


# --------------------------------------------------------------------------- the property


def check(spec: Spec, device: torch.device, *, misuse_only: bool = False) -> None:
    """One drawn call: either (a) it matches the oracle, or (b) it is rejected naming the culprit, writing nothing.

    ``misuse_only``: reject the example (for Hypothesis) when its misuse does not
    apply to the drawn call.
    """
    if device.type == "cuda" and device.index is None:
        # What tensors report (cuda:0), so that expected devices compare equal.
        device = torch.device("cuda", torch.cuda.current_device())
    call = build(spec, device)
    blame = MUTATIONS[spec.mutation](call) if spec.mutation is not None else None
    if misuse_only:
        assume(blame is not None)
    if blame is None and typedkv.debug_enabled():
        blame = ("positions",) if call.bad_positions else ("cache_loc",) if call.bad_slots else None
    if currently_in_test_context():  # for --hypothesis-show-statistics
        event("valid" if blame is None else f"rejected: {spec.mutation or blame[0]}")
        if spec.scale_out is not None:
            event(f"scales written per row, {spec.pool_dtype}")
    inputs = [t.clone() for t in call.inputs]
    before = call.arena.snapshot()
    try:
        result = call.run()
    except typedkv.InputError as err:
        if blame is None:
            raise AssertionError(f"a valid call was rejected: {err}") from err
        assert any(str(err).startswith((f"{name}:", f"{name}[")) for name in blame), (
            f"expected a message that names {' or '.join(blame)} first, got: {err}"
        )
        call.arena.assert_equal(before, "a rejected call wrote")
        _assert_unchanged(call.inputs, inputs)
        return
    assert blame is None, f"expected an InputError naming {' or '.join(blame)}, the call returned"
    _assert_unchanged(call.inputs, inputs)
    if spec.pool:
        _check_pool(call, before)
    else:
        assert result is not None
        _check_dense(call, result, before)


def _assert_unchanged(tensors: Sequence[Tensor], before: Sequence[Tensor]) -> None:
    for t, was in zip(tensors, before, strict=True):
        assert torch.equal(_bytes(t), _bytes(was)), "an input was written"


def _reference(call: Call) -> tuple[Tensor, Tensor]:
    """``tests/reference64.py`` on the call's inputs (on the CPU): K in float64, V in kv's dtype."""
    args = call.args
    eps = args["eps"].cpu() if isinstance(args["eps"], Tensor) else args["eps"]
    v_norm_weight = args["v_norm_weight"]
    return materialize_kv64(
        args["kv"].cpu(),
        args["k_norm_weight"].cpu(),
        eps,
        args["cos_sin_cache"].cpu(),
        args["positions"].cpu(),
        call.spec.num_kv_heads,
        call.spec.rope_style,
        v_norm_weight=None if v_norm_weight is None else v_norm_weight.cpu(),
    )


def _check_dense(call: Call, result: tuple[Tensor, Tensor], before: list[Tensor]) -> None:
    spec = call.spec
    expected = before
    for name, got in zip(("k_out", "v_out"), result, strict=True):
        given = call.args[name]
        assert given is None or got is given, f"{name} was given, another tensor was returned"
        assert (got.shape, got.dtype, got.device) == (call.out_shape, spec.kv_dtype, call.device), name
        if given is not None:
            call.arena.mirror(bits(given), expected).copy_(bits(given))
    call.arena.assert_equal(expected, "outside k_out/v_out")
    ref_k, ref_v = _reference(call)
    assert_k_close(result[0].cpu(), ref_k, spec.rotary_dim, spec.rope_style)
    if spec.v_norm is None:
        assert_bitwise_equal(result[1].cpu(), ref_v, "v")
    else:
        assert_v_normed(result[1].cpu(), ref_v)


def _layers(pool: Tensor | Sequence[Tensor]) -> Sequence[Tensor]:
    return pool.unbind(0) if isinstance(pool, Tensor) else pool


def _scale64(scale: float | Tensor | None, num_layers: int) -> Tensor:
    """Each layer's scale as the kernel reads it (float32), in float64."""
    if isinstance(scale, Tensor):
        return scale.cpu().float().double()
    return torch.full((num_layers,), 1.0 if scale is None else scale, dtype=torch.float32).double()


def _k_within(got: Tensor, ref: Tensor, spec: Spec, scale: Tensor, rotary_dim: int | None = None) -> Tensor:
    """Per element: ``got`` within the K tolerance of ``ref`` (float64, NaN rows included).

    16/32-bit: `ELEMENT_ULPS` ulps of the pair length (tests/test_numerics.py). FP8
    stores ``saturate(k / scale)`` of the float32 K: within one FP8 step of
    ``saturate(ref / scale)``, plus twice the 16/32-bit bound over the scale, plus
    one FP8 subnormal step. ``rotary_dim`` 0: a normed V's (nothing rotates).
    """
    info = torch.finfo(spec.kv_dtype)
    length = pair_length(ref, spec.rotary_dim if rotary_dim is None else rotary_dim, spec.rope_style)
    slack = ELEMENT_ULPS[spec.kv_dtype] * info.eps * length + 2 * info.smallest_normal * info.eps
    want = ref
    if got.dtype in FP8:
        fp8 = torch.finfo(got.dtype)
        per_layer = scale.view(-1, 1, 1, 1)
        want = (ref / per_layer).clamp(-fp8.max, fp8.max)
        slack = fp8.eps * want.abs() + 2 * slack / per_layer + fp8.smallest_normal * fp8.eps
    value = got.double()
    return torch.where(ref.isnan(), value.isnan(), (value - want).abs() <= slack)


def _assert_all(ok: Tensor, got: Tensor, want: Tensor, what: str) -> None:
    if not bool(ok.all()):
        i = tuple(int(j) for j in (~ok).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements wrong; first at [l, row, h, d] = {i}: "
            f"got {got[i].item()!r}, want {want[i].item()!r}"
        )


def _check_pool(call: Call, before: list[Tensor]) -> None:
    spec = call.spec
    tokens_of: dict[int, list[int]] = {}
    for token, slot in enumerate(call.args["cache_loc"].tolist()):
        if 0 <= slot < spec.num_slots:
            tokens_of.setdefault(slot, []).append(token)
    slots = sorted(tokens_of)
    index = torch.tensor(slots, dtype=torch.long, device=call.device)
    k_layers, v_layers = _layers(call.args["k_pool"]), _layers(call.args["v_pool"])
    written = [_layers(t) for t in (call.args["k_scale_out"], call.args["v_scale_out"]) if t is not None]
    expected = before
    # Copied as integers of the same width: indexing FP8 tensors is not implemented on every device.
    for layer in (*k_layers, *v_layers, *(t for scales in written for t in scales)):
        call.arena.mirror(bits(layer), expected)[index] = bits(layer)[index]
    call.arena.assert_equal(expected, "outside the pool rows cache_loc names")
    if not slots:
        return
    if written:
        _check_written(call, tokens_of, slots, index, (k_layers, v_layers), written)
        return
    ref_k, ref_v = _reference(call)
    got_k, got_v = (torch.stack([bits(t)[index] for t in ts]).cpu().view(ts[0].dtype) for ts in (k_layers, v_layers))
    v_scale = _scale64(call.args["v_scale"], spec.num_layers)
    if got_v.dtype in FP8 and spec.v_norm is None:
        ref_v = to_fp8(ref_v, v_scale.float(), got_v.dtype)
    k_scale = _scale64(call.args["k_scale"], spec.num_layers)
    ok_k = torch.zeros(got_k.shape, dtype=torch.bool)
    ok_v = torch.zeros(got_v.shape, dtype=torch.bool)
    # A slot named twice (production) races: each element may hold either token's value.
    depth = max(map(len, tokens_of.values()))
    for j in range(depth):
        tokens = [tokens_of[s][min(j, len(tokens_of[s]) - 1)] for s in slots]
        ok_k |= _k_within(got_k, ref_k[:, tokens], spec, k_scale)
        if spec.v_norm is None:
            ok_v |= bits(got_v) == bits(ref_v[:, tokens])
        elif got_v.dtype in FP8:  # normed in float32, rounded to kv's dtype, then quantized: as K, nothing rotated
            ok_v |= _k_within(got_v, ref_v[:, tokens], spec, v_scale, rotary_dim=0)
        else:
            ok_v |= v_normed_ok(got_v, ref_v[:, tokens])
    _assert_all(ok_k, got_k, ref_k[:, tokens], "k")
    _assert_all(ok_v, got_v, ref_v[:, tokens], "v")
    if depth == 1 and got_k.dtype not in FP8:
        assert_k_close(got_k, ref_k[:, tokens], spec.rotary_dim, spec.rope_style)


def _check_written(
    call: Call,
    tokens_of: dict[int, list[int]],
    slots: list[int],
    index: Tensor,
    pools: tuple[Sequence[Tensor], Sequence[Tensor]],
    written: list[Sequence[Tensor]],
) -> None:
    """Scales written per row: each named row's values and scale are the rule's for the dense op's K (run in
    production mode, so a bad position gives its NaN K) or V (normed where the call norms it; else kv's V bit for
    bit) of a token written there (either token's, where two race)."""
    args = call.args
    debug = typedkv.debug_enabled()
    typedkv.set_debug(False)
    try:
        k, v = typedkv.materialize_kv(
            args["kv"], args["k_norm_weight"], args["eps"], args["cos_sin_cache"], args["positions"],
            num_kv_heads=call.spec.num_kv_heads, rope_style=call.spec.rope_style,
            v_norm_weight=args["v_norm_weight"],
        )  # fmt: skip
    finally:
        typedkv.set_debug(debug)
    depth = max(map(len, tokens_of.values()))
    for rows, layers, scales, what in zip((k, v), pools, written, "kv", strict=True):
        stored, row_scales = quantized_rows(rows, layers[0].dtype)
        got = torch.stack([bits(t)[index] for t in layers]).cpu().view(layers[0].dtype)
        got_scales = torch.stack([t[index] for t in scales]).cpu()
        ok = torch.zeros(got.shape, dtype=torch.bool)
        ok_scales = torch.zeros(got_scales.shape, dtype=torch.bool)
        for j in range(depth):
            tokens = [tokens_of[s][min(j, len(tokens_of[s]) - 1)] for s in slots]
            ok |= _same(got, stored[:, tokens])
            ok_scales |= _same(got_scales, row_scales[:, tokens])
        _assert_all(ok, got, stored[:, tokens], f"{what} values")
        _assert_all(ok_scales, got_scales, row_scales[:, tokens], f"{what} scales")


def _same(got: Tensor, want: Tensor) -> Tensor:
    """Bit for bit, any NaN matching any NaN."""
    return (bits(got) == bits(want)) | (got.float().isnan() & want.float().isnan())


# --------------------------------------------------------------------------- tests

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(spec=specs(pool=False, max_tokens=CPU_TOKENS))
def test_materialize_kv(mode: str, spec: Spec) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    check(spec, CPU)


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(spec=specs(pool=True, max_tokens=CPU_TOKENS))
def test_materialize_kv_into_pool(mode: str, spec: Spec) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    check(spec, CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@GPU_FUZZ
@given(spec=specs(pool=False, max_tokens=GPU_TOKENS))
def test_materialize_kv_cuda(mode: str, spec: Spec) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    check(spec, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@GPU_FUZZ
@given(spec=specs(pool=True, max_tokens=GPU_TOKENS))
def test_materialize_kv_into_pool_cuda(mode: str, spec: Spec) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    check(spec, CUDA)


@pytest.mark.gpu
def test_fuzz_sample_under_memcheck() -> None:
    """compute-sanitizer's memcheck over a few drawn calls of each op and mode (tests/fuzz_sample.py)."""
    run_under_memcheck(Path(__file__).with_name("fuzz_sample.py"), ["--examples", "8"], "fuzz sample done", 900)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("pool", "mutation"),
    [(False, name) for name in _mutation_names(False)] + [(True, name) for name in _mutation_names(True)],
    ids=[f"dense-{name}" for name in _mutation_names(False)] + [f"pool-{name}" for name in _mutation_names(True)],
)
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_every_misuse(mode: str, pool: bool, mutation: str, data: st.DataObject) -> None:
    """Each misuse of `MUTATIONS` on a few drawn calls (the fuzz tests draw only some of them)."""
    assert typedkv.debug_enabled() == (mode == "debug")
    spec = data.draw(specs(pool=pool, max_tokens=CPU_TOKENS))
    check(replace(spec, mutation=mutation), CPU, misuse_only=True)


# --------------------------------------------------------------------------- the harness can fail


def _spec(**changes: Any) -> Spec:
    """A small valid call, for the tests of the harness itself."""
    spec = Spec(
        num_tokens=5,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        rotary_dim=16,
        num_positions=17,
        kv_dtype=torch.bfloat16,
        weight_dtype=torch.float32,
        cache_dtype=torch.float32,
        positions_dtype=torch.int64,
        eps=1e-6,
        rope_style="neox",
        kv_layout="token-stride",
        position_faults=(None,) * 5,
        seed=1,
        mutation=None,
        pool=False,
        k_out="slab",
        v_out="padded-slab",
        pool_layout="list_padded_heads",
        num_slots=9,
        slot_kinds=("slot", "skip", "slot", "slot", "slot"),
    )
    return replace(spec, **changes)


def _after_the_op(monkeypatch: pytest.MonkeyPatch, name: str, damage: Callable[[dict[str, Any]], None]) -> None:
    """Make ``typedkv.<name>`` call the real op, then ``damage`` its arguments."""
    real = getattr(typedkv, name)

    def broken(**args: Any) -> Any:
        result = real(**args)
        damage(args)
        return result

    monkeypatch.setattr(typedkv, name, broken)


def _poke(t: Tensor, offset: int = 0, steps: int = 1) -> None:
    """Add ``steps`` to the bits of the element ``offset`` elements past ``t``'s first, whatever holds it."""
    element = t.as_strided((1,), (1,), t.storage_offset() + offset)
    bits(element)[0] += steps


def test_harness_sees_a_write_next_to_k_out(monkeypatch: pytest.MonkeyPatch) -> None:
    _after_the_op(monkeypatch, "materialize_kv", lambda args: _poke(args["k_out"], -1))
    with pytest.raises(AssertionError, match="outside k_out/v_out"):
        check(_spec(), CPU)


def test_harness_sees_a_wrong_k(monkeypatch: pytest.MonkeyPatch) -> None:
    _after_the_op(monkeypatch, "materialize_kv", lambda args: args["k_out"].mul_(1.05))
    with pytest.raises(AssertionError, match="out of tolerance"):
        check(_spec(), CPU)


def test_harness_sees_one_v_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    _after_the_op(monkeypatch, "materialize_kv", lambda args: _poke(args["v_out"]))
    with pytest.raises(AssertionError, match=r"^v: 1 of"):
        check(_spec(), CPU)


@pytest.mark.production
def test_harness_sees_a_missing_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Production: a token whose position is past the cache must get NaN K."""
    _after_the_op(monkeypatch, "materialize_kv", lambda args: args["k_out"].nan_to_num_(0.0))
    with pytest.raises(AssertionError, match="NaN pattern differs"):
        check(_spec(position_faults=(None, "past", None, None, None)), CPU)


def test_harness_sees_a_missing_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debug mode: a position past the cache must be rejected."""
    real = typedkv.materialize_kv

    def production(**args: Any) -> Any:
        typedkv.set_debug(False)
        try:
            return real(**args)
        finally:
            typedkv.set_debug(True)

    monkeypatch.setattr(typedkv, "materialize_kv", production)
    with pytest.raises(AssertionError, match="expected an InputError naming positions"):
        check(_spec(position_faults=(None, "past", None, None, None)), CPU)


def test_harness_sees_the_wrong_argument_blamed(monkeypatch: pytest.MonkeyPatch) -> None:
    def blame_kv(**args: Any) -> Any:
        raise typedkv.InputError("kv: made up")

    monkeypatch.setattr(typedkv, "materialize_kv", blame_kv)
    with pytest.raises(AssertionError, match="names positions first"):
        check(_spec(mutation="positions-float"), CPU)


def test_harness_sees_a_write_before_a_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    real = typedkv.materialize_kv_into_pool

    def write_then_check(**args: Any) -> None:
        _poke(args["k_pool"][0])
        real(**args)

    monkeypatch.setattr(typedkv, "materialize_kv_into_pool", write_then_check)
    with pytest.raises(AssertionError, match="a rejected call wrote"):
        check(_spec(pool=True, mutation="positions-float"), CPU)


def test_harness_sees_a_write_to_a_row_no_token_names(monkeypatch: pytest.MonkeyPatch) -> None:
    def damage(args: dict[str, Any]) -> None:
        named = set(args["cache_loc"].tolist())
        _poke(args["v_pool"][1][min(set(range(9)) - named)])

    _after_the_op(monkeypatch, "materialize_kv_into_pool", damage)
    with pytest.raises(AssertionError, match="outside the pool rows"):
        check(_spec(pool=True), CPU)


@pytest.mark.parametrize("scale_out", ["plain", "padded"])
def test_harness_sees_a_written_scale_one_bit_off(monkeypatch: pytest.MonkeyPatch, scale_out: str) -> None:
    def damage(args: dict[str, Any]) -> None:
        _poke(args["k_scale_out"][1][int(args["cache_loc"][0])])

    _after_the_op(monkeypatch, "materialize_kv_into_pool", damage)
    with pytest.raises(AssertionError, match=r"^k scales: 1 of"):
        check(_spec(pool=True, pool_dtype=torch.int8, scale_out=scale_out), CPU)


def test_harness_sees_a_scale_written_for_a_skipped_token(monkeypatch: pytest.MonkeyPatch) -> None:
    def damage(args: dict[str, Any]) -> None:
        free = sorted(set(range(9)) - set(args["cache_loc"].tolist()))[0]
        _poke(args["v_scale_out"][0][free])

    _after_the_op(monkeypatch, "materialize_kv_into_pool", damage)
    with pytest.raises(AssertionError, match="outside the pool rows cache_loc names"):
        check(_spec(pool=True, pool_dtype=torch.float8_e5m2, scale_out="plain"), CPU)


def test_harness_sees_an_int8_value_one_step_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def damage(args: dict[str, Any]) -> None:
        _poke(args["v_pool"][0][int(args["cache_loc"][2])])

    _after_the_op(monkeypatch, "materialize_kv_into_pool", damage)
    with pytest.raises(AssertionError, match=r"^v values: 1 of"):
        check(_spec(pool=True, pool_dtype=torch.int8, scale_out="padded"), CPU)


@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_harness_sees_an_fp8_k_three_steps_off(monkeypatch: pytest.MonkeyPatch, pool_dtype: torch.dtype) -> None:
    def damage(args: dict[str, Any]) -> None:
        _poke(args["k_pool"][1][int(args["cache_loc"][0])], steps=3)

    _after_the_op(monkeypatch, "materialize_kv_into_pool", damage)
    with pytest.raises(AssertionError, match=r"^k: 1 of"):
        check(_spec(pool=True, pool_dtype=pool_dtype, k_scale=0.3), CPU)
