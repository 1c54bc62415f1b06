from collections.abc import Callable, Iterable
from typing import Any, Generic, ParamSpec, Protocol, TypeAlias, TypeVar, overload

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., object])
_P = ParamSpec("_P")
_R = TypeVar("_R")

# A launch grid: 1 to 3 program counts, or a function of the bound arguments
# (the kernel's parameters, by name) that returns them.
_Grid: TypeAlias = tuple[int] | tuple[int, int] | tuple[int, int, int] | Callable[[dict[str, Any]], tuple[int, ...]]

class _Launcher(Protocol):
    """What ``kernel[grid]`` returns: call it with the kernel's arguments.

    Arguments are whatever the kernel takes (tensors become pointers, Python
    scalars become scalars or constexprs), plus launch options. It returns the
    compiled kernel (a ``CompiledKernel``; a future of one while compiling
    asynchronously; ``None`` under the interpreter), hence ``Any``.
    """

    def __call__(
        self,
        *args: object,
        num_warps: int = ...,
        num_stages: int = ...,
        num_ctas: int = ...,
        **kwargs: object,
    ) -> Any: ...

class KernelInterface(Generic[_T]):
    def __getitem__(self, grid: _Grid) -> _Launcher: ...

class JITFunction(KernelInterface[_T]):
    """A ``@triton.jit`` function. ``fn`` is the Python function it wraps."""

    fn: _T
    def __init__(
        self,
        fn: _T,
        version: object = None,
        do_not_specialize: Iterable[int | str] | None = None,
        do_not_specialize_on_alignment: Iterable[int | str] | None = None,
        debug: bool | None = None,
        noinline: bool | None = None,
        repr: Callable[..., str] | None = None,
        launch_metadata: Callable[..., object] | None = None,
    ) -> None: ...
    # Only meaningful inside another ``@triton.jit`` function (a kernel calling
    # a helper); on the host it raises. Typed as the wrapped function.
    def __call__(self: JITFunction[Callable[_P, _R]], *args: _P.args, **kwargs: _P.kwargs) -> _R: ...

@overload
def jit(fn: _F) -> JITFunction[_F]: ...
@overload
def jit(
    fn: None = None,
    *,
    version: object = None,
    repr: Callable[..., str] | None = None,
    launch_metadata: Callable[..., object] | None = None,
    do_not_specialize: Iterable[int | str] | None = None,
    do_not_specialize_on_alignment: Iterable[int | str] | None = None,
    debug: bool | None = None,
    noinline: bool | None = None,
) -> Callable[[_F], JITFunction[_F]]: ...
