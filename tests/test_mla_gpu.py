"""MLA ops on CUDA: the Triton kernel against the float64 oracle and the CPU path, poisoned pools, CUDA graphs.

Run with ``pytest -m gpu tests/test_mla_gpu.py`` on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from memcheck import run_under_memcheck
from test_mla import FP8, LAYOUTS, STORAGE, STYLES, Inputs, assert_close_to_oracle, make_inputs, run_pool
from torch import Tensor

import typedkv
from typedkv import RopeStyle

pytestmark = pytest.mark.gpu
CUDA = "cuda"


@pytest.mark.parametrize("dtype", STORAGE)
@pytest.mark.parametrize("rope_style", STYLES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("num_tokens", "kv_lora_rank", "rotary_dim"), [(1, 512, 64), (37, 512, 64), (300, 96, 32)])
def test_kernel_matches_float64(
    dtype: torch.dtype, rope_style: RopeStyle, norm: bool, num_tokens: int, kv_lora_rank: int, rotary_dim: int
) -> None:
    inputs = make_inputs(num_tokens, 5, kv_lora_rank, rotary_dim, dtype, rope_style, norm=norm, device=CUDA)
    out = inputs.dense()
    assert out.is_cuda
    assert_close_to_oracle(out, inputs)
    if not norm:
        assert torch.equal(out[..., :kv_lora_rank], inputs.ckv.transpose(0, 1)[..., :kv_lora_rank])


@pytest.mark.parametrize("rope_style", STYLES)
def test_kernel_matches_the_cpu_path(rope_style: RopeStyle) -> None:
    """The GPU's rows are the CPU path's to one bfloat16 ulp of each row's largest value.

    float32 sums and rsqrt differ in order, so a normed value may round to its other
    neighbour; RoPE then mixes two such values, and where they nearly cancel the
    difference is one ulp of the inputs, not of the (small) result.
    """
    inputs = make_inputs(64, 5, 512, 64, torch.bfloat16, rope_style, per_layer_eps=True, device=CUDA)
    gpu = inputs.dense().cpu().float()
    cpu = inputs.cpu().dense().float()
    row_max = cpu.abs().amax(-1, keepdim=True)
    assert ((gpu - cpu).abs() <= torch.finfo(torch.bfloat16).eps * row_max).all()
    assert (gpu == cpu).float().mean() > 0.99


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pools_poisoned(layout: str) -> None:
    inputs = make_inputs(70, 5, 512, 64, torch.bfloat16, "gptj", device=CUDA)
    cache_loc = torch.randperm(200, device=CUDA)[:70]
    cache_loc[::7] = -1
    run_pool(inputs, layout, cache_loc, 200)


@pytest.mark.parametrize("pool_dtype", FP8)
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
def test_fp8_pools_match_the_cpu_path(pool_dtype: torch.dtype, scale: str) -> None:
    """FP8 rows within one FP8 step of the CPU path's (the float32 before the cast may differ in its last bit)."""
    inputs = make_inputs(40, 5, 512, 64, torch.bfloat16, "gptj", device=CUDA)
    kv_scale = {"none": None, "float": 0.05, "tensor": torch.tensor([0.5, 2.0, 0.01, 1.0, 0.1], device=CUDA)}[scale]
    cache_loc = torch.randperm(64, device=CUDA)[:40]
    pool = torch.zeros(5, 64, 576, device=CUDA).to(pool_dtype)
    inputs.into_pool(cache_loc, pool, kv_scale)
    cpu_pool = torch.zeros(5, 64, 576).to(pool_dtype)
    cpu_scale = kv_scale.cpu() if isinstance(kv_scale, Tensor) else kv_scale
    inputs.cpu().into_pool(cache_loc.cpu(), cpu_pool, cpu_scale)
    got, want = pool.cpu().float(), cpu_pool.float()
    step = 2.0 ** -(3 if pool_dtype == torch.float8_e4m3fn else 2)
    assert ((got - want).abs() <= step * want.abs() + 2**-9).all()
    assert (got == want).float().mean() > 0.99
    assert got.abs().max() <= torch.finfo(pool_dtype).max  # saturated, never inf


