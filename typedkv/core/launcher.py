"""Launching a Triton kernel once per call: the prepared launch, the direct call, programmatic launches.

No math and no argument checking here: each family's ``launch`` module picks its kernel's configuration
and argument list; this module runs it (`KernelLaunch`).

Host time matters at decode sizes (a few tokens), where a launch through
``kernel[grid](...)`` costs more than the kernel runs. After Triton has compiled
a kernel for one configuration, later calls with the same configuration call
the compiled kernel directly; the configuration key covers everything Triton
specialises on (dtypes, constexprs, the exact values of the ints it specialises,
pointer alignment), so the direct call runs exactly what ``kernel[grid]`` would.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

# Triton decides at decoration time whether a kernel runs under its interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:  # host-side TMA descriptors, Triton 3.4 and later (imported by name: the module ships no types)
    TensorDescriptor: Any = importlib.import_module("triton.tools.tensor_descriptor").TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the fused projection loads its weights by pointer
    TensorDescriptor = None
# Triton's interpreter keeps the grid position of the launch it runs in global
# state: two launches interpreted at once, from two threads, clash. They take turns.
_INTERPRETER_LOCK = threading.Lock()

# Programmatic dependent launch (Hopper and later): a kernel is launched while the
# kernel before it on the stream is still running, its programs start as SMs free
# up, and each waits (griddepcontrol.wait, every kernel's WAIT_PRIOR) for that
# kernel's completion before its first load. The launch and the programs' start
# overlap the prior kernel's tail instead of following it. A switch for A/B runs.
PROGRAMMATIC_LAUNCH = True


def programmatic_launch(device: torch.device) -> bool:
    """Whether launches on ``device`` are programmatic dependent launches (each kernel's ``WAIT_PRIOR``)."""
    return PROGRAMMATIC_LAUNCH and device.type == "cuda" and not INTERPRETED and _capability(device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def use_kernel(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernel (else the reference).

    Meta tensors (a dry run of shapes) have no values for a kernel, interpreted or not: the reference's
    torch ops give their outputs' shapes."""
    return device.type == "cuda" or (INTERPRETED and device.type != "meta")


# The current CUDA stream of a device index as its raw handle (cheaper than a Stream object); None in a
# torch without it. The launches, the materializers' workspace and the device tables read it.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() without its lazy-initialisation check: a direct launch
# follows a kernel[grid] launch, which initialised CUDA (host time at decode sizes).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _hooks_idle() -> bool:
    """No launch hook registered (a profiler would need Triton's own launch path)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (leave is None or not getattr(leave, "calls", True))


class KernelLaunch:
    """One launch of ``kernel`` prepared from a checked layout, run once per call.

    Built from the first call's arguments, every one of the kernel's parameters by name
    (constexprs too), and the names of those a call passes (``per_call``: its tensors,
    floats and absent tensors, or a tuple holding one -- Triton takes tuples whole --, in
    the order of the call's values). The positional order is read from the kernel's
    signature once, here: a call fills its values into a fixed argument tuple by position.
    Everything else (ints, constexprs) is fixed by the layout. On CUDA the compiled kernel
    is called directly once Triton has built it: every value Triton specialises on is fixed
    by the layout, except pointer alignment, which is checked on each call. Under Triton
    3.6 the call goes to its launcher's C launch itself (`_unwrapped_launch`).
    """

    def __init__(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        arguments: Mapping[str, Any],
        per_call: Sequence[str],
        num_warps: int,
    ) -> None:
        params = in_order(kernel, arguments)
        _checked_per_call(kernel, arguments, per_call)
        self.kernel = kernel
        self.grid = grid
        self.num_warps = num_warps
        at = {name: i for i, name in enumerate(parameter_names(kernel))}
        self.varying = tuple(at[name] for name in per_call)  # the kernel positions of a call's values
        # Where the tensors are among the per-call values (a path into a tuple argument): the
        # layout fixes which slots hold a tensor, and only their alignment is checked per call.
        tensors = [path for j, i in enumerate(self.varying) for path in _tensor_paths(params[i], (j,))]
        self._top_tensors = tuple(path[0] for path in tensors if len(path) == 1)
        self._inner_tensors = tuple(path for path in tensors if len(path) > 1)
        # A call's arguments are one C-level gather from (*values, *fixed): every kernel
        # argument's place in that tuple, in kernel order (host time at decode sizes).
        varying = {i: j for j, i in enumerate(self.varying)}
        fixed = [i for i in range(len(params)) if i not in varying]
        self._fixed = tuple(params[i] for i in fixed)
        place = {i: len(varying) + k for k, i in enumerate(fixed)}
        order = [varying[i] if i in varying else place[i] for i in range(len(params))]
        self._gather = operator.itemgetter(*order) if len(order) > 1 else lambda source: (source[order[0]],)
        self.device = next(p for p in params if isinstance(p, torch.Tensor)).device
        self._index = self.device.index
        self.direct = self.device.type == "cuda" and not INTERPRETED
        # A kernel whose WAIT_PRIOR is set waits for the prior kernel before its first load:
        # calls may launch it as a programmatic dependent launch, a variant compiled apart.
        self.programmatic = arguments.get("WAIT_PRIOR") is True
        self._compiled: list[Any] = [None, None]  # [plain launch, programmatic launch]
        # Per compiled variant: Triton's C launch beneath its launcher's per-launch Python
        # (`_unwrapped_launch`), or False where this Triton's launcher is another.
        self._unwrapped: list[Any] = [None, None]

    @property
    def compiled(self) -> Any:
        """The compiled kernel a default call runs directly (None before the first aligned call)."""
        return self._compiled[self.programmatic]

    def arguments(self, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """The kernel's arguments, in its order, for a call's ``values`` (in ``per_call``'s order)."""
        if len(values) != len(self.varying):
            raise ValueError(f"expected {len(self.varying)} per-call values, got {len(values)}")
        return self._gather(values + self._fixed)

    def __call__(self, values: tuple[Any, ...], after_gemm: bool = False) -> None:
        """Launch with this call's ``values`` (its tensors and floats, in ``per_call``'s order).

        ``after_gemm``: the call's own GEMM was launched just before (a materializer's GEMM
        path): a plain launch, since a programmatic one's early programs would hold SMs the
        GEMM's last ones wait for (docs/decisions/003-programmatic-dependent-launch.md).
        """
        if not self.direct:
            params = self.arguments(values)
            if INTERPRETED:
                with _INTERPRETER_LOCK:
                    self.kernel[self.grid](*params, num_warps=self.num_warps)
            else:
                self.kernel[self.grid](*params, num_warps=self.num_warps)
            return
        programmatic = self.programmatic and not after_gemm
        if _current_device() != self._index:
            with torch.cuda.device(self.device):
                self._cuda(values, programmatic)
        else:
            self._cuda(values, programmatic)

    def _cuda(self, values: tuple[Any, ...], programmatic: bool) -> None:
        aligned = self._aligned(values)
        compiled = self._compiled[programmatic]
        if compiled is None or not aligned or not _hooks_idle():
            options = _PROGRAMMATIC if programmatic else {}
            compiled = self.kernel[self.grid](*self.arguments(values), num_warps=self.num_warps, **options)
            # Only a kernel compiled for aligned pointers serves later aligned calls.
            if aligned and not hasattr(compiled, "result"):
                self._compiled[programmatic] = compiled
            return
        if current_raw_stream is not None:
            stream = current_raw_stream(self._index)
        else:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        self._direct(compiled, programmatic, stream, self._gather(values + self._fixed))

    # The kernel's TMA descriptor arguments (positions in its argument list; `ProjectionLaunch`).
    _descriptor_slots: tuple[int, ...] = ()

    def _direct(self, compiled: Any, programmatic: bool, stream: int, params: tuple[Any, ...]) -> None:
        """Run ``compiled`` (the ``programmatic`` variant) on ``stream`` with the kernel's arguments ``params``."""
        unwrapped = self._unwrapped[programmatic]
        if unwrapped is None:
            unwrapped = self._unwrapped[programmatic] = _unwrapped_launch(compiled, self._descriptor_slots) or False
        grid = self.grid
        if unwrapped is False:
            compiled.run(
                grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                *self._described(params),
            )  # fmt: skip
            return
        launch, metas, flags = unwrapped
        launch(
            grid[0], grid[1], grid[2], stream, compiled.function, *flags, None, None, compiled.packed_metadata, None,
            None, None, *self._encoded(params, metas),
        )  # fmt: skip

    def _described(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        """``params`` as Triton's launcher takes them (`ProjectionLaunch`: the weight's descriptors made)."""
        return params

    def _encoded(self, params: tuple[Any, ...], metas: list[Any]) -> Sequence[Any]:
        """``params`` as the C launch takes them (`ProjectionLaunch`: each descriptor as its encoding)."""
        return params

    def _aligned(self, values: tuple[Any, ...]) -> bool:
        """Whether this call's tensors start on 16 bytes, as Triton specialises (those inside tuples too)."""
        for j in self._top_tensors:
            if values[j].data_ptr() & 15:
                return False
        return _aligned(values, self._inner_tensors)


_PROGRAMMATIC = {"launch_pdl": True}  # Triton's launch option: a programmatic dependent launch


def _tensor_paths(value: Any, path: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The paths of the tensors in ``value`` (itself at ``path``), inside tuples too."""
    if isinstance(value, tuple):
        return [found for k, item in enumerate(value) for found in _tensor_paths(item, (*path, k))]
    return [path] if isinstance(value, torch.Tensor) else []


def _aligned(values: tuple[Any, ...], tensors: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the tensors at ``tensors``' paths in ``values`` start on 16 bytes, as Triton specialises."""
    for path in tensors:
        value: Any = values
        for k in path:
            value = value[k]
        if value.data_ptr() & 15:
            return False
    return True


@functools.cache
def parameter_names(kernel: Any) -> tuple[str, ...]:
    """``kernel``'s parameter names, in order (a jitted or an interpreted kernel)."""
    return tuple(inspect.signature(kernel.fn).parameters)


def in_order(kernel: Any, arguments: Mapping[str, Any]) -> tuple[Any, ...]:
    """``arguments`` (every parameter of ``kernel`` by name, once) in ``kernel``'s order."""
    names = parameter_names(kernel)
    missing, unknown = set(names) - set(arguments), set(arguments) - set(names)
    if missing or unknown:
        raise TypeError(f"{kernel.fn.__name__}: arguments missing {sorted(missing)}, unknown {sorted(unknown)}")
    return tuple(arguments[name] for name in names)


def _checked_per_call(kernel: Any, arguments: Mapping[str, Any], per_call: Sequence[str]) -> None:
    """No constexpr among ``per_call``, and every tensor and float there: a value the layout fixes would be the
    first call's at every call."""
    names = parameter_names(kernel)
    constexprs = {names[i] for i in _constexpr_indices(kernel)}
    wrong = (constexprs & set(per_call)) | (set(per_call) - set(names))
    fixed = [p for p in names if p not in per_call and p not in constexprs and _of_a_call(arguments[p])]
    if wrong:
        raise ValueError(f"{kernel.fn.__name__}: {sorted(wrong)} given per call, not run-time parameters of it")
    if fixed:
        raise ValueError(f"{kernel.fn.__name__}: {fixed} hold tensors or floats, so they are given per call")


def _of_a_call(value: Any) -> bool:
    """Whether an argument holds what changes from call to call: a tensor or a float (inside a tuple too)."""
    if isinstance(value, tuple):
        return any(map(_of_a_call, value))
    return isinstance(value, (torch.Tensor, float))


@functools.cache
def _constexpr_indices(kernel: Any) -> frozenset[int]:
    """The positions of ``kernel``'s ``tl.constexpr`` parameters (a jitted or an interpreted kernel)."""
    parameters = inspect.signature(kernel.fn).parameters.values()
    # Annotations are strings under `from __future__ import annotations`.
    return frozenset(i for i, p in enumerate(parameters) if p.annotation in ("tl.constexpr", tl.constexpr))


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def encode_descriptor(descriptor: Any, meta: Any) -> list[Any]:
    """``descriptor``'s arguments as Triton 3.6's launcher passes them (the encoded map, shape, strides)."""
    return list(_nvidia_driver().make_tensordesc_arg(descriptor, meta))


@functools.cache
def _nvidia_driver() -> Any:
    return importlib.import_module("triton.backends.nvidia.driver")


def _unwrapped_launch(compiled: Any, slots: tuple[int, ...]) -> tuple[Any, list[Any], tuple[bool, bool]] | None:
    """``(launch, descriptor metadata, (cooperative, programmatic))``: Triton 3.6's C launch of ``compiled``.

    At decode sizes a call is host-bound, and Triton 3.6's launcher spends Python on every
    launch before its C launch: a function that asks for scratch memory (none here), and,
    for a kernel that takes TMA descriptors (``slots``: their argument positions), another
    that encodes each descriptor anew. The C launch takes the 13 leading arguments
    Triton's own call passes, then the kernel's arguments, each descriptor as its encoding,
    shape and strides (`make_tensordesc_arg`'s). None where the launcher is not that one
    (another Triton version, a kernel with scratch memory): those launches go through
    Triton's launcher.
    """
    try:
        run = compiled.run
        driver = _nvidia_driver()
        if (
            getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13
            or len(inspect.signature(driver.make_tensordesc_arg).parameters) != 2
            or run.global_scratch_size
            or run.profile_scratch_size
        ):
            return None
        flags = (run.launch_cooperative_grid, run.launch_pdl)
        wrapped = run.launch
        if not slots:
            # Without descriptors the launcher's launch is the C function itself.
            return None if hasattr(wrapped, "__code__") else (wrapped, [], flags)
        cells = dict(
            zip(wrapped.__code__.co_freevars, (c.cell_contents for c in wrapped.__closure__ or ()), strict=True)
        )
        usable = (
            set(cells) >= {"launcher", "tensordesc_indices", "tensordesc_meta"}
            and cells["tensordesc_indices"] == set(slots)
            and len(cells["tensordesc_meta"]) == len(slots)
            and all(isinstance(meta, dict) for meta in cells["tensordesc_meta"])
        )
        return (cells["launcher"], list(cells["tensordesc_meta"]), flags) if usable else None
    except (AttributeError, ImportError, KeyError, TypeError, ValueError):
        return None
