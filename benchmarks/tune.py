"""Developer script for the H200: check the kernel on CUDA and break down host time.

Not part of the package. Usage (on a CUDA machine): ``python benchmarks/tune.py OUT_DIR``.
Launch configurations are swept by ``benchmarks/explore.py``. Results feed
``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import typedkv
from typedkv import _bench, _launch, _reference
from typedkv._value_checks import check_positions


def correctness() -> list[str]:
    """Kernel vs the PyTorch reference on CUDA, fresh random data, several shapes and both pool kinds."""
    out = []
    torch.manual_seed(1)
    cases: list[tuple[int, int, int, int, torch.dtype, typedkv.RopeStyle]] = [
        (5, 8, 128, 128, torch.bfloat16, "neox"),
        (2, 8, 256, 64, torch.bfloat16, "gptj"),
        (3, 4, 80, 80, torch.float16, "neox"),
        (1, 3, 96, 32, torch.float32, "gptj"),
    ]
    for L, H, D, R, dtype, style in cases:
        T, P = 777, 5000
        kv = torch.randn(T, L, 2 * H * D, device="cuda", dtype=dtype)
        w = torch.rand(L, D, device="cuda") + 0.5
        cs = torch.randn(P, R, device="cuda")
        pos = torch.randint(0, P, (T,), device="cuda")
        k, v = typedkv.materialize_kv(kv, w, 1e-6, cs, pos, num_kv_heads=H, rope_style=style)
        kr, vr = _reference.rmsnorm_rope(kv, w, 1e-6, cs, pos, H, style == "neox")
        kr = kr.to(dtype)
        rel = ((k.double() - kr.double()).norm() / kr.double().norm()).item()
        S = 2 * T
        slots = torch.randperm(S, device="cuda")[:T]
        for fmt in (dtype, torch.float8_e4m3fn, torch.float8_e5m2):
            kp = torch.full((L, S, H, D), 7.0, device="cuda").to(fmt)
            typedkv.set_debug(True)  # one call in debug mode: exercises the value checks on CUDA
            vp = kp.clone()
            scale = 0.5 if fmt != dtype else None
            typedkv.materialize_kv_into_pool(
                kv, w, 1e-6, cs, pos, slots, kp, vp, num_kv_heads=H, rope_style=style, k_scale=scale, v_scale=scale
            )
            typedkv.set_debug(False)
            kq = _reference.quantize(
                kr if fmt == dtype else _reference.rmsnorm_rope(kv, w, 1e-6, cs, pos, H, style == "neox")[0], scale, fmt
            )
            vq = _reference.quantize(vr, scale, fmt)
            k_ok = (kp[:, slots].float() - kq.float()).abs().max().item()
            v_ok = torch.equal(vp[:, slots].view(torch.uint8), vq.view(torch.uint8))
            untouched = torch.ones(S, dtype=torch.bool, device="cuda")
            untouched[slots] = False
            rest_ok = bool((kp[:, untouched].float() == 7.0).all() and (vp[:, untouched].float() == 7.0).all())
            out.append(
                f"pool {fmt} L{L} H{H} D{D} R{R} {style}: K max|diff| {k_ok:.3g}, V bit-equal {v_ok}, other rows untouched {rest_ok}"
            )
        out.append(f"dense {dtype} L{L} H{H} D{D} R{R} {style}: K rel {rel:.2e}, V equal {torch.equal(v, vr)}")
    return out


def host_breakdown() -> dict[str, float]:
    """Where host time goes at T = 16: plan lookup, per-call values, the launch, full calls."""
    x = _bench.make_inputs(_bench.MAIN, 16, torch.device("cuda"))
    args = typedkv._impl.DenseCall(x.kv, x.weight, x.eps, x.cos_sin, x.positions, 8, "neox", x.k_out, x.v_out)
    sig = typedkv._impl.DENSE.signature

    def timed(fn: Any, n: int = 5000) -> float:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        el = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        return el

    typedkv.materialize_kv(x.kv, x.weight, x.eps, x.cos_sin, x.positions, num_kv_heads=8, k_out=x.k_out, v_out=x.v_out)
    plan = typedkv._impl.dense_layout(args)  # the production call's plan, its launch built by the call above
    launch = plan.launch
    assert launch is not None
    values = _launch.varying(x.kv, x.weight, x.eps, x.cos_sin, x.positions, None, x.k_out, x.v_out, None)
    out = {
        "full_check_us": timed(lambda: sig.check(args)),
        "plan_lookup_us": timed(lambda: typedkv._impl.dense_layout(args)),
        "varying_us": timed(
            lambda: _launch.varying(x.kv, x.weight, x.eps, x.cos_sin, x.positions, None, x.k_out, x.v_out, None)
        ),
        "launch_call_us": timed(lambda: launch(values)),
        "direct_compiled": float(launch.compiled is not None),
        "positions_check_us": timed(lambda: check_positions(x.positions, 131072), n=1000),
    }
    bound = sig.check(args)
    out["debug_typecheck_us"] = timed(lambda: sig.debug_check(args, bound), n=300)
    out.update(_bench.host_overhead(torch.device("cuda")))
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    report["correctness"] = correctness()
    print("\n".join(report["correctness"]), flush=True)
    report["host"] = host_breakdown()
    print(json.dumps(report["host"], indent=1), flush=True)
    roof = _bench.copy_roofline_gbps(torch.device("cuda"))
    report["copy_GBps"] = roof
    print("copy", roof, flush=True)
    (out_dir / "tune.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
