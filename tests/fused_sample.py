"""The fused projection path's calls as a plain script, for ``compute-sanitizer``.

`KVMaterializer` pinned to ``projection_path="fused"`` writes dense outputs and
every pool layout (flat, NHD and HND pages, per-layer lists, the halves of one
allocation, FP8 with float and ``[L]`` scales), at token counts on both sides of
the kernel's token blocks, hidden widths that are not a multiple of its K step,
positions outside the cos/sin cache and slots that are negative or past the
pool. Every destination sits inside a larger allocation whose bytes around it
are guards: after each call the guards are unchanged, dense K/V hold the
float64 oracle (`tests/test_fused_projection.py`'s, one ulp), and pools hold
exactly what the GEMM + kernel path writes. With memcheck watching, an access
out of bounds that lands in no guarded byte is seen too.

Run from the repository root on a CUDA machine::

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/fused_sample.py --device cuda

It prints ``fused sample done`` at the end; memcheck adds ``ERROR SUMMARY: 0 errors``.
``--device cpu`` runs it under ``TRITON_INTERPRET=1`` (float16, as the interpreter's
``tl.dot`` on bfloat16 is wrong). ``tests/test_gpu_fused.py::test_fused_sample_under_memcheck``
(``gpu``) runs it under memcheck.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from test_fused_projection import _POOLS, Draft, H, L, P, S, _layers, assert_matches_oracle

import typedkv

GUARD = 4096  # bytes before and after every destination
FILL = 0x35  # finite in every pool dtype


class Guarded:
    """Tensors carved out of one allocation, ``GUARD`` filled bytes before, between and after them."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        size = dtype.itemsize
        sizes = [math.prod(shape) * size for shape in shapes]
        self.memory = torch.full((sum(sizes) + GUARD * (len(shapes) + 1),), FILL, dtype=torch.uint8, device=device)
        self.tensors: list[torch.Tensor] = []
        self.guards: list[tuple[int, int]] = [(0, GUARD)]
        at = GUARD
        for shape, nbytes in zip(shapes, sizes, strict=True):
            self.tensors.append(self.memory[at : at + nbytes].view(dtype).view(shape))
            at += nbytes
            self.guards.append((at, at + GUARD))
            at += GUARD

    def guards_intact(self) -> bool:
        return all(bool((self.memory[lo:hi] == FILL).all()) for lo, hi in self.guards)


def _pools(layout: str, dtype: torch.dtype, device: torch.device) -> tuple[Guarded, Any, Any, typedkv.KVLayout | None]:
    """K and V pools of ``layout`` (tests/test_fused_projection.py's) carved from one guarded allocation,
    K's tensors first, then V's."""
    k_pool, _, kv_layout = _POOLS[layout](dtype)  # read for their shapes only
    per_layer = not isinstance(k_pool, torch.Tensor)
    shapes = [tuple(t.shape) for t in _layers(k_pool)]
    memory = Guarded(shapes * 2, dtype, device)
    k, v = memory.tensors[: len(shapes)], memory.tensors[len(shapes) :]
    return memory, (k if per_layer else k[0]), (v if per_layer else v[0]), kv_layout


def _positions_out_of_range(positions: torch.Tensor) -> torch.Tensor:
    """Two tokens' positions outside ``[0, P)``: K is NaN there, and nothing is read out of bounds."""
    positions = positions.clone()
    positions[0] = P + 3
    if positions.shape[0] > 1:
        positions[-1] = -2
    return positions


def dense_cases() -> Iterator[tuple[str, dict[str, Any], int]]:
    for num_tokens in (1, 15, 17, 33, 70):
        yield f"T={num_tokens}", {}, num_tokens
    yield (
        "hidden=200 gptj partial rotary bias",
        {"hidden": 200, "rope_style": "gptj", "rotary_dim": 8, "bias": True},
        19,
    )
    yield "rope only", {"norm": False}, 9
    yield "head_dim 32 rotary 4", {"head_dim": 32, "rotary_dim": 4}, 5
    yield "V normed, a table per layer", {"v_norm": True, "layer_tables": True, "rotary_dim": 8}, 19
    # From T = 33 with whole pieces of 16 rows: the weights by TMA (Hopper; the interpreter), above 64 in
    # bands (blocks of 64 tokens up to 256, three stages from 129, then of 128); hidden's last step past
    # the weight's columns.
    for num_tokens in (40, 70, 200, 300):
        yield f"head_dim 32 T={num_tokens} TMA", {"head_dim": 32, "rotary_dim": 32, "hidden": 80}, num_tokens
    yield "head_dim 32 T=70 TMA, V normed", {"head_dim": 32, "rotary_dim": 32, "hidden": 80, "v_norm": True}, 70


def run_dense(device: torch.device, dtype: torch.dtype) -> None:
    for name, kw, num_tokens in dense_cases():
        draft = Draft(dtype, **kw)
        draft.m.to(device)
        draft.m.projection_path = "fused"
        check_dense(name, draft, num_tokens, device)


