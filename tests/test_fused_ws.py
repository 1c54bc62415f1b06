"""Where the warp-specialised fused projection may run, checked without a GPU.

Its kernel (Gluon, `typedkv.projection.warp_specialized_kernel`) runs on the GPU only:
tests/test_gpu_fused_ws.py checks what it computes. Here: the Triton releases it
is taken under, and the layouts it takes (its module's list), each condition alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import triton

import typedkv
from typedkv.core import launcher
from typedkv.projection import tuning, warp_specialized


@pytest.fixture
def fresh_available() -> Iterator[None]:
    warp_specialized.available.cache_clear()
    yield
    warp_specialized.available.cache_clear()


@pytest.mark.usefixtures("fresh_available")
@pytest.mark.parametrize(("version", "taken"), [("3.6.0", True), ("3.6.1", True), ("3.9.0", False), ("3.5.1", False)])
def test_available_only_under_the_releases_it_is_written_for(
    monkeypatch: pytest.MonkeyPatch, version: str, taken: bool
) -> None:
    """Gluon's API changes between releases (3.9 has no `async_copy_shared_to_global`): another release keeps the
    fused path's other kernel rather than failing to compile."""
    if warp_specialized.gl is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(triton, "__version__", version)
    assert warp_specialized.available() is taken


# ------------------------------------------------------------------ where it may run

T, HIDDEN, L, H, D, P = 64, 512, 5, 8, 128, 32


@pytest.fixture
def on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's device and release conditions met, so that the layout conditions alone decide (on CPU tensors)."""
    monkeypatch.setattr(warp_specialized, "available", lambda: True)
    monkeypatch.setattr(warp_specialized, "_hopper", lambda device: True)


def _dense(**change: Any) -> bool:
    """`launchable` for the bench-like draft (bf16, H = 8, D = 128, NeoX, no bias), ``change`` overriding an argument."""
    args: dict[str, Any] = {
        "hidden": torch.empty(T, HIDDEN, dtype=torch.bfloat16),
        "kv_weight": torch.empty(L * 2 * H * D, HIDDEN, dtype=torch.bfloat16),
        "kv_bias": None,
        "cos_sin_cache": torch.empty(P, D),
        "k_out": None,
        "v_out": None,
        "num_kv_heads": H,
        "head_dim": D,
        "neox": True,
    } | change
    return warp_specialized.launchable(**args)


@pytest.mark.usefixtures("on_hopper")
def test_launchable_takes_the_layouts_the_kernel_computes() -> None:
    out = torch.empty(L, T, H, D, dtype=torch.bfloat16)
    assert _dense()
    assert _dense(k_out=out, v_out=out[:, :, :, :])
    assert _dense(
        hidden=torch.empty(T, HIDDEN, dtype=torch.float16),
        kv_weight=torch.empty(L * 2 * H * D, HIDDEN, dtype=torch.float16),
    )


@pytest.mark.usefixtures("on_hopper")
@pytest.mark.parametrize(
    "change",
    [
        {"kv_bias": torch.empty(L * 2 * H * D, dtype=torch.bfloat16)},
        {"neox": False},
        {"head_dim": 64, "cos_sin_cache": torch.empty(P, 64)},
        {"cos_sin_cache": torch.empty(P, 64)},  # partial rotary
        {"num_kv_heads": 1},  # H*D = 128: a tile of two heads would cross from K to V
        {"hidden": torch.empty(T, HIDDEN)},  # float32
        {"kv_weight": torch.empty(L * 2 * H * D, HIDDEN, dtype=torch.float16)},  # another dtype than hidden's
        {"hidden": torch.empty(T, HIDDEN + 3, dtype=torch.bfloat16)[:, :HIDDEN]},  # rows 2 bytes off 16
        {"hidden": torch.empty(HIDDEN, T, dtype=torch.bfloat16).t()},  # rows not contiguous
        {"k_out": torch.empty(L, T, D, H, dtype=torch.bfloat16).transpose(2, 3)},  # a head's dims apart
        {"k_out": torch.empty(L, T, H, D + 8, dtype=torch.bfloat16)[..., :D]},  # heads apart (padded)
        {"v_out": torch.empty(L, T + 1, H, D, dtype=torch.bfloat16)[:, 1:, :, :1].expand(L, T, H, D)},
        {"k_out": torch.empty(L, T, H, D, dtype=torch.float16)},
        {"hidden": None},  # not a tensor (the checks reject it; the kernel is not asked)
    ],
    ids=[
        "bias", "gptj", "head_dim_64", "partial_rotary", "one_head", "float32", "mixed_dtypes", "unaligned_rows",
        "column_major_hidden", "dims_apart", "heads_apart", "broadcast_output", "output_dtype", "no_hidden",
    ],
)  # fmt: skip
def test_launchable_refuses_what_it_does_not_compute(change: dict[str, Any]) -> None:
    """Each condition of the module's list alone turns the kernel down (the fused path's other kernel then runs)."""
    assert not _dense(**change)


