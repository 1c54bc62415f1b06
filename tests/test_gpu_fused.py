"""GPU suite of the fused projection path (``pytest -m gpu``): the CPU file's checks on CUDA, bfloat16 included.

As in tests/test_fused_projection.py, inputs on a grid make the GEMM exact in
float32, so K and V are held to the float64 oracle (V bit for bit, K within one
storage ulp at the scale of the row's largest value). Beside it: pools against
the oracle (16-bit) or the GEMM path (FP8: K one FP8 step at most, the norm's
reduction order differing between the two kernels), random inputs against the
GEMM path (their only difference the GEMM's accumulation order), determinism,
CUDA-graph capture and replay, torch.compile(fullgraph=True), no host sync, and
no access out of bounds (tests/fused_sample.py: guard bytes, and under memcheck).
Skipped (by conftest) where no CUDA device is present.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from memcheck import run_under_memcheck
from test_fused_projection import Draft, H, L, Oracle, P, assert_matches_oracle
from test_gpu import assert_no_sync, compiled_variants
from test_gpu_integration import capture
from torch import Tensor
from torch._inductor.utils import run_and_get_code

import typedkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled"),
]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cuda_draft(dtype: torch.dtype, path: str = "fused", **kw: Any) -> Draft:
    draft = Draft(dtype, **kw)
    draft.m.to("cuda")
    draft.m.projection_path = path  # type: ignore[assignment]
    return draft


def cuda_call(draft: Draft, num_tokens: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden and positions on CPU (for the oracle) and on CUDA."""
    x, positions = draft.call(num_tokens, seed)
    return x, positions, x.cuda(), positions.cuda()


def cpu(pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return pair[0].cpu(), pair[1].cpu()


@pytest.fixture(params=["pointer", "tma"])
def weight_loads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel's weight tiles by pointer, or by TMA wherever the layout allows (as the defaults on
    Hopper): each test so marked runs both ways."""
    from typedkv.projection import fused as fused_impl
    from typedkv.projection import launch as fused_launch
    from typedkv.projection import tuning

    defaults = fused_launch.projection_launch.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "config", tuning.ProjectionConfig(tma=request.param == "tma"))
    fused_impl._LAUNCHES.clear()


# ------------------------------------------------------------------ results


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope_only"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(128, 128), (128, 64), (64, 64), (80, 32), (256, 64), (32, 2)])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grid_cuda(
    dtype: torch.dtype, rope_style: typedkv.RopeStyle, head_dim: int, rotary_dim: int, norm: bool, bias: bool
) -> None:
    draft = cuda_draft(
        dtype, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style, norm=norm, bias=bias, hidden=256
    )
    x, positions, xc, pc = cuda_call(draft, 21)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), dtype)


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("hidden", [16, 64, 1000, 4096])
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 300, 2048])
@pytest.mark.parametrize("rope_style", ["gptj", "neox"])  # NeoX: weights by TMA, hidden's tail read as 0
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_token_and_hidden_edges_cuda(
    dtype: torch.dtype, rope_style: typedkv.RopeStyle, num_tokens: int, hidden: int
) -> None:
    draft = cuda_draft(dtype, head_dim=128, rotary_dim=64, hidden=hidden, rope_style=rope_style, bias=True)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), dtype)


@pytest.mark.usefixtures("weight_loads")
def test_eps_per_layer_cuda() -> None:
    per_layer = [1e-6, 0.5, 4.0]
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, eps=torch.tensor(per_layer))
    draft.eps = torch.tensor(per_layer, dtype=torch.float64)
    x, positions, xc, pc = cuda_call(draft, 16)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)


def test_out_of_range_positions_cuda() -> None:
    """Production mode: a position outside [0, P) gives NaN K, V still written; nothing out of bounds."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=64)
    x, positions = draft.call(20)
    positions[3], positions[11] = -7, P + 100
    k, v = cpu(draft.m(x.cuda(), positions.cuda()))
    assert k[:, [3, 11]].isnan().all()
    assert_matches_oracle((k, v), draft.oracle(x, positions), torch.bfloat16)


