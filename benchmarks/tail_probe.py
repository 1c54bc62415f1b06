"""The warp-specialised kernel's last wave as a second launch that takes SMs as the first frees them (H200 script).

Not part of the package. Usage: ``python benchmarks/tail_probe.py [T ...]`` (896 1024 1152 1280 1536 1792
2048 unless given).

The kernel is persistent: one program per SM takes its tiles in turn, so a launch lasts as long as its
busiest program. At T = 1024 the 320 two-head tiles are 2.42 waves of the 132 SMs; `WS_TILES` takes
one-head tiles there (5 waves of 640, 4.85 full), whose loads per product are a third larger. Here
the first ``A`` token blocks take two-head tiles in one launch, as many as fill whole waves; a second
launch takes the other blocks' tiles by one head, one program a tile. The first's programs signal
``griddepcontrol.launch_dependents`` as they start and the second is a programmatic dependent launch
that does not wait before its work (it reads only ``hidden`` and the weights, never what the first
writes), so the hardware starts its programs on the SMs the first's programs leave, in turn: the
tail is cut one-head fine and placed where SMs are idle. The second waits for the first at its end
(``griddepcontrol.wait``), so whatever follows on the stream finds both done.

Per T, beside ``torch.mm`` alone into a reused buffer, timed as the end-to-end bench times
(`typedkv._bench.paired_gpu_time_us`, one input set, five rounds), dense outputs: GEMM + kernel, the
kernel with `WS_TILES`' tiles, the split (``split``), the same split with ``A`` a block smaller
(``split_less``), and the split's two launches one after the other (``split_seq``, no grid
dependency: what the overlap itself is worth). Each variant's K and V are first compared with the
kernel's: V equal, K within one bf16 step of the head's largest value. Prints each / torch.mm: the
median of the rounds' ratios and their range.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable

import torch

from typedkv import KVMaterializer, _bench, _bench_e2e, _fused_ws

TWO_HEADS = _fused_ws.Tiles(128, 3, 8, 8, 1)  # `_fused_ws._TWO_HEADS`, spelt out: a probe reads the table's rows
ONE_HEAD = _fused_ws.Tiles(128, 5, 8, 8, 1, 128)  # one head, the last tile's epilogue in the MMA warps


def blocks_for_a(num_tokens: int, rows: int, sms: int, less: bool) -> int:
    """Token blocks of the first launch: the two-head tiles of as many blocks as fill whole waves of ``sms``."""
    per_block = rows // TWO_HEADS.block_n
    waves = (math.ceil(num_tokens / TWO_HEADS.block_m) * per_block) // sms
    a = (waves * sms) // per_block
    return max(0, a - 1) if less else a


def split_call(bench: _bench_e2e.BenchDraft, hidden: torch.Tensor, positions: torch.Tensor, a_blocks: int,
               overlap: bool, one_tile: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """K and V ``[L, T, H, D]`` by the two launches: ``a_blocks`` blocks of two-head tiles, then the rest by one head."""
    draft = bench.draft
    L, H, D, T = draft.num_layers, draft.num_kv_heads, draft.head_dim, hidden.shape[0]
    k_out = torch.empty(L, T, H, D, device=hidden.device, dtype=hidden.dtype)
    v_out = torch.empty_like(k_out)
    cut = min(T, a_blocks * TWO_HEADS.block_m)
    parts = [
        (slice(0, cut), _fused_ws.Launch(TWO_HEADS, launch_dependents=overlap)),
        (slice(cut, T), _fused_ws.Launch(ONE_HEAD, one_tile, wait_prior_at_end=overlap, programmatic=overlap)),
    ]
    for rows, how in parts:
        if rows.stop > rows.start:
            _fused_ws.launch(
                hidden[rows], bench.flat, bench.norm, 1e-6, bench.rotary.cos_sin_cache, positions[rows],
                k_out[:, rows], v_out[:, rows], L, how,
            )  # fmt: skip
    return k_out, v_out


def check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], label: str) -> None:
    """V equal; K within one bf16 step (2^-7 of the head's largest magnitude)."""
    k, v = got
    k_want, v_want = want
    step = k_want.float().abs().amax(dim=-1, keepdim=True) * 2.0**-7
    k_ok = bool(((k.float() - k_want.float()).abs() <= step).all())
    print(f"  check {label}: V equal {torch.equal(v, v_want)}, K within a step {k_ok}", flush=True)


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [896, 1024, 1152, 1280, 1536, 1792, 2048]
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bench = _bench_e2e.bench_draft(device)
    draft = bench.draft
    _fused_ws.PROJECTION_WS_FASTER[name] = ((0, math.inf),)  # "fused" takes the kernel at every T

    def materializer(path: str) -> KVMaterializer:
        m = KVMaterializer(bench.weight, bench.norm, 1e-6, bench.rotary.cos_sin_cache, num_kv_heads=draft.num_kv_heads)
        m.projection_path = path
        return m

    gemm, ws = materializer("gemm"), materializer("fused")
    print(f"{'T':>6} {'A blocks':>8}  " + "  ".join(f"{v:>19}" for v in VARIANTS), flush=True)
    for num_tokens in tokens:
        _one(bench, num_tokens, sms, gemm, ws)
        torch.cuda.empty_cache()


VARIANTS = ("gemm", "ws", "split", "split_less", "split_seq", "split_persistent")


def _one(bench: _bench_e2e.BenchDraft, num_tokens: int, sms: int, gemm: KVMaterializer, ws: KVMaterializer) -> None:
    """One T's check and line."""
    device = bench.flat.device
    x = _bench_e2e._inputs(bench.draft, num_tokens, device)
    out = torch.empty(num_tokens, bench.flat.shape[0], device=device, dtype=bench.draft.dtype)
    a = blocks_for_a(num_tokens, bench.flat.shape[0], sms, less=False)
    a_less = blocks_for_a(num_tokens, bench.flat.shape[0], sms, less=True)
    want = ws(x.hidden, x.positions)
    for label, blocks, overlap in (("split", a, True), ("split_less", a_less, True), ("split_seq", a, False)):
        check(split_call(bench, x.hidden, x.positions, blocks, overlap), want, label)
    torch.cuda.synchronize()
    fns: dict[str, Callable[[], None]] = {
        "mm": lambda: _discard(torch.mm(x.hidden, bench.flat.t(), out=out)),
        "gemm": lambda: _discard(gemm(x.hidden, x.positions)),
        "ws": lambda: _discard(ws(x.hidden, x.positions)),
        "split": lambda: _discard(split_call(bench, x.hidden, x.positions, a, True)),
        "split_less": lambda: _discard(split_call(bench, x.hidden, x.positions, a_less, True)),
        "split_seq": lambda: _discard(split_call(bench, x.hidden, x.positions, a, False)),
        "split_persistent": lambda: _discard(split_call(bench, x.hidden, x.positions, a, True, one_tile=False)),
    }
    rounds = _bench.paired_gpu_time_us({k: [f] for k, f in fns.items()}, rounds=5)
    cells = []
    for variant in VARIANTS:
        ratio = _bench_e2e.paired_ratio(rounds[variant], rounds["mm"])
        cells.append(f"{ratio.median:.3f} ({ratio.low:.3f}-{ratio.high:.3f})")
    print(f"{num_tokens:>6} {a:>4}/{a_less:<3}  " + "  ".join(f"{c:>19}" for c in cells)
          + f"   mm {statistics.median(rounds['mm']):.1f} us", flush=True)  # fmt: skip


def _discard(_: object) -> None:
    return None


if __name__ == "__main__":
    main()
