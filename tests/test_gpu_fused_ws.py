"""GPU suite of the warp-specialised fused projection (``pytest -m gpu``; Hopper with Triton 3.6's Gluon).

`typedkv.projection.warp_specialized` runs the fused path of dense calls it can run from the T the
measured table gives (H200: 2048). Here the table is widened to every T
(`ws_everywhere`) so that small calls exercise it, and each test counts the
kernel's launches, so that a test of this kernel cannot pass on another one.
Inputs on the grid of tests/test_fused_projection.py make the GEMM exact in
float32: V bit for bit, K within one storage ulp of the float64 oracle.
Gluon kernels do not run under Triton's interpreter: this file has no CPU twin
(tests/test_fused_ws.py checks, on the CPU, the Triton releases it is taken under).
Skipped (by conftest) where no CUDA device is present, and here where the kernel
cannot run (not Hopper, or another Gluon API).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from memcheck import run_under_memcheck
from test_fused_projection import Draft, H, L, P, assert_matches_oracle
from test_gpu import compiled_variants
from test_gpu_fused import S, _pool, assert_pool_rows, cpu, cuda_call, cuda_draft
from test_gpu_integration import capture
from torch import Tensor
from ws_launches import counted_launches, runs_here, taken_everywhere

import typedkv
from typedkv.projection import tuning, warp_specialized, warp_specialized_kernel

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def hopper_gluon() -> None:
    if not runs_here():
        pytest.skip("the warp-specialised kernel runs on sm_90 with Triton 3.6's Gluon")


@pytest.fixture
def ws_everywhere() -> Iterator[None]:
    """The measured table widened to every T on this device."""
    with taken_everywhere(torch.cuda.get_device_name()):
        yield


@pytest.fixture
def launches() -> Iterator[list[int]]:
    """The token counts of the kernel's launches (dense and into pools), in order."""
    with counted_launches() as seen:
        yield seen


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.parametrize("hidden", [80, 1000, 4096])
@pytest.mark.parametrize("num_tokens", [1, 127, 128, 300, 2053])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_oracle_cuda(launches: list[int], dtype: torch.dtype, norm: bool, num_tokens: int, hidden: int) -> None:
    """Token counts around the 128-token tiles, hidden sizes off the 64-column steps (their tail read as 0)."""
    draft = cuda_draft(dtype, head_dim=128, rotary_dim=128, hidden=hidden, norm=norm)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), dtype)
    assert launches == [num_tokens]


@pytest.mark.usefixtures("ws_everywhere")
def test_eps_per_layer_cuda(launches: list[int]) -> None:
    per_layer = [1e-6, 0.5, 4.0]
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, eps=torch.tensor(per_layer))
    draft.eps = torch.tensor(per_layer, dtype=torch.float64)
    x, positions, xc, pc = cuda_call(draft, 200)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    assert launches == [200]


@pytest.mark.usefixtures("ws_everywhere")
def test_out_of_range_positions_cuda(launches: list[int]) -> None:
    """Production mode: a position outside [0, P) gives NaN K, V still written."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128)
    x, positions = draft.call(150)
    positions[3], positions[140] = -7, P + 100
    k, v = cpu(draft.m(x.cuda(), positions.cuda()))
    assert k[:, [3, 140]].isnan().all() and not k[:, [0, 4, 139]].isnan().any()
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.bfloat16)
    assert launches == [150]


@pytest.mark.usefixtures("ws_everywhere")
def test_strided_outputs_keep_their_other_rows_cuda(launches: list[int]) -> None:
    """Outputs that are views of larger buffers (layer and token strides of their own): the oracle's K and V in
    the view, every other element of the buffers as it was (the TMA stores clip the last tile's rows past T)."""
    num_tokens = 130
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=256)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    sentinel = -3.0
    k_buf = torch.full((L + 1, num_tokens + 40, H, 128), sentinel, dtype=torch.bfloat16, device="cuda")
    v_buf = torch.full_like(k_buf, sentinel)
    k_out, v_out = k_buf[1:, 8 : 8 + num_tokens], v_buf[:L, 16 : 16 + num_tokens]
    draft.m(xc, pc, k_out=k_out, v_out=v_out)
    assert_matches_oracle(cpu((k_out, v_out)), draft.oracle(x, positions), torch.bfloat16)
    k_rest = torch.ones(k_buf.shape, dtype=torch.bool, device="cuda")
    k_rest[1:, 8 : 8 + num_tokens] = False
    v_rest = torch.ones_like(k_rest)
    v_rest[:L, 16 : 16 + num_tokens] = False
    assert (k_buf[k_rest] == sentinel).all() and (v_buf[v_rest] == sentinel).all(), "written outside the views"
    assert launches == [num_tokens]