def check_dense(name: str, draft: Draft, num_tokens: int, device: torch.device) -> None:
    """Two calls of ``draft``'s materializer into guarded dense outputs: the float64 oracle's K/V, then with
    positions outside the cache NaN in their K, V as before; the guards intact after each."""
    x, positions = draft.call(num_tokens)
    shape = (L, num_tokens, H, draft.head_dim)
    out = Guarded([shape, shape], draft.dtype, device)
    draft.m(x.to(device), positions.to(device), k_out=out.tensors[0], v_out=out.tensors[1])
    assert out.guards_intact(), f"dense {name}: a guard byte changed"
    got = (out.tensors[0].cpu(), out.tensors[1].cpu())
    assert_matches_oracle(got, draft.oracle(x, positions), draft.dtype)
    bad = _positions_out_of_range(positions)
    draft.m(x.to(device), bad.to(device), k_out=out.tensors[0], v_out=out.tensors[1])
    assert out.guards_intact(), f"dense {name}, positions out of range: a guard byte changed"
    assert torch.equal(out.tensors[1].cpu(), got[1])
    assert bool(out.tensors[0][:, 0].isnan().all()), f"dense {name}: K of an out-of-range position is not NaN"


SCALES: dict[str, dict[str, Any]] = {
    "no scale": {},
    "float scales": {"k_scale": 0.25, "v_scale": 2.0},
    "tensor scales": {"k_scale": [0.5, 0.125, 1.0], "v_scale": [2.0, 1.0, 0.25]},
}


def pool_cases() -> Iterator[tuple[str, str, torch.dtype | None, str]]:
    """(name, layout, pool dtype (None: the draft's), scales)."""
    for layout in _POOLS:
        yield layout, layout, None, "no scale"
    for layout in ("flat", "NHD", "list"):
        for scales in SCALES:
            yield f"{layout} fp8 {scales}", layout, torch.float8_e4m3fn, scales
    yield "HND fp8 e5m2", "HND", torch.float8_e5m2, "float scales"


def run_pools(device: torch.device, dtype: torch.dtype) -> None:
    # Slots: negative (skipped), one == S and one far past it (skipped in production), the rest distinct.
    cache_loc = torch.tensor([3, -1, 17, 23, S, 0, 9, -5, 12, 8, 10**6, 20, 1])
    for name, layout, pool_dtype, scales in pool_cases():
        draft = Draft(dtype, rotary_dim=8, bias=True, norm=pool_dtype is None)
        draft.m.to(device)
        x, positions = draft.call(cache_loc.shape[0])
        positions = _positions_out_of_range(positions)
        kw = {k: (torch.tensor(v, device=device) if isinstance(v, list) else v) for k, v in SCALES[scales].items()}
        written = []
        for path in ("fused", "gemm"):
            memory, k_pool, v_pool, kv_layout = _pools(layout, pool_dtype or dtype, device)
            draft.m.projection_path = path
            draft.m.into_pool(
                x.to(device), positions.to(device), cache_loc.to(device), k_pool, v_pool, kv_layout=kv_layout, **kw
            )
            assert memory.guards_intact(), f"pool {name}, {path} path: a guard byte changed"
            written.append(memory)
        _same_pools(name, *written)


def _same_pools(name: str, fused: Guarded, gemm: Guarded) -> None:
    """The fused path's pools against GEMM + kernel's: V bit for bit, K within one storage step of each row's
    largest value (their RMSNorms sum a row in other orders). Rows no token names hold the fill in both
    (tests/test_fused_projection.py checks that the GEMM path leaves them so)."""
    half = len(fused.tensors) // 2
    for i, (a, b) in enumerate(zip(fused.tensors, gemm.tensors, strict=True)):
        a, b = a.cpu(), b.cpu()
        if i >= half:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"pool {name}: V differs from GEMM + kernel"
            continue
        a64, b64 = a.double(), b.double()
        assert torch.equal(a64.isnan(), b64.isnan()), f"pool {name}: K's NaNs differ from GEMM + kernel"
        step = torch.finfo(a.dtype).eps
        scale = b64.nan_to_num().abs().amax(-1, keepdim=True)
        error = (a64 - b64).abs().nan_to_num()
        assert bool((error <= step * scale).all()), f"pool {name}: K differs from GEMM + kernel by more than a step"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (under TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float16,)
    typedkv.set_debug(False)  # production: slots past the pool are skipped, not rejected
    start = time.perf_counter()
    for dtype in dtypes:
        run_dense(device, dtype)
        print(f"dense outputs, {dtype}: {sum(1 for _ in dense_cases())} cases passed", flush=True)
        run_pools(device, dtype)
        print(f"pools, {dtype}: {sum(1 for _ in pool_cases())} cases passed", flush=True)
    print(f"fused sample done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
