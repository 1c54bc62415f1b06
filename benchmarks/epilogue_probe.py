"""Where the fused projection's time over a plain GEMM goes (a developer script for the H200).

Not part of the package. Usage: ``python benchmarks/epilogue_probe.py [--pairs] [T ...]`` (``--pairs``:
tiles of two heads only, among them 64 tokens by 256 columns with room for two programs an SM). The fused kernel
(`typedkv._fused_kernel.project_kv_kernel`, weight tiles by TMA) reads 1.08x ``torch.mm`` at T = 64
and 1.19-1.24x from T = 2048 on, where a plain GEMM of whole heads (``tma_probe.py``) reads 1.02x.
This kernel is a GEMM of the fused kernel's tiles with its K epilogue added (``LEVEL``: 0 stores
every tile as it is; 1 adds K's rounding and RMSNorm; 2 adds RoPE, which is the fused kernel's
dense path), over the same mainloop (``hidden`` by pointer or, ``A_TMA``, by TMA; the weight by
TMA; programs in bands), and at small T with each K head split over two programs (``SPLIT``: its
hidden dimension, or its token block). Output: ``kv``-shaped ``[T, L*2H*D]``. Each variant beside
``torch.mm`` and the fused kernel itself in one process (CUDA-graph replays, rotating inputs,
alternated, 3 rounds, medians); prints each variant's time over ``torch.mm``'s, its registers and
spills, and its largest difference from the unfused result at its level. On the H200 (2026-12-01,
docs/performance.md): up to T = 64 level 0 matches ``torch.mm`` and level 2 is the fused kernel's
time; both splits are slower. Above T = 64 also tiles of two heads' columns (128 x 256: ``HEADS``
2, K's epilogue per head) and of 256 tokens (the plain GEMM alone): at T = 16384 two heads a tile
read 1.017-1.032x as a plain GEMM and 1.088-1.091x with K's epilogue (one head: 1.10-1.14x and
1.15-1.22x; the fused kernel 1.19-1.20x).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from probe_timing import gemm_inputs, measure

from typedkv import KVMaterializer
from typedkv._epilogue import _rope_row, _rstd
from typedkv._fused_kernel import _banded, _halves

DTYPE = torch.bfloat16  # (float16 for a dry run under Triton's CPU interpreter, whose bf16 dot is wrong)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton
    TensorDescriptor = None


@triton.jit
def _k_head(x, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL: tl.constexpr, BM: tl.constexpr, D: tl.constexpr):
    """K's steps on one head's ``[BM, D]`` tile ``x`` (float32, on the storage grid), stored to ``out``."""
    HALF: tl.constexpr = D // 2
    pair = tl.arange(0, HALF)
    store_ty: tl.constexpr = out.dtype.element_ty
    x1, x2 = _halves(x, BM, HALF)
    w1 = tl.load(norm_ptr + layer * D + pair).to(tl.float32)
    w2 = tl.load(norm_ptr + layer * D + HALF + pair).to(tl.float32)
    rstd = _rstd(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), D, 1e-6)[:, None]
    y1 = (x1 * rstd * w1[None, :]).to(store_ty).to(tl.float32)
    y2 = (x2 * rstd * w2[None, :]).to(store_ty).to(tl.float32)
    if LEVEL > 1:
        _, cos, sin = _rope_row(rope, tok, tok_ok, pair, pair < HALF, HALF)
        o1 = y1 * cos - y2 * sin
        o2 = y2 * cos + y1 * sin
    else:
        o1 = y1
        o2 = y2
    tl.store(out + pair[None, :], o1.to(store_ty), mask=tok_ok[:, None])
    tl.store(out + HALF + pair[None, :], o2.to(store_ty), mask=tok_ok[:, None])


@triton.jit
def _k_epilogue(acc, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
                HEADS: tl.constexpr):  # fmt: skip
    """K's steps on a ``[BM, D]`` float32 tile of ``HEADS`` (1 or 2) heads, stored to ``out``: rounded, RMSNorm
    (LEVEL 1), then RoPE (LEVEL 2), each head on its own."""
    x = acc.to(out.dtype.element_ty).to(tl.float32)
    if HEADS == 1:
        _k_head(x, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL, BM, D)
    else:
        first, second = _halves(x, BM, D // 2)
        _k_head(first, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL, BM, D // 2)
        _k_head(second, out + D // 2, tok, tok_ok, layer, norm_ptr, rope, LEVEL, BM, D // 2)


@triton.jit
def _tile(a_ptr, a_desc, w_desc, block, tok, tok_ok, head, k_first, span, HIDDEN: tl.constexpr, ROWS: tl.constexpr,
          BK: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, A_TMA: tl.constexpr):  # fmt: skip
    """``a[tok, k_first : k_first + span] @ w[head]^T`` (``[ROWS, D]``, float32); ``a`` by TMA (``A_TMA``) or pointer."""
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    a_row = a_ptr + tok.to(tl.int64)[:, None] * HIDDEN
    for k0 in tl.range(k_first, k_first + span, BK, num_stages=STAGES):
        if A_TMA:
            a = a_desc.load([block * ROWS, k0])
        else:
            a = tl.load(a_row + (k0 + tl.arange(0, BK))[None, :], mask=tok_ok[:, None], other=0.0)
        acc = tl.dot(a, w_desc.load([head * D, k0]).T, acc)
    return acc


@triton.jit
def gemm_epilogue(a_ptr, a_desc, w_desc, norm_ptr, cos_sin_ptr, pos_ptr, c_ptr, part_ptr, count_ptr, T,
                  num_positions, HIDDEN: tl.constexpr, L: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GROUP_M: tl.constexpr,
                  LEVEL: tl.constexpr, A_TMA: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr):  # fmt: skip
    """``c[:, head] = epilogue(a @ w[head]^T)`` for one ``[BM, D]`` tile; heads ``[0, H)`` of a layer are K.

    A tile may hold ``HEADS`` (1 or 2) of the model's heads: ``D`` and ``H`` then count tile columns and
    tiles, and K's epilogue runs per model head (``D // HEADS`` wide).

    ``SPLIT`` 2: each K head's hidden dimension is split over two programs (the grid's last ``L * H``
    programs are the second halves), so K's products end halfway through the weights' stream and their
    epilogue runs while V's programs still stream: each half stores its float32 partial to ``part_ptr``
    and bumps the tile's counter in ``count_ptr``; the second to arrive adds the other's partial (a
    sum of two is the same either way round), resets the counter and runs the epilogue. ``SPLIT`` 3:
    each K head's token block is split over two programs instead (half the rows each, the whole hidden
    dimension; the weight rows are read twice, the second time from L2), so each K program's epilogue
    is half as long (``hidden`` by pointer).
    """
    NUM_HEADS: tl.constexpr = L * 2 * H
    part = 0
    if SPLIT > 1:
        block = tl.program_id(0)
        pid = tl.program_id(1)
        second = pid - NUM_HEADS
        head = tl.where(pid >= NUM_HEADS, (second // H) * 2 * H + second % H, pid)
        if SPLIT == 2:
            part = (pid >= NUM_HEADS).to(tl.int32)
    else:
        block, head = _banded(tl.program_id(0), tl.program_id(1), tl.num_programs(0), NUM_HEADS, GROUP_M)
    slot = head % (2 * H)
    layer = head // (2 * H)
    is_k = slot < H
    tok = block * BM + tl.arange(0, BM)
    tok_ok = tok < T
    span = HIDDEN
    if SPLIT == 2:
        span = tl.where(is_k, HIDDEN // 2, HIDDEN)
    k_first = part * span
    rope = (pos_ptr, 1, num_positions, cos_sin_ptr, D // HEADS, 1)
    if SPLIT == 3:
        if is_k:
            # Half the rows: the grid's last L * H programs take each K head's second half.
            ROWS: tl.constexpr = BM // 2
            rows = block * BM + (pid >= NUM_HEADS).to(tl.int32) * ROWS + tl.arange(0, ROWS)
            rows_ok = rows < T
            k_acc = _tile(
                a_ptr, a_desc, w_desc, block, rows, rows_ok, head, 0, HIDDEN, HIDDEN, ROWS, BK, D, STAGES, False
            )
            k_out = c_ptr + rows.to(tl.int64)[:, None] * (NUM_HEADS * D) + head * D
            _k_epilogue(k_acc, k_out, rows, rows_ok, layer, norm_ptr, rope, LEVEL, ROWS, D, HEADS)
            return
    acc = _tile(a_ptr, a_desc, w_desc, block, tok, tok_ok, head, k_first, span, HIDDEN, BM, BK, D, STAGES, A_TMA)
    out = c_ptr + tok.to(tl.int64)[:, None] * (NUM_HEADS * D) + head * D
    if LEVEL == 0 or not is_k:
        tl.store(out + tl.arange(0, D)[None, :], acc.to(c_ptr.dtype.element_ty), mask=tok_ok[:, None])
    elif SPLIT == 2:
        k_index = layer * H + slot
        rows = tl.num_programs(0) * BM
        dims = tl.arange(0, D)
        parts = part_ptr + (tok.to(tl.int64)[:, None] * (L * H) + k_index) * D + dims[None, :]
        tl.store(parts + part * rows * (L * H * D), acc, cache_modifier=".cg")
        # Every thread's partial stored before the one atomic that publishes them.
        tl.debug_barrier()
        tile = block * (L * H) + k_index
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == 1:
            acc += tl.load(parts + (1 - part) * rows * (L * H * D), cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            _k_epilogue(acc, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL, BM, D, HEADS)
    else:
        _k_epilogue(acc, out, tok, tok_ok, layer, norm_ptr, rope, LEVEL, BM, D, HEADS)


def expected(kv: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, level: int,
             L: int, H: int, D: int) -> torch.Tensor:  # fmt: skip
    """The unfused steps on a stored ``kv`` (float32 math, rounded where the kernel rounds)."""
    out = kv.clone().view(-1, L, 2, H, D)
    if level == 0:
        return out.view(kv.shape)
    k = out[:, :, 0].float()
    rstd = torch.rsqrt(k.square().mean(-1, keepdim=True) + 1e-6)
    y = (k * rstd * norm.float()[None, :, None, :]).to(kv.dtype).float()
    if level > 1:
        half = D // 2
        cs = cos_sin[positions][:, None, None, :]
        c, s = cs[..., :half], cs[..., half:]
        y1, y2 = y[..., :half], y[..., half:]
        y = torch.cat((y1 * c - y2 * s, y2 * c + y1 * s), -1)
    out[:, :, 0] = y.to(kv.dtype)
    return out.view(kv.shape)


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [64, 256, 2048, 16384]
    device = torch.device("cuda")
    L, H, D, K = 5, 8, 128, 4096
    N = L * 2 * H * D
    torch.manual_seed(0)
    weight = torch.randn(N, K, device=device, dtype=DTYPE) / K**0.5
    norm = torch.rand(L, D, device=device, dtype=DTYPE) + 0.5
    positions_max = 4096
    inv = 1.0 / 1e6 ** (torch.arange(D // 2, dtype=torch.float32, device=device) / (D // 2))
    angles = torch.outer(torch.arange(positions_max, dtype=torch.float32, device=device), inv)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    fused = KVMaterializer(weight.view(L, 2 * H * D, K), norm, 1e-6, cos_sin, num_kv_heads=H)
    fused.projection_path = "fused"
    for T in tokens:
        _probe(T, weight, norm, cos_sin, fused, positions_max, (L, H, D, K))
        torch.cuda.empty_cache()


def _probe(T: int, weight: torch.Tensor, norm: torch.Tensor, cos_sin: torch.Tensor, fused: KVMaterializer,
           positions_max: int, sizes: tuple[int, int, int, int]) -> None:  # fmt: skip
    """Every variant at ``T``, one line each (the fused kernel's own launch among them)."""
    device = weight.device
    L, H, D, K = sizes
    N = L * 2 * H * D
    hiddens, outs, kv_ref, mm_calls = gemm_inputs(weight, T, 4 if T <= 256 else 1)
    positions = [torch.randint(0, positions_max, (T,), device=device) for _ in hiddens]
    k_out, v_out = torch.empty(2, L, T, H, D, device=device, dtype=DTYPE)
    variants: dict[str, list[Callable[[], object]]] = {
        "mm": mm_calls,
        "fused": [
            lambda h=h, p=p: fused(h, p, k_out=k_out, v_out=v_out) for h, p in zip(hiddens, positions, strict=True)
        ],
    }
    levels: dict[str, int] = {}
    compiled: dict[str, object] = {}
    if "--pairs" in sys.argv:
        # Two heads a tile of 64 tokens, 4 warps, <= 100 KB of shared memory: two programs an SM, so
        # that one's epilogue may overlap the other's loop (beside the one-program 128 x 256 tile).
        shapes = [(128, 64, 3, 8, 8, 2 * D), (64, 32, 5, 4, 8, 2 * D), (64, 64, 2, 4, 8, 2 * D)]
        kinds = [(0, True, None, 1), (2, True, None, 1)]
    elif T <= 64:
        bm = 16 if T <= 16 else 32 if T <= 32 else 64
        shapes = [(bm, 128, 5 if T <= 32 else 4, 4, 1, D)]
        kinds = [(0, True, None, 1), (2, True, None, 1), (2, False, None, 1), (2, False, None, 3)]
    else:
        # The last two: tiles of two heads' columns (the plain GEMM and K's steps), or of 256 tokens
        # (the plain GEMM), as a Hopper GEMM would take them: is a wider tile what the mainloop lacks?
        shapes = [(128, 64, 4, 8, 8, D), (128, 64, 3, 8, 8, D), (128, 64, 3, 8, 8, 2 * D), (256, 64, 3, 8, 8, D)]
        kinds = [(0, True, None, 1), (2, True, None, 1), (2, False, None, 1), (2, True, 128, 1), (0, False, None, 1)]
    for bm, bk, stages, warps, group_m, cols in shapes:
        w_desc = TensorDescriptor.from_tensor(weight, [cols, bk])
        a_descs = [TensorDescriptor.from_tensor(h, [bm, bk]) for h in hiddens]
        blocks = triton.cdiv(T, bm)
        parts = torch.empty(2, blocks * bm, L * H * D, device=device, dtype=torch.float32)
        counts = torch.zeros(blocks, L * H, device=device, dtype=torch.int32)
        for level, a_tma, maxnreg, split in kinds:
            if maxnreg is not None and (stages != 3 or bm != 128 or cols != D):
                continue  # the cap is for two programs of 8 warps to an SM (<= 98 KB each)
            if bm > 128 and level > 0:
                continue  # tiles of 256 tokens: the plain GEMM alone
            if T > 64 and cols == D and bm == 128 and level == 0 and not a_tma:
                continue
            grid = (blocks, N // cols + (L * H if split > 1 else 0))
            name = (
                f"m{bm}_n{cols}_k{bk}_s{stages}_w{warps}_L{level}" + ("_atma" if a_tma else "")
                + (f"_r{maxnreg}" if maxnreg else "") + ("_splitk" if split == 2 else "_krows" if split == 3 else "")
            )  # fmt: skip
            extra = {"maxnreg": maxnreg} if maxnreg else {}

            def call(h: torch.Tensor, a: object, p: torch.Tensor, o: torch.Tensor, g=grid, lv=level, at=a_tma,
                     bm=bm, bk=bk, st=stages, w=warps, gm=group_m, wd=w_desc, x=extra, sp=split, ps=parts, cs=counts,
                     n=cols) -> object:  # fmt: skip
                return gemm_epilogue[g](
                    h, a if at else None, wd, norm, cos_sin, p, o, ps, cs, T, positions_max, HIDDEN=K, L=L,
                    H=H * D // n, D=n, BM=bm, BK=bk, STAGES=st, GROUP_M=gm, LEVEL=lv, A_TMA=at, SPLIT=sp, HEADS=n // D,
                    num_warps=w, **x,
                )  # fmt: skip

            variants[name] = [
                lambda h=h, a=a, p=p, o=o, c=call: c(h, a, p, o)
                for h, a, p, o in zip(hiddens, a_descs, positions, outs, strict=True)
            ]
            levels[name] = level

    def check(name: str, calls: Sequence[Callable[[], object]]) -> str:
        kernel = calls[0]()
        torch.cuda.synchronize()
        if name == "mm":
            return "-"
        if name == "fused":
            kv = kv_ref.view(T, L, 2, H, D)
            ref = expected(kv_ref, norm, cos_sin, positions[0], 2, L, H, D).view(T, L, 2, H, D)
            err = max((k_out.transpose(0, 1) - ref[:, :, 0]).float().abs().max().item(),
                      (v_out.transpose(0, 1) - kv[:, :, 1]).float().abs().max().item())  # fmt: skip
            return f"{err:.3g}"
        compiled[name] = kernel
        ref = expected(kv_ref, norm, cos_sin, positions[0], levels[name], L, H, D)
        return f"{(outs[0].float() - ref.float()).abs().max().item():.3g}"

    med, errors = measure(f"T={T}", variants, check)
    mm = med["mm"]
    print(f"T={T} mm {mm:.2f} us")
    for name, us in sorted(med.items(), key=lambda kv: kv[1]):
        kernel = compiled.get(name)
        regs = f" regs {kernel.n_regs} spills {kernel.n_spills}" if hasattr(kernel, "n_regs") else ""  # type: ignore[union-attr]
        print(f"   {name:<40} {us / mm:.3f}  err {errors[name]}{regs}", flush=True)


if __name__ == "__main__":
    main()