def assert_dense_or_pools(
    draft: Draft, xc: Tensor, pc: Tensor, want: tuple[Tensor, Tensor], layout: str, cache_loc: Tensor
) -> None:
    """``layout`` "dense": the materializer's K and V are ``want``'s; else K and V go into `_pool`'s pools of
    ``layout`` at ``cache_loc``'s slots, and `assert_pool_rows` checks every row of them."""
    if layout == "dense":
        assert_matches_oracle(cpu(draft.m(xc, pc)), want, torch.bfloat16)
        return
    k_pool, v_pool, kv_layout = _pool(layout, torch.bfloat16, 128)
    draft.m.into_pool(xc, pc, cache_loc.cuda(), k_pool, v_pool, kv_layout=kv_layout)
    assert_pool_rows(k_pool, v_pool, cache_loc, layout, want)


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.parametrize("layout", ["flat", "NHD", "HND", "list", "combined", "list_unaligned"])
def test_pools_hold_the_oracle_cuda(launches: list[int], layout: str) -> None:
    """Production mode: named rows hold the oracle's K/V, slots negative or >= S skipped, nothing else written;
    stacked and per-layer pools, pages of 16 (NHD and HND), layers off 16 bytes."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=256)
    x, positions, xc, pc = cuda_call(draft, 300)
    cache_loc = torch.randperm(S)[:300]
    cache_loc[[2, 290]] = torch.tensor([-1, S + 3])
    assert_dense_or_pools(draft, xc, pc, draft.oracle(x, positions), layout, cache_loc)
    assert launches == [300]


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.parametrize("group_n", [0, 4])
@pytest.mark.parametrize("layout", ["dense", "list", "HND"])
def test_several_tiles_a_program_cuda(
    monkeypatch: pytest.MonkeyPatch, launches: list[int], layout: str, group_n: int
) -> None:
    """At a T where every program takes three tiles or more (the tests above fit one tile a program on an
    H200): the ring and the staging tile carried from tile to tile. Production mode; into pools, 500 of the
    tokens spread over the batch have slots, the others -1; every other row keeps its fill. ``group_n`` 4:
    the tiles in bands of 4 weight tiles (`Tiles.group_n`), the last band of 2 (6 weight tiles here)."""
    shape = warp_specialized.WS_TILES[-1][1]._replace(group_n=group_n)
    monkeypatch.setattr(warp_specialized, "WS_TILES", ((math.inf, shape),))
    typedkv.set_debug(False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_n = L * 2 * H * 128 // warp_specialized.WS_TILES[-1][1].block_n
    num_tokens = warp_specialized.WS_TILES[-1][1].block_m * (3 * sms // tiles_n + 1)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=256)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    g = torch.Generator().manual_seed(3)
    cache_loc = torch.full((num_tokens,), -1, dtype=torch.int64)
    cache_loc[torch.randperm(num_tokens, generator=g)[:500]] = torch.randperm(S, generator=g)[:500]
    assert_dense_or_pools(draft, xc, pc, draft.oracle(x, positions), layout, cache_loc)
    assert launches == [num_tokens]


# The other tiles the sweeps time (benchmarks/ws_sweep.py): 64 tokens by two heads, the warpgroups side
# by side (--tiles); 64 or 128 tokens by one head (--small); the default's in bands of weight tiles
# (--weight-bands; 4 of the 6 here, then 2); two heads or one with each program's last tile's epilogue
# in the epilogue warps (--last-tile; `WS_TILES` has both).
OTHER_TILES = {
    "64x256": warp_specialized.Tiles(64, 4, 8, 4, 2),
    "64x128": warp_specialized.Tiles(64, 8, 1, 4, 1, 128),
    "128x128": warp_specialized.Tiles(128, 5, 8, 8, 1, 128),
    "weight-bands": warp_specialized.WS_TILES[-1][1]._replace(group_n=4),
    "last-in-epilogue": warp_specialized.WS_TILES[-1][1]._replace(last_in_mma=False),
}
OTHER_TILES["128x128 last-in-epilogue"] = OTHER_TILES["128x128"]._replace(last_in_mma=False)


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.parametrize("tiles", list(OTHER_TILES))
@pytest.mark.parametrize("layout", ["dense", "list", "HND"])
@pytest.mark.parametrize("num_tokens", [1, 65, 300])
def test_other_tiles_cuda(
    monkeypatch: pytest.MonkeyPatch, launches: list[int], num_tokens: int, layout: str, tiles: str
) -> None:
    """`OTHER_TILES`: the oracle's K and V, dense and into pools (every other pool row keeps its fill); at
    T = 300 a program takes several tiles (its ring carried from one tile to the next)."""
    monkeypatch.setattr(warp_specialized, "WS_TILES", ((math.inf, OTHER_TILES[tiles]),))
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=1000)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    assert_dense_or_pools(draft, xc, pc, draft.oracle(x, positions), layout, torch.randperm(S)[:num_tokens])
    assert launches == [num_tokens]


@pytest.mark.usefixtures("ws_everywhere")
def test_fp8_pools_take_the_other_kernel_cuda(launches: list[int]) -> None:
    """FP8 pools are not this kernel's: the fused path's other kernel writes them."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=256)
    _, _, xc, pc = cuda_call(draft, 64)
    k_pool = torch.zeros(L, S, H, 128, dtype=torch.float8_e4m3fn, device="cuda")
    draft.m.into_pool(xc, pc, torch.randperm(S, device="cuda")[:64], k_pool, torch.zeros_like(k_pool))
    assert launches == []
    assert k_pool.view(torch.uint8).any()


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.parametrize(
    ("rope_style", "rotary_dim", "bias"), [("gptj", 128, False), ("neox", 64, False), ("neox", 128, True)]
)
def test_other_layouts_take_the_other_kernel_cuda(
    launches: list[int], rope_style: typedkv.RopeStyle, rotary_dim: int, bias: bool
) -> None:
    """GPT-J pairs, partial rotary and a bias are not this kernel's: the fused path's other kernel, the oracle."""
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=rotary_dim, rope_style=rope_style, bias=bias)
    x, positions, xc, pc = cuda_call(draft, 200)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    assert launches == []