@pytest.mark.usefixtures("weight_loads")
def test_matches_gemm_path_on_random_inputs_cuda() -> None:
    """Off the grid: the two paths differ only by the GEMM's accumulation order (a storage ulp or so)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    weight = (torch.randn(L, 2 * H * 128, 4096, device="cuda", generator=g) / 64).bfloat16()
    m = typedkv.KVMaterializer(
        weight, torch.rand(L, 128, device="cuda", generator=g) + 0.5, 1e-6,
        torch.randn(P, 128, device="cuda", generator=g), num_kv_heads=H,
        kv_bias=torch.randn(L, 2 * H * 128, device="cuda", generator=g).bfloat16(),
    )  # fmt: skip
    for num_tokens in (16, 2048):
        x = torch.randn(num_tokens, 4096, device="cuda", generator=g).bfloat16()
        positions = torch.randint(0, P, (num_tokens,), device="cuda", generator=g)
        m.projection_path = "gemm"
        want = m(x, positions)
        m.projection_path = "fused"
        got = m(x, positions)
        # K: a projected value one ulp off moves K by an ulp or two at the row's scale (|K| < 8 here),
        # which RoPE can leave beside a small element: an absolute tolerance of a few bf16 ulps at 8.
        torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=2e-2)
        torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 2, 17])
def test_one_token_with_a_bias_cuda(num_tokens: int) -> None:
    """At T = 1 with a bias, CUDA's ``torch.addmm`` (a GEMV there, as ``F.linear``) rounds the product before
    adding the bias (seen by the fused fuzz: bf16, hidden 59). The fused path still stores the projection
    rounded once, the oracle's V; GEMM + kernel stores the GEMM's own V, as the unfused model would."""
    draft = cuda_draft(torch.bfloat16, head_dim=16, rotary_dim=2, hidden=59, bias=True)
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    draft.m.projection_path = "gemm"
    _, v = draft.m(xc, pc)
    model = torch.nn.functional.linear(xc, draft.m.kv_weight, draft.m.kv_bias).view(num_tokens, L, 2, H, 16)
    assert torch.equal(v, model[:, :, 1].transpose(0, 1))


@pytest.mark.usefixtures("weight_loads")
def test_deterministic_cuda() -> None:
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=4096, bias=True)
    _, _, xc, pc = cuda_call(draft, 300)
    first = draft.m(xc, pc)
    for _ in range(3):
        again = draft.m(xc, pc)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "into_pool"])
@pytest.mark.parametrize("rotary_dim", [128, 64], ids=["full_rotary", "partial_rotary"])
def test_weight_descriptors_encoded_per_address_cuda(
    monkeypatch: pytest.MonkeyPatch, rotary_dim: int, pool: bool
) -> None:
    """Direct launches pass the weight's TMA descriptors encoded once per weight address: each call after the
    first (new data each time) holds the oracle, a weight changed in place is read anew, a weight moved to
    another address is encoded anew, and on Triton 3.6 no call after the first encodes again."""
    from typedkv.core import launcher
    from typedkv.projection import fused as fused_impl
    from typedkv.projection import launch as fused_launch
    from typedkv.projection import tuning

    defaults = fused_launch.projection_launch.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "config", tuning.ProjectionConfig(tma=True))
    fused_impl._LAUNCHES.clear()
    encoded: list[Any] = []
    encode = launcher.encode_descriptor

    def counted(descriptor: Any, meta: Any) -> list[Any]:
        encoded.append(descriptor)
        return encode(descriptor, meta)

    monkeypatch.setattr(launcher, "encode_descriptor", counted)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=rotary_dim, hidden=256, bias=True)
    k_pool = torch.zeros(L, S, H, 128, dtype=torch.bfloat16, device="cuda")
    v_pool = torch.zeros_like(k_pool)

    def check(seed: int) -> None:
        x, positions, xc, pc = cuda_call(draft, 40, seed)
        if pool:
            slots = torch.randperm(S, device="cuda")[:40]
            draft.m.into_pool(xc, pc, slots, k_pool, v_pool)
            got = k_pool[:, slots].cpu(), v_pool[:, slots].cpu()
        else:
            got = cpu(draft.m(xc, pc))
        assert_matches_oracle(got, draft.oracle(x, positions), torch.bfloat16)

    for seed in (1, 2, 3):
        check(seed)
    pieces = 1 if rotary_dim == 128 else 3  # a whole head's tile; else the two rotary halves' and the rest's
    unwrapped = triton.__version__.startswith("3.6.")
    assert len(encoded) == (pieces if unwrapped else 0)
    # In place: the same address, new values (a descriptor holds the address, not the values).
    draft.weight = -draft.weight
    draft.m.kv_weight.copy_(draft.weight.reshape(draft.m.kv_weight.shape))
    check(4)
    assert len(encoded) == (pieces if unwrapped else 0)
    # Moved: a buffer at another address, the same layout.
    draft.m.kv_weight = draft.m.kv_weight.clone()
    check(5)
    check(6)
    assert len(encoded) == (2 * pieces if unwrapped else 0)


# ------------------------------------------------------------------- pools

S = 512


def _pool(layout: str, dtype: torch.dtype, head_dim: int) -> tuple[Any, Any, typedkv.KVLayout | None]:
    def paged(hnd: bool) -> Tensor:
        shape = (L, S // 16, H, 16, head_dim) if hnd else (L, S // 16, 16, H, head_dim)
        return torch.empty(shape, dtype=dtype, device="cuda")

    flat = (L, S, H, head_dim)
    pools: dict[str, Callable[[], tuple[Any, Any, typedkv.KVLayout | None]]] = {
        "flat": lambda: (torch.empty(flat, dtype=dtype, device="cuda"), torch.empty(flat, dtype=dtype, device="cuda"), None),
        "NHD": lambda: (paged(False), paged(False), "NHD"),
        "HND": lambda: (paged(True), paged(True), "HND"),
        "list": lambda: (
            list(torch.empty(flat, dtype=dtype, device="cuda")), list(torch.empty(flat, dtype=dtype, device="cuda")),
            None,
        ),
        "combined": lambda: _halves(torch.empty(2, *flat, dtype=dtype, device="cuda")),
        # Each layer one element into its own row: no layer on 16 bytes (the launch that stores element by element).
        "list_unaligned": lambda: _unaligned_layers(torch.empty(2 * L, S * H * head_dim + 1, dtype=dtype, device="cuda")),
    }  # fmt: skip
    k_pool, v_pool, kv_layout = pools[layout]()
    for t in [k_pool, v_pool] if isinstance(k_pool, Tensor) else [*k_pool, *v_pool]:
        t.view(torch.uint8).fill_(0x35)
    return k_pool, v_pool, kv_layout


def _halves(memory: Tensor) -> tuple[Tensor, Tensor, None]:
    return memory[0], memory[1], None


def _unaligned_layers(rows: Tensor) -> tuple[list[Tensor], list[Tensor], None]:
    layers = [row[1:].view(S, H, -1) for row in rows]
    return layers[:L], layers[L:], None


def _rows(pool: Any, slots: Tensor, layout: str) -> Tensor:
    """``[L, len(slots), H, D]``: the pool's rows at ``slots`` (an FP8 pool's as bytes: torch indexes no FP8)."""
    layers = [pool] if isinstance(pool, Tensor) else list(pool)
    layers = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in layers]
    stacked = layers[0] if isinstance(pool, Tensor) else torch.stack(layers)
    if layout == "HND":
        stacked = stacked.transpose(2, 3)
    return stacked.reshape(L, S, H, -1)[:, slots].cpu()


def assert_pool_rows(k_pool: Any, v_pool: Any, cache_loc: Tensor, layout: str, want: tuple[Tensor, Tensor]) -> None:
    """The bfloat16 pools' rows at ``cache_loc``'s slots in ``[0, S)`` hold ``want``'s K/V of those tokens (an `Oracle`
    stays one, its other rounding kept); every other row still holds `_pool`'s fill byte (0x35)."""
    kept = (cache_loc >= 0) & (cache_loc < S)
    if isinstance(want, Oracle):
        expected: tuple[Tensor, Tensor] = Oracle(want[0][:, kept], want[1][:, kept], want.other_k64[:, kept])
    else:
        expected = (want[0][:, kept], want[1][:, kept])
    got = (_rows(k_pool, cache_loc[kept], layout), _rows(v_pool, cache_loc[kept], layout))
    assert_matches_oracle(got, expected, torch.bfloat16)
    others = torch.ones(S, dtype=torch.bool)
    others[cache_loc[kept]] = False
    for pool in (k_pool, v_pool):
        assert (_rows(pool, torch.arange(S)[others], layout).view(torch.uint8) == 0x35).all()


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("layout", ["flat", "NHD", "HND", "list", "combined", "list_unaligned"])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_pools_hold_the_oracle_cuda(layout: str, rope_style: typedkv.RopeStyle) -> None:
    """Production mode: named rows hold the oracle's K/V, slots negative or >= S skipped, nothing else written."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=64, rope_style=rope_style, bias=True)
    x, positions, xc, pc = cuda_call(draft, 40)
    cache_loc = torch.randperm(S)[:40]
    cache_loc[[2, 9]] = torch.tensor([-1, S + 3])
    k_pool, v_pool, kv_layout = _pool(layout, torch.bfloat16, 128)
    draft.m.into_pool(xc, pc, cache_loc.cuda(), k_pool, v_pool, kv_layout=kv_layout)
    k64, v = draft.oracle(x, positions)
    assert_pool_rows(k_pool, v_pool, cache_loc, layout, (k64, v))


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", ["flat", "NHD", "list", "list_unaligned"])
def test_fp8_pools_cuda(layout: str, pool_dtype: torch.dtype, scale: str) -> None:
    """FP8 pools: V as the GEMM path stores it, K at most one FP8 step from it; saturating."""
    typedkv.set_debug(False)
    options: dict[str, dict[str, Any]] = {
        "none": {},
        "float": {"k_scale": 0.25, "v_scale": 2.0},
        "tensor": {
            "k_scale": torch.tensor([0.5, 0.125, 1.0], device="cuda"),
            "v_scale": torch.tensor([2.0, 1.0, 0.25], device="cuda"),
        },
    }
    scales = options[scale]
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128)
    _, _, xc, pc = cuda_call(draft, 40)
    xc[0] *= 16  # V past FP8 range after the scale: saturates (the GEMM stays exact)
    cache_loc = torch.randperm(S, device="cuda")[:40]
    written = {}
    for path in ("fused", "gemm"):
        draft.m.projection_path = path
        k_pool, v_pool, kv_layout = _pool(layout, pool_dtype, 128)
        draft.m.into_pool(xc, pc, cache_loc, k_pool, v_pool, kv_layout=kv_layout, **scales)
        written[path] = [_rows(p, torch.arange(S), layout).to(torch.int16) for p in (k_pool, v_pool)]
    (k_fused, v_fused), (k_gemm, v_gemm) = written["fused"], written["gemm"]
    assert torch.equal(v_fused, v_gemm)
    # One FP8 step: the low 7 bits of a code count up the magnitude; across zero, both within a step of it.
    mag_f, mag_g = k_fused & 0x7F, k_gemm & 0x7F
    same_sign = (k_fused >> 7) == (k_gemm >> 7)
    assert ((same_sign & ((mag_f - mag_g).abs() <= 1)) | (mag_f + mag_g <= 1)).all()


# ------------------------------------------------------- graphs, compile, sync


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.parametrize("pool", [False, True], ids=["dense", "into_pool"])
def test_cuda_graph_fused(pool: bool) -> None:
    """A fused call captured at a fixed T, replayed with new inputs copied in: the eager fused bits."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=64, hidden=512, bias=True)
    _, _, hidden, positions = cuda_call(draft, 48)
    slots = torch.randperm(S, device="cuda")[:48]
    k_pool = torch.zeros(L, S, H, 128, dtype=torch.bfloat16, device="cuda")
    v_pool = torch.zeros_like(k_pool)

    def step() -> tuple[Tensor, Tensor] | None:
        if pool:
            draft.m.into_pool(hidden, positions, slots, k_pool, v_pool)
            return None
        k, v = draft.m(hidden, positions)
        return k, v

    graph, out = capture(step)
    for seed in range(3):
        _, _, new_hidden, new_positions = cuda_call(draft, 48, seed=30 + seed)
        new_slots = torch.randperm(S, device="cuda")[:48]
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        want_k, want_v = draft.m(new_hidden, new_positions)
        k, v = (k_pool[:, new_slots], v_pool[:, new_slots]) if pool else out
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert draft.m._workspace is None  # the fused path has no GEMM output


