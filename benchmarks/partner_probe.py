"""K's RoPE partners gathered in registers or loaded again, where K is one tile (a developer script).

Not part of the package. Usage: ``python benchmarks/partner_probe.py [--check] [rounds]``.
Where K is handled as one tile (NeoX RoPE over part of the head, `typedkv._kernel._k_row`), each
rotary dim's partner ``d +- R/2`` can come from a second load of the row (an L1 hit) or from
the normed row in registers (``tl.gather``; `typedkv._launch.KVConfig.partner_gather`). This times
`typedkv.materialize_kv` both ways, interleaved round by round as ``typedkv bench`` times
(`typedkv._bench.paired_gpu_time_us`, rotating input sets), at head shapes with R < D, dense outputs
and a bf16 pool, and prints the loaded way's time over the gathered way's (above 1: gathering
faster) per case. ``--check``: the two ways' K and V compared bit for bit first, on fresh random
inputs (on CUDA, or under ``TRITON_INTERPRET=1`` on CPU tensors at small T).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace

import torch
from peer_design import configured

from typedkv import _bench, _bench_e2e, _launch

CASES = (
    (_bench.Case("L2 H8 D256 R64", 2, 8, 256, 64), (16, 256, 2048, 16384)),
    (_bench.Case("L5 H8 D128 R64", 5, 8, 128, 64), (16, 256, 2048, 16384)),
    (_bench.Case("L5 H4 D64 R32", 5, 4, 64, 32), (64, 2048, 16384)),
    (_bench.Case("L5 H8 D128 R64 rope-only", 5, 8, 128, 64, norm=False), (2048,)),
    (_bench.Case("L5 H8 D128 R64 pool", 5, 8, 128, 64, pool="bf16"), (64, 2048)),
)
DEFAULT = _launch.launch_params.__kwdefaults__["config"]  # type: ignore[index]
LOADED = replace(DEFAULT, partner_gather=False)
GATHERED = replace(DEFAULT, partner_gather=True)


def check(device: torch.device) -> None:
    for case, sizes in CASES:
        for tokens in sizes[:1] if device.type == "cpu" else sizes:
            x = _bench.make_inputs(case, tokens, device)
            outs = []
            for config in (LOADED, GATHERED):
                configured(_bench.typedkv_call(case, x), config)()
                out = (x.k_pool, x.v_pool) if case.pool else (x.k_out, x.v_out)
                outs.append([t.clone() for t in out])
            # Bit for bit (a pool's rows the call leaves alone may hold NaNs, unequal to themselves).
            same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*outs, strict=True))
            assert same, (case.name, tokens)
            print(f"check {case.name:>26} T={tokens:<5} K and V bit-equal")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(args[0]) if args else 5
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--check" in sys.argv:
        check(device)
    if device.type != "cuda":
        return
    for case, sizes in CASES:
        for tokens in sizes:
            nbytes = _bench.bytes_moved(case, tokens)
            inputs = [_bench.make_inputs(case, tokens, device) for _ in range(_bench.rotating_sets(nbytes))]
            calls = {
                name: [configured(_bench.typedkv_call(case, x), config) for x in inputs]
                for name, config in (("loaded", LOADED), ("gathered", GATHERED))
            }
            times = _bench.paired_gpu_time_us(calls, rounds=rounds)
            ratio = _bench_e2e.paired_ratio(times["loaded"], times["gathered"])
            print(
                f"partner {case.name:>26} T={tokens:<6} loaded {statistics.median(times['loaded']):9.2f} us  "
                f"gathered {statistics.median(times['gathered']):9.2f} us  loaded / gathered "
                f"{ratio.median:5.3f} ({ratio.low:.3f}-{ratio.high:.3f})"
            )
            del calls, inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