@pytest.mark.usefixtures("ws_everywhere")
def test_deterministic_and_graph_replay_cuda(launches: list[int]) -> None:
    """The same bits on every call, and a call captured at a fixed T replayed with new inputs copied in."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512)
    _, _, hidden, positions = cuda_call(draft, 260)
    first = draft.m(hidden, positions)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, draft.m(hidden, positions), strict=True))
    graph, out = capture(lambda: draft.m(hidden, positions))
    for seed in range(2):
        _, _, new_hidden, new_positions = cuda_call(draft, 260, seed=40 + seed)
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        graph.replay()
        torch.cuda.synchronize()
        want = draft.m(new_hidden, new_positions)
        assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))
    assert draft.m._workspace is None  # the fused path has no GEMM output
    assert set(launches) == {260}


def test_auto_takes_it_from_the_measured_t_cuda(launches: list[int]) -> None:
    """On a device the table knows, "auto" takes this kernel exactly at the T its row holds (the oracle's K and V,
    no GEMM output): on the H200 at T = 760, 2048 and 2112, not at 300, 1024 or 2560; on the H100 at 760, 1024 and 2048,
    not at 300, 2112 or 2560; into per-layer pools too."""
    if not tuning.tuning_of(torch.cuda.get_device_name()).warp_specialized_faster:
        pytest.skip("no measured table for this device")
    device = torch.device("cuda")
    sizes = (300, 760, 1024, 2112, 2560, 2048)  # 2048 last: the pool call below reuses its inputs
    taken = [t for t in sizes if warp_specialized.faster(device, t)]
    # Both ways must be seen, or the test would not show that "auto" follows the table.
    assert taken and len(taken) < len(sizes), taken
    draft = cuda_draft(torch.bfloat16, "auto", head_dim=128, rotary_dim=128, hidden=512)
    for num_tokens in sizes:
        x, positions, xc, pc = cuda_call(draft, num_tokens)
        assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    assert launches == taken
    k_pool = torch.zeros(L, 4096, H, 128, dtype=torch.bfloat16, device="cuda")
    draft.m.into_pool(xc, pc, torch.randperm(4096, device="cuda")[:2048], list(k_pool), list(torch.zeros_like(k_pool)))
    assert launches == [*taken, 2048]


def test_matches_gemm_path_on_random_inputs_cuda(launches: list[int]) -> None:
    """Off the grid, at the draft shape of the bench: the two paths differ only by the GEMM's accumulation order."""
    g = torch.Generator(device="cuda").manual_seed(5)
    weight = (torch.randn(5, 2 * 8 * 128, 4096, device="cuda", generator=g) / 64).bfloat16()
    m = typedkv.KVMaterializer(
        weight, torch.rand(5, 128, device="cuda", generator=g) + 0.5, 1e-6,
        torch.randn(4096, 128, device="cuda", generator=g), num_kv_heads=8,
    )  # fmt: skip
    x = torch.randn(2048, 4096, device="cuda", generator=g).bfloat16()
    positions = torch.randint(0, 4096, (2048,), device="cuda", generator=g)
    m.projection_path = "gemm"
    want = m(x, positions)
    m.projection_path = "fused"
    got = m(x, positions)
    torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=2e-2)
    # The fused path takes this kernel where the device's table says it is faster (the H200 at 2048);
    # elsewhere it takes the tiled fused kernel, which the comparison above checked instead.
    assert launches == ([2048] if warp_specialized.faster(x.device, 2048) else [])


