"""Developer script for a CUDA machine: the MLA kernel's launch configuration against the copy roofline.

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/mla_sweep.py``. For each
MLA bench case at T = 16384 and 65536, each launch configuration of a short list around the
default (elements per program, warps) is timed as `typedkv bench` times (CUDA-graph replays
over rotating inputs) and printed as % of copy; the best is what `typedkv.mla.launch.MLAConfig`'s
defaults should be. The pool cases also run without the norm (the latent copied): a bound for the same scattered
rows. The last run and the alternatives it ruled out: docs/decisions/010-mla-kernel-configuration.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch

from typedkv.mla import launch as mla_launch
from typedkv.tools import cases as bench_cases
from typedkv.tools import timing


def main() -> None:
    device = torch.device("cuda")
    roof = timing.copy_roofline_gbps(device)
    print(f"copy: {roof:.0f} GB/s")
    cases = [c for c in bench_cases.GPU_CASES if c.kv_lora_rank and c.norm]
    # Bounds: the pool cases with the latent copied bit for bit (no norm), the same scattered rows.
    cases += [dataclasses.replace(c, name=f"{c.name} no-norm", norm=False) for c in cases if c.pool == "bf16"]
    configs = [mla_launch.MLAConfig(tile, warps) for tile, warps in ((1024, 1), (2048, 1), (2048, 2), (1024, 2))]
    for case, num_tokens in itertools.product(cases, (16384, 65536)):
        nbytes = bench_cases.bytes_moved(case, num_tokens)
        sets = bench_cases.rotating_sets(nbytes)
        inputs = [bench_cases.make_inputs(case, num_tokens, device) for _ in range(sets)]
        # Every configuration of a case back to back, so host noise hits them alike.
        for config in configs:
            calls = [_launch_of(case, x, config) for x in inputs]
            us = timing.gpu_time_us(calls)
            print(
                f"{case.name:>34} T={num_tokens:<6} tile={config.tile:<5} warps={config.num_warps}  "
                f"{us:9.1f} us  {100 * nbytes / us / 1e3 / roof:5.1f}% of copy",
                flush=True,
            )
        del inputs
        torch.cuda.empty_cache()


def _launch_of(case: bench_cases.Case, x: bench_cases.Inputs, config: mla_launch.MLAConfig) -> Callable[[], None]:
    """One launch with ``config`` (built here: the ops cache their launch per layout, with the default)."""
    neox = case.rope_style == "neox"
    inputs = (x.norm_weight, x.eps, x.cos_sin, x.positions)
    if case.pool:
        pool = x.k_pool
        strides = (pool.stride(0), pool.stride(1), pool.stride(2) if pool.dim() == 4 else 0)
        page = pool.shape[2] if pool.dim() == 4 else 1
        scale = 0.5 if case.pool == "fp8" else None
        values = mla_launch.call_values(x.kv, inputs, x.slots, pool, None, scale)
        launch = mla_launch.mla_launch(
            values, strides, kv_lora_rank=case.kv_lora_rank, page_size=page, num_rows=pool.shape[1] * page, neox=neox,
            config=config,
        )  # fmt: skip
    else:
        out = x.k_out
        values = mla_launch.call_values(x.kv, inputs, None, out, None, None)
        launch = mla_launch.mla_launch(
            values, (out.stride(0), out.stride(1), 0), kv_lora_rank=case.kv_lora_rank, page_size=1,
            num_rows=out.shape[1], neox=neox, config=config,
        )  # fmt: skip
    return lambda: launch(values)


if __name__ == "__main__":
    main()