@pytest.mark.parametrize("num_tokens", [16, 64])
def test_next_kernel_reads_the_fused_output_cuda(num_tokens: int) -> None:
    """On Hopper the fused kernel lets the next kernel launch once its weight loops are done
    (`typedkv.projection.tuning.ProjectionConfig.signal_next`): a programmatic launch right after it that reads its K and V
    reads them whole, eagerly and in a replayed graph, the two inputs alternating.

    K and V are written as views of one ``[T, L, 2, H, D]`` buffer, which `typedkv.materialize_kv` then
    takes as its kv (its kernel waits for the prior one's end before its first load).
    """
    from typedkv.core import launcher

    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=4096)
    m, width = draft.m, 2 * H * 128
    buf = torch.empty(num_tokens, L, 2, H, 128, dtype=torch.bfloat16, device="cuda")
    k_out, v_out = (buf[:, :, i].permute(1, 0, 2, 3) for i in range(2))
    inputs = [cuda_call(draft, num_tokens, seed=40 + i)[2:] for i in range(2)]
    hidden, positions = (t.clone() for t in inputs[0])

    def step(i: int) -> tuple[Tensor, Tensor]:
        hidden.copy_(inputs[i % 2][0])
        positions.copy_(inputs[i % 2][1])
        m(hidden, positions, k_out=k_out, v_out=v_out)
        return typedkv.materialize_kv(
            buf.view(num_tokens, L, width), m.k_norm_weight, m.eps, m.cos_sin_cache, positions, num_kv_heads=H
        )

    want = []
    for i in range(2):
        hidden.copy_(inputs[i][0])
        positions.copy_(inputs[i][1])
        m(hidden, positions, k_out=k_out, v_out=v_out)
        torch.cuda.synchronize()
        kv = buf.view(num_tokens, L, width).clone()
        want.append(typedkv.materialize_kv(kv, m.k_norm_weight, m.eps, m.cos_sin_cache, positions, num_kv_heads=H))
        torch.cuda.synchronize()
    assert not torch.equal(want[0][0], want[1][0])
    for i in range(6):
        k, v = step(i)
        torch.cuda.synchronize()
        assert torch.equal(k, want[i % 2][0]) and torch.equal(v, want[i % 2][1])
    graph, out = capture(lambda: (step(1), step(0))[1])
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[0][0]) and torch.equal(out[1], want[0][1])
    # The calls above ran the signalling kernel (on Hopper): not a test of a kernel that signals nothing.
    (kept,) = m._plans.values()
    ptx = [launch.compiled.asm["ptx"] for launch in kept.launches.values() if launch.compiled is not None]
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert ptx and all(
        ("griddepcontrol.launch_dependents" in text) is (hopper and launcher.PROGRAMMATIC_LAUNCH) for text in ptx
    )


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.usefixtures("fresh_compile")
def test_compiled_into_pool_fused_pinned() -> None:
    """torch.compile(fullgraph=True) of into_pool with the fused path pinned: one fused op, the eager bits."""
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512, bias=True)
    _, _, hidden, positions = cuda_call(draft, 48)
    slots = torch.randperm(S, device="cuda")[:48]
    want_k, want_v = draft.m(hidden, positions)

    def into_pool(hidden: Tensor, k_pool: Tensor, v_pool: Tensor) -> None:
        draft.m.into_pool(hidden, positions, slots, k_pool, v_pool)

    k_pool = torch.zeros(L, S, H, 128, dtype=torch.bfloat16, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    _, code = run_and_get_code(torch.compile(into_pool, fullgraph=True), hidden, k_pool, v_pool)
    assert "project_kv_into_pool_stacked" in "\n".join(code)
    assert torch.equal(k_pool[:, slots], want_k) and torch.equal(v_pool[:, slots], want_v)
    assert draft.m._workspace is None


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.usefixtures("fresh_compile")
def test_compiled_reduce_overhead_fused() -> None:
    """mode="reduce-overhead" (CUDA graphs by torch.compile) with the fused path pinned: replays follow new inputs."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=64, hidden=512)
    run = torch.compile(draft.m, mode="reduce-overhead", fullgraph=True)
    mark_step: Callable[[], None] = torch.compiler.cudagraph_mark_step_begin  # an untyped function to mypy
    for seed in range(4):  # warm-up, record, then replays
        _, _, hidden, positions = cuda_call(draft, 32, seed=10 + seed)
        mark_step()
        k, v = (t.clone() for t in run(hidden, positions))
        want_k, want_v = draft.m(hidden, positions)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.usefixtures("weight_loads")
def test_fused_makes_no_sync() -> None:
    """Production mode: fused calls (dense, FP8 pool with a tensor scale, per-layer pools) never sync."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512, eps=[1e-6, 1e-5, 1e-4])
    _, _, hidden, positions = cuda_call(draft, 64)
    slots = torch.randperm(S, device="cuda")[:64]
    k_pool = torch.empty(L, S, H, 128, dtype=torch.float8_e4m3fn, device="cuda")
    v_pool = torch.empty_like(k_pool)
    pools = [torch.empty(S, H, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2 * L)]
    scale = torch.ones(L, device="cuda")

    def calls() -> None:
        draft.m(hidden, positions)
        draft.m.into_pool(hidden, positions, slots, k_pool, v_pool, k_scale=scale, v_scale=0.5)
        draft.m.into_pool(hidden, positions, slots, pools[:L], pools[L:])

    assert_no_sync(calls)


# ------------------------------------------------------------- out of bounds


def test_fused_sample_cuda() -> None:
    """tests/fused_sample.py in process: every destination's guard bytes intact, results as the GEMM path's."""
    import fused_sample

    assert fused_sample.main(["--device", "cuda"]) == 0


def test_fused_sample_under_memcheck() -> None:
    """compute-sanitizer's memcheck over the fused path's calls (tests/fused_sample.py)."""
    run_under_memcheck(Path(__file__).with_name("fused_sample.py"), ["--device", "cuda"], "fused sample done", 900)


def test_weights_by_tma_above_64_tokens_cuda() -> None:
    """On Hopper the defaults load the weight's tiles by TMA above T = 16 (here 300) where the layout allows: the
    oracle's K and V; GPT-J pairs (rows not consecutive) load by pointer."""
    from typedkv.projection import launch as fused_launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    for rope_style, by_tma in (("neox", True), ("gptj", False)):
        draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512, rope_style=rope_style)
        x, positions, xc, pc = cuda_call(draft, 300)
        assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
        launches = [launch for kept in draft.m._plans.values() for launch in kept.launches.values()]
        blocks = [launch.weight_blocks for launch in launches if isinstance(launch, fused_launch.ProjectionLaunch)]
        assert len(blocks) == len(launches)
        assert [b is not None for b in blocks] == [by_tma]


