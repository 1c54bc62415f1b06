"""Run-time configuration: the debug switch.

Debug mode adds full jaxtyping + beartype checking and value checks that need a
device sync (``positions < P``, ``cache_loc < S``, duplicate slots). It is off by
default; ``TYPEDKV_DEBUG=1`` in the environment turns it on at import.
"""

from __future__ import annotations

import os

_TRUE = frozenset({"1", "true", "yes", "on"})

# A one-element list rather than a bare global so the hot path reads it with a
# single index and no `global` statement is needed to flip it.
_debug = [os.environ.get("TYPEDKV_DEBUG", "").strip().lower() in _TRUE]


def set_debug(flag: bool) -> None:
    """Turn debug checking on or off for every later call.

    Parameters
    ----------
    flag : bool
        ``True`` for debug mode (full jaxtyping + beartype checks and value
        checks that synchronise with the device), ``False`` for production.
    """
    _debug[0] = bool(flag)


def debug_enabled() -> bool:
    """Return whether debug checking is on.

    Returns
    -------
    bool
        ``True`` when debug mode is on (``TYPEDKV_DEBUG=1`` at import, or
        :func:`set_debug` ``(True)`` since).
    """
    return _debug[0]