@pytest.mark.usefixtures("ws_everywhere")
@pytest.mark.production
def test_new_token_count_compiles_nothing_cuda() -> None:
    """The kernel compiles once per layout and tile set (the T ranges of `WS_TILES`), never per T."""
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512)
    # Each range of the table below 65536: its tiles compile at its first T; later its last T (or one
    # 300 on) and other T compile nothing.
    bounds = [0] + [int(most) for most, _ in warp_specialized.WS_TILES[:-1]]
    for num_tokens in (low + 1 for low in bounds[:-1]):
        draft.m(*cuda_call(draft, num_tokens)[2:])
    before = compiled_variants(warp_specialized_kernel.project_kv_ws_kernel)
    for num_tokens in (17, 130, 1000, *(min(high, low + 300) for low, high in itertools.pairwise(bounds))):
        draft.m(*cuda_call(draft, num_tokens)[2:])
    torch.cuda.synchronize()
    assert compiled_variants(warp_specialized_kernel.project_kv_ws_kernel) == before


# Not racecheck: on this kernel (Triton 3.6, compute-sanitizer 2025.3.1, H200) it reports a hazard at every
# launch between the default warps' write of Triton's warp-specialisation state word (before and after
# the partitions run) and the other warps' read of it, which a CTA-wide named barrier orders, then fails
# on a hardware exception of its own ("Internal Sanitizer Error"); none of its hazards is on the kernel's
# own buffers (docs/reliability.md).
@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
def test_ws_sample_under_compute_sanitizer(tool: str) -> None:
    """tests/fused_ws_sample.py (every tile set, dense outputs and pools, guarded) under compute-sanitizer:
    memcheck over every kernel it runs (no access out of bounds), synccheck on this kernel alone (no
    barrier or mbarrier misused between the load, MMA and epilogue warps)."""
    kernel = None if tool == "memcheck" else "project_kv_ws_kernel"
    run_under_memcheck(Path(__file__).with_name("fused_ws_sample.py"), [], "ws sample done", 900, tool, kernel)