def test_auto_takes_fused_to_128_tokens_where_weights_load_by_tma_cuda() -> None:
    """On a device the measured tables know, "auto" takes the fused kernel exactly where the table of its weight
    tiles' way says: by TMA (NeoX, `Tuning.fused_faster_tma`) at T = 48 and 100, by pointer (GPT-J pairs,
    `Tuning.fused_faster`) at 48 on the H100 and at neither on the H200; GEMM + kernel elsewhere."""
    from typedkv.projection import tuning

    if not tuning.tuning_of(torch.cuda.get_device_name()).fused_faster_tma:
        pytest.skip("no measured table for this device")
    device = torch.device("cuda")
    cases = [(style, t) for style in ("neox", "gptj") for t in (48, 100)]
    programs = 5 * 2 * 8  # the main case's: 5 layers, K and V, 8 KV heads
    fused_ways = {
        case: tuning.projection_fused_faster(device, case[1], tma=case[0] == "neox", programs=programs)
        for case in cases
    }
    # Both ways must be seen, or the test would not show that "auto" follows the tables.
    assert len(set(fused_ways.values())) == 2, fused_ways
    for rope_style, num_tokens in cases:
        # A materializer of its own for each call: the fused path leaves no GEMM rows, the GEMM path makes them.
        draft = cuda_draft(
            torch.bfloat16, "auto", head_dim=128, rotary_dim=128, hidden=512, rope_style=rope_style, layers=5, heads=8
        )
        x, positions, xc, pc = cuda_call(draft, num_tokens)
        assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
        assert (draft.m._workspace is None) == fused_ways[rope_style, num_tokens], (rope_style, num_tokens)


