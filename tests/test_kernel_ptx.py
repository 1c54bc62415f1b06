"""Every launch the public K/V and MLA calls make compiles for Hopper (sm_90), without a GPU.

Triton's interpreter runs a kernel's Python, so code the compiler rejects can
pass the interpreted suite (a tuple's constexprs unpacked into plain names, for
one: fine interpreted, an error compiled on Triton 3.6). The launches are those
of benchmarks/ptx_snapshot.py (the refactoring tool that compares the machine
code before and after a change), captured from public calls on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
import triton
import triton.language as tl

from typedkv.core import launcher
from typedkv.kv import launch as kv_launch

pytestmark = pytest.mark.skipif(launcher.INTERPRETED, reason="the interpreter runs the kernel's Python, not a compiler")

_TOOL = Path(__file__).parents[1] / "benchmarks" / "ptx_snapshot.py"


def _snapshot() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ptx_snapshot", _TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case_names() -> list[str]:
    if launcher.INTERPRETED:
        return []
    # The small batch splits K and V into programs of their own; the large one does not.
    return [name for name in _snapshot().cases() if "-T16-" in name or "T8192-neox-R64" in name]


@pytest.mark.parametrize("case", _case_names())
def test_launch_compiles_for_hopper(case: str) -> None:
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    ptx = snapshot.compile_ptx(kernel, params, num_warps)
    assert f".entry {kernel.fn.__name__}" in ptx
    if "bf16" in case or case.startswith("dense"):
        # Rows move in vectors: 16 bytes a thread at a time, or 8 where the smallest batches' K and V
        # programs take 8 warps (`typedkv.kv.launch.launch_params`) over a head row of 8 * 128 elements.
        widths = ("v4", "v2") if num_warps == 8 else ("v4",)
        assert any(f"ld.global.{w}" in ptx or f"ld.global.nc.{w}" in ptx for w in widths)


def test_snapshot_ignores_source_locations() -> None:
    ptx = '.file 1 "a.py"\n\t.loc 1 2 3\n$L__tmp4:\n\tmov.u32 %r1, 0; // a comment\n'
    assert _snapshot().normalise(ptx) == "\tmov.u32 %r1, 0;\n"


@pytest.mark.parametrize(
    "case",
    ["fused-T16-dense-neox-R128", "fused-T16-dense-gptj-R64", "fused-T16-list-fp8e4nv", "fused-T8192-NHD16-bf16"],
)
def test_fused_early_rope_compiles_for_hopper(case: str) -> None:
    """The fused kernel compiles with its RoPE rows loaded before the GEMM loop and after it (`ProjectionConfig`).

    The defaults load them early up to T = 16 only (`typedkv.projection.tuning.PROJECTION_BLOCKS`);
    the other order is compiled here too, and differs.
    """
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    at = kernel.arg_names.index("EARLY_ROPE")
    assert params[at] is case.startswith("fused-T16-")  # the default, as captured
    ptx = {
        early: snapshot.compile_ptx(kernel, (*params[:at], early, *params[at + 1 :]), num_warps)
        for early in (False, True)
    }
    assert all(".entry project_kv_kernel" in text for text in ptx.values())
    assert ptx[False] != ptx[True]


@pytest.mark.parametrize("case", ["dense-T8192-neox-R128", "pool-T8192-NHD16-bf16", "dense-T8192-D256-R64"])
def test_v_first_issues_every_load_before_a_store(case: str) -> None:
    """`KVConfig.v_first`, K and V in one program: V's loads come before K's first store in the PTX.

    On by default (measured faster on the H200, `typedkv.kv.launch.KVConfig`); the compiler
    keeps a load after a store that may alias it, which is what the option is for.
    """
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    at = kernel.arg_names.index("V_FIRST")
    assert params[at] is True  # the default, as captured
    for v_first in (False, True):
        ptx = snapshot.compile_ptx(kernel, (*params[:at], v_first, *params[at + 1 :]), num_warps)
        ops = re.findall(r"\b(ld|st)\.global", ptx)
        loads_first = ops.index("st") == ops.count("ld")
        assert loads_first is v_first


@pytest.mark.parametrize(
    "case", ["fused-T16-list-fp8e4nv-tensor", "fused-T16-dense-eps-per-layer", "fused-T16-HND16-bf16"]
)
def test_fused_early_loads_compiles_for_hopper(case: str) -> None:
    """`ProjectionConfig.early_loads` (the epilogue's table entry, scales, eps, norm weights before the loop).

    On by default up to T = 32 (`typedkv.projection.tuning.PROJECTION_BLOCKS`); both ways compile for
    sm_90, and differ.
    """
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    at = kernel.arg_names.index("EARLY_LOADS")
    assert params[at] is True  # the default at T = 16, as captured
    ptx = {
        early: snapshot.compile_ptx(kernel, (*params[:at], early, *params[at + 1 :]), num_warps)
        for early in (False, True)
    }
    assert all(".entry project_kv_kernel" in text for text in ptx.values())
    assert ptx[False] != ptx[True]


@pytest.mark.parametrize("case", ["dense-T16-neox-R128", "fused-T16-list-fp8e4nv-tensor", "mla-T16-dense-bf16"])
def test_programmatic_launch_waits_first(case: str) -> None:
    """On Hopper every launch is a programmatic dependent one (`typedkv.core.launcher.programmatic_launch`):
    the kernel's first instruction that touches memory is ``griddepcontrol.wait`` (WAIT_PRIOR), and
    without it there is none (the CPU capture here, as on GPUs before Hopper)."""
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    at = kernel.arg_names.index("WAIT_PRIOR")
    assert params[at] is False
    for wait in (False, True):
        ptx = snapshot.compile_ptx(kernel, (*params[:at], wait, *params[at + 1 :]), num_warps)
        first = re.search(r"griddepcontrol\.wait|\b(ld|st|atom|red)\.global", ptx)
        assert first is not None and (first.group(0) == "griddepcontrol.wait") is wait


@pytest.mark.parametrize("case", ["pool-T8192-list-bf16", "fused-T16-list-bf16", "pool-T8192-list-fp8e4nv"])
def test_per_layer_pools_store_whole_vectors(case: str) -> None:
    """Per-layer pools whose layers start on 16 bytes (as the caught ones here): the stores are vectors,
    as for one stacked pool; the table's offsets are then multiples of 16 bytes (`LAYER_TABLE`), and with
    a multiple of 1 (a layer off 16 bytes) the stores are element by element."""
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    at = kernel.arg_names.index("LAYER_TABLE")
    assert params[at] == 16 // (1 if "fp8" in case else 2)
    for multiple in (params[at], 1):
        ptx = snapshot.compile_ptx(kernel, (*params[:at], multiple, *params[at + 1 :]), num_warps)
        stores = set(re.findall(r"st\.global(?:\.v\d)?\.b(?:8|16|32|64)\b", ptx))
        narrow = {"st.global.b8", "st.global.b16"}
        assert (stores & narrow == set()) is (multiple > 1), stores


@triton.jit
def _no_wait(x_ptr, LAST: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations: none here
    tl.store(x_ptr, tl.load(x_ptr) + LAST)


def test_only_a_kernel_that_waits_launches_programmatically() -> None:
    """`KernelLaunch` launches programmatically a kernel whose ``WAIT_PRIOR`` is set, and no other kernel
    (one launched so without its wait could read the prior kernel's output before it is written)."""
    snapshot = _snapshot()
    ((kernel, grid, params, num_warps),) = snapshot.capture(snapshot.cases()["dense-T16-neox-R128"])
    arguments = dict(zip(kernel.arg_names, params, strict=True))
    waits = {**arguments, "WAIT_PRIOR": True}
    assert launcher.KernelLaunch(kernel, grid, waits, kv_launch.VALUES, num_warps).programmatic
    assert not launcher.KernelLaunch(kernel, grid, arguments, kv_launch.VALUES, num_warps).programmatic  # on CPU
    no_wait = {"x_ptr": torch.zeros(1), "LAST": True}
    assert not launcher.KernelLaunch(_no_wait, (1, 1, 1), no_wait, ("x_ptr",), 1).programmatic


@pytest.mark.parametrize("num_tokens", [16, 64])
@pytest.mark.parametrize("where", ["dense", "list"])
def test_fused_overlaps_its_neighbours_on_hopper(num_tokens: int, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched as on an H200 (weights by TMA, programmatic dependent launches), the fused kernel lets the next
    kernel launch once its weight loops are done (`ProjectionConfig.signal_next`), and from T = 17 asks L2 for
    its first weight columns before it waits for the prior kernel (`ProjectionConfig.l2_before_wait`): nothing
    but those requests comes before the wait, and no weight tile is loaded after the signal."""
    pytest.importorskip("triton.backends.nvidia")
    from typedkv.projection import fused as fused_impl

    snapshot = _snapshot()
    snapshot.as_on_hopper(monkeypatch.setattr)
    monkeypatch.setattr(launcher, "programmatic_launch", lambda device: True)
    monkeypatch.setattr(fused_impl, "_LAUNCHES", {})
    pool = None if where == "dense" else snapshot._pool_alloc(num_tokens, where, torch.bfloat16, None)
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot._fused(num_tokens, pool=pool))
    names = kernel.arg_names
    assert params[names.index("W_TMA")] is True and params[names.index("WAIT_PRIOR")] is True
    assert params[names.index("SIGNAL_NEXT")] is True
    assert params[names.index("L2_BEFORE_WAIT")] == (128 if num_tokens > 16 else 0)
    lines = snapshot.compile_ptx(kernel, params, num_warps).splitlines()

    def at(pattern: str) -> list[int]:
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]

    (wait,) = at(r"griddepcontrol\.wait")
    memory = at(r"\b(ld|st|atom|red)\.global|cp\.async")
    prefetches = at(r"prefetch\.global\.L2")
    assert memory and wait < memory[0]
    assert len(prefetches) == (0 if num_tokens <= 16 else 128 * 2 // (num_warps * 32))
    assert all(p < wait for p in prefetches)
    # One signal in K's programs and one in V's, each after its weight loop: the tile loads
    # that follow a signal are the other head's (before its next signal), none after the last.
    signals = at(r"griddepcontrol\.launch_dependents")
    tiles = at(r"cp\.async\.bulk\.tensor")
    assert len(signals) == 2 and tiles and tiles[0] < signals[0]
    assert not [t for t in tiles if t > signals[1]]
    stores = at(r"\bst\.global")
    assert stores and not [t for t in tiles if signals[0] < t < min(s for s in stores if s > signals[0])]


@pytest.mark.parametrize("case", ["pool-T8192-flat-i8-written", "pool-T16-flat-i8-written"])
def test_int8_pools_convert_in_one_instruction(case: str) -> None:
    """An int8 pool's values are rounded, saturated and converted by ``cvt.rni.sat.s8.f32`` (what the
    interpreter's software rounding computes, in one instruction), and written scales take 2 warps a
    program where K and V share one (the small batch's split programs keep the other pools' warps)."""
    pytest.importorskip("triton.backends.nvidia")
    snapshot = _snapshot()
    ((kernel, _, params, num_warps),) = snapshot.capture(snapshot.cases()[case])
    ptx = snapshot.compile_ptx(kernel, params, num_warps)
    assert "cvt.rni.sat.s8.f32" in ptx
    assert (num_warps == 2) == ("T8192" in case)