@pytest.mark.usefixtures("on_hopper")
def test_launchable_pool_takes_pools_of_hiddens_dtype_without_scales() -> None:
    hidden = torch.empty(T, HIDDEN, dtype=torch.bfloat16)
    weight = torch.empty(L * 2 * H * D, HIDDEN, dtype=torch.bfloat16)

    def pool(k_pool: Any, scales: tuple[Any, Any] = (None, None)) -> bool:
        return warp_specialized.launchable_pool(
            hidden, weight, None, torch.empty(P, D), k_pool, scales, num_kv_heads=H, head_dim=D, neox=True
        )

    stacked = torch.empty(L, 64, H, D, dtype=torch.bfloat16)
    assert pool(stacked) and pool(list(stacked)) and pool(torch.empty(L, 4, H, 16, D, dtype=torch.bfloat16))
    assert not pool(stacked.to(torch.float8_e4m3fn))
    assert not pool(stacked, (0.5, None)) and not pool(stacked, (None, torch.ones(L)))
    assert not pool(stacked.half())
    assert not pool([])


def test_launchable_needs_hopper_and_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU (no Hopper), or under another Triton release, the kernel is never taken."""
    assert not _dense()
    monkeypatch.setattr(warp_specialized, "_hopper", lambda device: True)
    monkeypatch.setattr(warp_specialized, "available", lambda: False)
    assert not _dense()


@pytest.mark.skipif(not launcher.INTERPRETED, reason="the fused path runs CPU tensors under the interpreter only")
@pytest.mark.usefixtures("on_hopper")
def test_taken_or_not_once_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a layout's calls take the kernel is decided at its first call (host time per call): later calls
    of that layout launch it without asking the table again; a new T asks again. Dense outputs and per-layer
    pools, the launches stubbed (the kernel itself runs on the GPU only)."""
    asked: list[int] = []
    launched: list[tuple[str, int]] = []

    def faster(device: torch.device, num_tokens: int) -> bool:
        asked.append(num_tokens)
        return True

    def launch(hidden: torch.Tensor, kv_weight: torch.Tensor, inputs: Any, target: Any, num_layers: int) -> None:
        launched.append(("dense" if target[0] is None else "pool", hidden.shape[0]))  # slots: None for dense outputs

    monkeypatch.setattr(warp_specialized, "faster", faster)
    monkeypatch.setattr(warp_specialized, "launch", launch)
    heads, layers, width, slots = 2, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    m = typedkv.KVMaterializer(
        torch.randn(layers, 2 * heads * D, width, generator=g).half(), torch.ones(layers, D).half(), 1e-6,
        torch.randn(P, D, generator=g), num_kv_heads=heads,
    )  # fmt: skip
    m.projection_path = "fused"
    hidden = torch.randn(4, width, generator=g).half()
    positions = torch.arange(4)
    for _ in range(3):
        m(hidden, positions)
    k_pools = [torch.zeros(slots, heads, D).half() for _ in range(layers)]
    v_pools = [torch.zeros(slots, heads, D).half() for _ in range(layers)]
    for _ in range(2):
        m.into_pool(hidden, positions, torch.arange(4), k_pools, v_pools)
    m(hidden[:3], positions[:3])
    assert asked == [4, 4, 3]
    assert launched == [("dense", 4)] * 3 + [("pool", 4)] * 2 + [("dense", 3)]


def test_the_sanitizer_sample_covers_every_tile_set(capsys: pytest.CaptureFixture[str]) -> None:
    """tests/fused_ws_sample.py (run under compute-sanitizer by the GPU suite) takes every tile set `WS_TILES`
    launches with; where the kernel cannot run (here) it says so and succeeds, rather than failing to import."""
    import fused_ws_sample
    import ws_launches

    sets = fused_ws_sample.tile_sets()
    assert {shape for _, shape in warp_specialized.WS_TILES} <= set(sets.values())
    assert any(not shape.last_in_mma and shape.block_n == 2 * warp_specialized.HEAD_DIM for shape in sets.values())
    assert len(set(sets.values())) == len(sets)
    if ws_launches.runs_here():
        pytest.skip("the GPU suite runs it here")
    assert fused_ws_sample.main([]) == 0
    assert "ws sample skipped" in capsys.readouterr().out


def test_widened_table_and_counted_launches_are_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/ws_launches.py, with which this kernel's GPU tests, its sanitizer sample and the two-GPU worker make
    every T take the kernel and count its launches: the table says faster at every T inside the block, each
    launch goes through and is counted, and both attributes are back after it, also when the block raises."""
    from ws_launches import counted_launches, taken_everywhere

    launched: list[tuple[int, tuple[Any, ...]]] = []
    monkeypatch.setattr(
        warp_specialized, "_launch_kernel", lambda hidden, *args: launched.append((hidden.shape[0], args))
    )
    table, launch, cpu = tuning.TUNING, warp_specialized._launch_kernel, torch.device("cpu")
    assert not tuning.warp_specialized_faster(cpu, 1)
    with taken_everywhere(launcher.device_name(cpu)), counted_launches() as seen:
        assert all(tuning.warp_specialized_faster(cpu, t) for t in (1, 17, 2**20))
        warp_specialized._launch_kernel(torch.empty(7, 2), "rest")  # type: ignore[arg-type, call-arg]
        warp_specialized._launch_kernel(torch.empty(3, 2), "rest")  # type: ignore[arg-type, call-arg]
    assert seen == [7, 3]
    assert launched == [(7, ("rest",)), (3, ("rest",))]
    assert tuning.TUNING is table and warp_specialized._launch_kernel is launch
    with pytest.raises(RuntimeError), taken_everywhere("cpu"), counted_launches():
        raise RuntimeError
    assert tuning.TUNING is table and warp_specialized._launch_kernel is launch
