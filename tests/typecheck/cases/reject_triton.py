"""Misuse of the stubbed Triton surface mypy must reject (markers as in reject_api.py)."""

# fmt: off
import triton
import triton.language as tl
import triton.tools  # E: import-untyped

# Above and below: names outside stubs/triton are errors, so a new use of Triton
# shows up in review and gets stubbed (and checked by stubtest) first.
autotune = triton.autotune  # E: attr-defined


@triton.jit
def copy(x_ptr: tl.tensor, out_ptr: tl.tensor, BLOCK: tl.constexpr) -> None:
    offs = tl.arange(0, BLOCK)
    # A plain tl.tensor may hold values, not pointers: load and store want pointers.
    x = tl.load(x_ptr + offs)  # E: arg-type
    tl.store(out_ptr + offs, x)  # E: arg-type
    # Only a block of pointers has an element type.
    tl.store(out_ptr.dtype.element_ty, x)  # E: attr-defined


triton.cdiv(7.0, 2)  # E: arg-type
copy[4]  # E: index
copy[(4,)](num_warps="4")  # E: arg-type
# A launch hook chain is never None (Triton 3.9): no error here, but mypy flags
# it under --strict-equality-for-none.
no_hooks = triton.knobs.runtime.launch_enter_hook is None
triton.testing.do_bench(lambda: None, return_mode="p50")  # E: call-overload
