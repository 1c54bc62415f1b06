from collections.abc import Callable
from typing import Generic, TypeVar

_F = TypeVar("_F", bound=Callable[..., object])

class HookChain(Generic[_F]):
    """Hooks of one kind, called in order. Empty (``calls == []``) when none is set."""

    calls: list[_F]
    reversed: bool
    def __init__(self, reversed: bool = False) -> None: ...
    def add(self, func: _F) -> None: ...
    def remove(self, func: _F) -> None: ...
    def __call__(self, *args: object, **kwargs: object) -> None: ...

class runtime_knobs:
    # HookChain objects (Triton 3.9), never None: "no hook set" is ``not hook.calls``.
    launch_enter_hook: HookChain[Callable[..., object]]
    launch_exit_hook: HookChain[Callable[..., object]]

runtime: runtime_knobs
