"""Stubs for the part of Triton that typedkv uses, written by hand.

Only what typedkv uses is declared: a name missing here is missing on purpose, so
a new use of Triton fails mypy until it is stubbed. ``nox -s typecheck`` checks
these stubs against the installed Triton with stubtest (written against 3.9; the
deliberate differences are listed in stubs/stubtest-allowlist.txt).
"""

from . import knobs as knobs
from . import language as language
from . import testing as testing
from .runtime import JITFunction as JITFunction
from .runtime import KernelInterface as KernelInterface
from .runtime.jit import jit as jit

__version__: str

# At run time both are ``ConstexprFunction`` objects, so the same helper works
# on the host and inside a kernel; on the host they are plain int functions.
def cdiv(x: int, y: int) -> int: ...
def next_power_of_2(n: int) -> int: ...