@pytest.mark.parametrize(
    ("layers", "heads", "head_dim", "fused"),
    [(5, 8, 128, True), (1, 8, 128, False), (5, 1, 512, False)],
    ids=["L5-H8-D128", "L1-H8-D128", "L5-H1-D512"],
)
def test_auto_takes_gemm_where_the_fused_kernel_cannot_fill_the_gpu_cuda(
    layers: int, heads: int, head_dim: int, fused: bool
) -> None:
    """On a device the measured tables know, at T = 16: the main case's draft takes the fused kernel; a
    one-layer draft (EAGLE-3's 16 programs) and one of heads of 512 (Gemma-4's) take GEMM + kernel."""
    from typedkv.projection import tuning

    if not tuning.tuning_of(torch.cuda.get_device_name()).fused_faster_tma:
        pytest.skip("no measured table for this device")
    draft = cuda_draft(
        torch.bfloat16, "auto", head_dim=head_dim, rotary_dim=head_dim, hidden=512, layers=layers, heads=heads
    )
    x, positions, xc, pc = cuda_call(draft, 16)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    assert (draft.m._workspace is None) == fused


@pytest.mark.production
def test_new_token_count_compiles_nothing_fused() -> None:
    """The fused kernel compiles once per launch configuration (the T ranges of `PROJECTION_BLOCKS` and
    `PROJECTION_BLOCKS_TMA`), never per T."""
    from typedkv.projection import kernel as fused_kernel

    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=128, hidden=512)
    for num_tokens in (16, 32, 64, 128, 256, 512):  # one T in each range of the tables
        draft.m(*cuda_call(draft, num_tokens)[2:])
    before = compiled_variants(fused_kernel.project_kv_kernel)
    for num_tokens in (1, 9, 17, 33, 65, 129, 257, 1000):
        draft.m(*cuda_call(draft, num_tokens)[2:])
    torch.cuda.synchronize()
    assert compiled_variants(fused_kernel.project_kv_kernel) == before