def test_no_host_sync_in_production() -> None:
    typedkv.set_debug(False)
    inputs = make_inputs(16, 5, 512, 64, torch.bfloat16, "gptj", per_layer_eps=True, device=CUDA)
    pool = [torch.zeros(8, 64, 576, dtype=torch.float8_e4m3fn, device=CUDA) for _ in range(5)]
    scale = torch.ones(5, device=CUDA)
    loc = torch.arange(16, device=CUDA)
    inputs.dense()
    inputs.into_pool(loc, pool, scale)  # first calls: plans built, kernels compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inputs.dense()
        inputs.into_pool(loc, pool, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _replayed(inputs: Inputs, fresh: Inputs, cache_loc: Tensor, pool: list[Tensor]) -> None:
    """Capture one call into ``pool``, then replay it on ``fresh``'s values copied into the captured inputs."""
    inputs.into_pool(cache_loc, pool)  # warm-up: plan, compile, layer table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inputs.into_pool(cache_loc, pool)
    for layer in pool:
        layer.zero_()
    inputs.ckv.copy_(fresh.ckv)
    inputs.positions.copy_(fresh.positions)
    graph.replay()
    torch.cuda.synchronize()


def test_cuda_graph_replay() -> None:
    typedkv.set_debug(False)
    inputs = make_inputs(24, 5, 512, 64, torch.bfloat16, "gptj", device=CUDA)
    fresh = make_inputs(24, 5, 512, 64, torch.bfloat16, "gptj", num_positions=40, device=CUDA)
    fresh = Inputs(
        fresh.ckv * 2, inputs.kv_norm_weight, inputs.eps, inputs.cos_sin_cache, fresh.positions.flip(0), "gptj"
    )
    cache_loc = torch.randperm(40, device=CUDA)[:24]
    pool = [torch.zeros(40, 1, 576, dtype=torch.bfloat16, device=CUDA) for _ in range(5)]  # sglang
    _replayed(inputs, fresh, cache_loc, pool)
    want = fresh.dense()
    for layer in range(5):
        assert torch.equal(pool[layer][cache_loc, 0], want[layer])


def test_materializer_in_a_cuda_graph() -> None:
    typedkv.set_debug(False)
    g = torch.Generator(device=CUDA).manual_seed(3)
    weight = torch.randn(5, 576, 256, device=CUDA, generator=g).to(torch.bfloat16) / 16
    norm = torch.rand(5, 512, device=CUDA, generator=g) + 0.5
    cache = torch.randn(64, 64, device=CUDA, generator=g)
    m = typedkv.MLAKVMaterializer(weight, norm, 1e-6, cache, rope_style="gptj")
    hidden = torch.randn(8, 256, device=CUDA, generator=g).to(torch.bfloat16)
    positions = torch.arange(8, device=CUDA)
    cache_loc = torch.arange(8, device=CUDA) * 3
    pool = torch.zeros(5, 8, 64, 576, dtype=torch.bfloat16, device=CUDA)  # vLLM-style pages of 64
    m.into_pool(hidden, positions, cache_loc, pool)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.into_pool(hidden, positions, cache_loc, pool)
    pool.zero_()
    m(torch.randn(200, 256, device=CUDA).to(torch.bfloat16), torch.zeros(200, dtype=torch.long, device=CUDA))
    new_hidden = torch.randn(8, 256, device=CUDA, generator=g).to(torch.bfloat16)
    hidden.copy_(new_hidden)
    graph.replay()
    want = m(new_hidden, positions)
    flat = pool.view(5, -1, 576)
    assert torch.equal(flat[:, cache_loc], want)


def test_mla_fuzz_sample_under_memcheck() -> None:
    """compute-sanitizer's memcheck over a few drawn MLA calls in each mode (tests/mla_fuzz_sample.py)."""
    script = Path(__file__).with_name("mla_fuzz_sample.py")
    run_under_memcheck(script, ["--examples", "8"], "mla fuzz sample done", 900)
