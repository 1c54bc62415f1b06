"""A direct launch through Triton 3.6's C launch (`typedkv.core.launcher._unwrapped_launch`), on stand-ins.

On a GPU with Triton 3.6 a layout's later calls skip its launcher's per-launch Python: the
C launch takes Triton's 13 leading arguments, then the kernel's, each TMA descriptor as
its encoding, shape and strides. tests/test_gpu.py and tests/test_gpu_fused.py check the
results there. These tests run anywhere: which launchers are taken (a stand-in for Triton
3.6's driver module and launcher), and what a fused launch passes, each weight descriptor
encoded once per weight address.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from test_fused_projection import INTERPRETED, Draft, _launch_for

from typedkv.core import launcher
from typedkv.projection import launch as fused_launch
from typedkv.projection import tuning


class _Run:
    """A stand-in of Triton 3.6's launcher (`CudaLauncher`): its launch and the fields a direct call reads."""

    def __init__(self, launch: Any, scratch: int = 0) -> None:
        self.launch = launch
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True


def _wrapped(launcher: Any, tensordesc_indices: set[int], tensordesc_meta: list[Any]) -> Any:
    """Triton 3.6's launch of a kernel that takes descriptors: a closure over its C launch."""

    def inner(*args: Any) -> Any:
        return launcher, tensordesc_indices, tensordesc_meta

    return inner


def _compiled(run: _Run) -> Any:
    return types.SimpleNamespace(run=run, function=1234, packed_metadata="meta")


@pytest.fixture
def triton36(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Triton 3.6's driver module, as `_unwrapped_launch` reads it; returns the descriptors it encodes."""
    encoded: list[Any] = []

    def make_tensordesc_arg(arg: Any, metadata: Any) -> list[Any]:
        encoded.append(arg)
        return [("map", arg.base.data_ptr(), tuple(arg.block_shape)), *arg.shape, *arg.strides]

    driver = types.SimpleNamespace(_BASE_ARGS_FORMAT_LEN=13, make_tensordesc_arg=make_tensordesc_arg)
    monkeypatch.setattr(launcher, "_nvidia_driver", lambda: driver)
    return encoded


@pytest.mark.usefixtures("triton36")
def test_launchers_taken_on_triton_36() -> None:
    c_launch = len  # a C function: no __code__
    assert launcher._unwrapped_launch(_compiled(_Run(c_launch)), ()) == (c_launch, [], (False, True))
    # A launcher that asks for scratch memory, or a launch in Python where no descriptor is taken: Triton's own.
    assert launcher._unwrapped_launch(_compiled(_Run(c_launch, scratch=64)), ()) is None
    assert launcher._unwrapped_launch(_compiled(_Run(lambda *args: None)), ()) is None
    metas = [{"swizzle": 3}, {"swizzle": 3}]
    wrapped = _wrapped(c_launch, {5, 7}, metas)
    assert launcher._unwrapped_launch(_compiled(_Run(wrapped)), (5, 7)) == (c_launch, metas, (False, True))
    # Descriptors elsewhere than the launch's, or without their metadata: Triton's own.
    assert launcher._unwrapped_launch(_compiled(_Run(wrapped)), (5, 8)) is None
    assert launcher._unwrapped_launch(_compiled(_Run(_wrapped(c_launch, {5, 7}, [None, None]))), (5, 7)) is None


def test_no_launcher_taken_from_another_triton() -> None:
    """The installed Triton's driver module as it is (here not 3.6's layout unless Triton 3.6 is installed)."""
    import triton

    found = launcher._unwrapped_launch(_compiled(_Run(len)), ())
    assert (found is not None) == triton.__version__.startswith("3.6.")


@pytest.mark.skipif(not INTERPRETED, reason="TMA launches are built for CPU tensors under the interpreter only")
@pytest.mark.parametrize(("head_dim", "rotary_dim", "pieces"), [(32, 32, 1), (64, 32, 3)], ids=["full", "partial"])
def test_fused_launch_passes_each_descriptor_encoded(
    triton36: list[Any], head_dim: int, rotary_dim: int, pieces: int
) -> None:
    """The C launch gets Triton's 13 leading arguments, then the kernel's, each descriptor's place holding its
    encoding, shape and strides; encoded at the first launch from a weight address, not again."""
    draft = Draft(torch.float16, head_dim=head_dim, rotary_dim=rotary_dim, hidden=80)
    x, positions = draft.call(37)
    launch, _, k_dst, v_dst, slots = _launch_for(draft, x, positions, tuning.ProjectionConfig(tma=True), False)
    slots_at = launch._descriptor_slots
    assert len(slots_at) == pieces

    seen: list[tuple[Any, ...]] = []

    def c_launch(*args: Any) -> None:
        seen.append(args)

    metas = [{"swizzle": 3}] * pieces
    compiled = _compiled(_Run(_wrapped(c_launch, set(slots_at), metas)))

    def direct(weight: torch.Tensor) -> tuple[Any, ...]:
        inputs = (draft.m.k_norm_weight, 1e-6, draft.cos_sin_cache, positions)
        values = fused_launch.call_values(x, weight, None, inputs, slots, (k_dst, v_dst, None))
        launch._direct(compiled, False, 77, launch._gather(values + launch._fixed))
        return values

    values = direct(draft.m.kv_weight)
    args = seen[-1]
    assert args[:13] == (*launch.grid, 77, 1234, False, True, None, None, "meta", None, None, None)
    want: list[Any] = []
    for i, param in enumerate(launch.arguments(values)):  # descriptors made where the kernel takes them
        if i in slots_at:
            want += [("map", draft.m.kv_weight.data_ptr(), tuple(param.block_shape)), *param.shape, *param.strides]
        else:
            want.append(param)
    assert list(args[13:]) == want
    assert len(triton36) == pieces
    direct(draft.m.kv_weight)  # the same address: nothing encoded again
    assert len(triton36) == pieces and seen[-1] == args
    moved = draft.m.kv_weight.clone()
    direct(moved)  # another address: encoded for it
    assert len(triton36) == 2 * pieces
    assert seen[-1][13 + slots_at[0]][1] == moved.data_ptr()


@pytest.mark.skipif(not INTERPRETED, reason="TMA launches are built for CPU tensors under the interpreter only")
def test_fused_launch_through_another_launcher_passes_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the launcher is not Triton 3.6's, a direct launch calls it as Triton does: the weight's descriptors
    made, nothing encoded."""
    monkeypatch.setattr(launcher, "_nvidia_driver", lambda: types.SimpleNamespace())  # no 3.6 layout
    draft = Draft(torch.float16, head_dim=64, rotary_dim=32, hidden=80)
    x, positions = draft.call(37)
    launch, values, *_ = _launch_for(draft, x, positions, tuning.ProjectionConfig(tma=True), False)
    seen: list[tuple[Any, ...]] = []
    compiled = types.SimpleNamespace(run=lambda *args: seen.append(args), function=1234, packed_metadata="meta")
    launch._direct(compiled, False, 77, launch._gather(values + launch._fixed))
    (args,) = seen
    assert args[:9] == (*launch.grid, 77, 1234, "meta", None, None, None)
    made = args[9:]
    want = launch.arguments(values)
    assert len(made) == len(want)
    for i, (got, expected) in enumerate(zip(made, want, strict=True)):
        if i in launch._descriptor_slots:
            assert isinstance(got, launcher.TensorDescriptor) and got.base is draft.m.kv_weight
            assert list(got.block_shape) == list(expected.block_shape)
        else:
            assert got is expected