@pytest.mark.usefixtures("weight_loads")
@pytest.mark.production
def test_per_layer_pools_off_16_bytes_after_aligned_cuda() -> None:
    """Per-layer pools on 16 bytes, then one element off them, then on again (one layout): the oracle's rows.

    The fused launch kept for the first call stores whole vectors; reused for the second,
    the GPU would fault on a misaligned address.
    """
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, head_dim=128, rotary_dim=64, bias=True)
    x, positions, xc, pc = cuda_call(draft, 16)
    cache_loc = torch.randperm(S)[:16]
    k64, v = draft.oracle(x, positions)
    for layout in ("list", "list_unaligned", "list"):
        k_pool, v_pool, _ = _pool(layout, torch.bfloat16, 128)
        draft.m.into_pool(xc, pc, cache_loc.cuda(), k_pool, v_pool)
        torch.cuda.synchronize()
        got = (_rows(k_pool, cache_loc, layout), _rows(v_pool, cache_loc, layout))
        assert_matches_oracle(got, (k64, v), torch.bfloat16)


# ------------------------------------------------- V written by the GEMM


@pytest.fixture
def split_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM path writes V straight into dense outputs at every T on this GPU (the H200's table says T >= 2048)."""
    from typedkv.projection import tuning

    monkeypatch.setitem(
        tuning.TUNING, *tuning.measured(torch.cuda.get_device_name(), split_gemm_faster=((1, float("inf")),))
    )


def _ways(m: typedkv.KVMaterializer) -> set[str]:
    return {kept.way for kept in m._plans.values()}


@pytest.mark.usefixtures("split_here")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(128, 128), (128, 64), (64, 64), (80, 32)])
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("num_tokens", [17, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_grid_cuda(
    dtype: torch.dtype, num_tokens: int, rope_style: typedkv.RopeStyle, head_dim: int, rotary_dim: int, bias: bool
) -> None:
    """Two batched GEMMs (V's into v_out), then the K/V kernel on K alone: the oracle's K and V, bf16 included.

    With a bias, GEMM + kernel: on CUDA torch.baddbmm was seen to round the product before adding the bias.
    """
    draft = cuda_draft(
        dtype, "gemm", head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style, bias=bias, hidden=256
    )
    x, positions, xc, pc = cuda_call(draft, num_tokens)
    assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), dtype)
    assert _ways(draft.m) == {"gemm" if bias else "split"}


