"""The Triton surface in stubs/triton, used as a kernel author would: mypy must accept it all."""

from typing import TYPE_CHECKING, assert_type

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from typing import TypeAlias

    # A block of pointers, what tl.load / tl.store take. Only a type checker may
    # see the subscript: Triton evaluates kernel parameter annotations when it
    # compiles, and tl.tensor is not subscriptable at run time.
    Pointer: TypeAlias = tl.tensor[tl.pointer_type]
else:
    Pointer = tl.tensor


@triton.jit
def _clamp(x: tl.tensor, LIMIT: tl.constexpr) -> tl.tensor:
    return tl.where(x > LIMIT, LIMIT, tl.where(x < -LIMIT, -LIMIT, x))


@triton.jit(do_not_specialize=["n"])
def scale_rows(
    x_ptr: Pointer, out_ptr: Pointer, scale_ptr: Pointer, n: tl.tensor, stride: tl.tensor,
    BLOCK: tl.constexpr, HALF: tl.constexpr, LIMIT: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = (cols < n) & (tl.num_programs(0) > row)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] < HALF, x[None, :], -x[None, :])
    ms = tl.sum(x * x, axis=1) / BLOCK
    y = x * tl.rsqrt(ms + 1e-6)[:, None]
    y = tl.div_rn(y, tl.load(scale_ptr + row).to(tl.float32))
    y = tl.maximum(tl.abs(_clamp(y, LIMIT)), 0.0)
    bits = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    y = tl.where(bits == 0, 0.0, y)
    tl.store(out_ptr + row * stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask[None, :])


x = torch.randn(8, 100)
out = torch.empty_like(x)
block = triton.next_power_of_2(x.shape[1])
assert_type(block, int)
assert_type(triton.cdiv(x.shape[0], 4), int)
grid = (x.shape[0],)
scale_rows[grid](x, out, torch.ones(8), x.shape[1], x.stride(0), BLOCK=block, HALF=block // 2, LIMIT=448.0, num_warps=4)
scale_rows[(x.shape[0], 1, 1)](x, out, torch.ones(8), x.shape[1], x.stride(0), block, block // 2, 448.0)
scale_rows[lambda meta: (triton.cdiv(x.shape[0], meta["BLOCK"]),)](x, out, torch.ones(8), 100, 100, 128, 64, 448.0)
python_fn = scale_rows.fn
hooks_set = bool(triton.knobs.runtime.launch_enter_hook.calls or triton.knobs.runtime.launch_exit_hook.calls)
assert_type(triton.testing.do_bench(lambda: out.copy_(x), warmup=50, rep=300, return_mode="median"), float)
assert_type(triton.testing.do_bench(lambda: out.copy_(x), quantiles=[0.2, 0.5, 0.8]), list[float])
assert_type(triton.testing.do_bench(lambda: out.copy_(x), return_mode="all"), list[float])