def test_split_is_the_h200_default_from_65536_cuda() -> None:
    """On the H200 the GEMM path writes V itself from T = 65536 on (the measured table); below, GEMM + kernel."""
    if torch.cuda.get_device_name() != "NVIDIA H200":
        pytest.skip("the measured table is the H200's")
    draft = cuda_draft(torch.bfloat16, "auto", head_dim=128, rotary_dim=64, hidden=16)
    for num_tokens in (65535, 65536):
        x, positions, xc, pc = cuda_call(draft, num_tokens)
        assert_matches_oracle(cpu(draft.m(xc, pc)), draft.oracle(x, positions), torch.bfloat16)
    assert _ways(draft.m) == {"gemm", "split"}


@pytest.mark.usefixtures("split_here")
def test_split_matches_gemm_path_on_random_inputs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the grid: V written by the batched GEMM against GEMM + kernel (their only difference the accumulation order)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    weight = (torch.randn(L, 2 * H * 128, 4096, device="cuda", generator=g) / 64).bfloat16()
    m = typedkv.KVMaterializer(
        weight, torch.rand(L, 128, device="cuda", generator=g) + 0.5, [1e-6, 1e-5, 1e-4],
        torch.randn(P, 128, device="cuda", generator=g), num_kv_heads=H,
    )  # fmt: skip
    m.projection_path = "gemm"
    x = torch.randn(2048, 4096, device="cuda", generator=g).bfloat16()
    positions = torch.randint(0, P, (2048,), device="cuda", generator=g)
    got = m(x, positions)
    from typedkv.projection import tuning

    monkeypatch.setitem(tuning.TUNING, *tuning.measured(torch.cuda.get_device_name(), split_gemm_faster=()))
    monkeypatch.setitem(tuning.TUNING, *tuning.measured(torch.cuda.get_device_name(), warp_specialized_faster=()))
    m.projection_path = "auto"  # a new key: the layout checked again, and now GEMM + kernel
    want = m(x, positions)
    assert _ways(m) == {"split", "gemm"}
    torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("split_here")
def test_cuda_graph_split() -> None:
    """A split call captured at a fixed T, replayed with new inputs copied in: the eager bits; eager calls after it too."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, "gemm", head_dim=128, rotary_dim=64, hidden=512)
    _, _, hidden, positions = cuda_call(draft, 300)
    graph, out = capture(lambda: draft.m(hidden, positions))
    for seed in range(3):
        x, p, new_hidden, new_positions = cuda_call(draft, 300, seed=40 + seed)
        hidden.copy_(new_hidden)
        positions.copy_(new_positions)
        graph.replay()
        torch.cuda.synchronize()
        want_k, want_v = draft.m(new_hidden, new_positions)
        assert torch.equal(out[0], want_k) and torch.equal(out[1], want_v)
        assert_matches_oracle(cpu(out), draft.oracle(x, p), torch.bfloat16)
    assert _ways(draft.m) == {"split"}


@pytest.mark.usefixtures("split_here")
def test_split_makes_no_sync() -> None:
    """Production mode: a split call never syncs."""
    typedkv.set_debug(False)
    draft = cuda_draft(torch.bfloat16, "gemm", head_dim=128, rotary_dim=128, hidden=512, eps=[1e-6, 1e-5, 1e-4])
    _, _, hidden, positions = cuda_call(draft, 300)
    assert_no_sync(lambda: _discard(draft.m(hidden, positions)))
    assert _ways(draft.m) == {"split"}


def _discard(_: object) -> None:
    return None
