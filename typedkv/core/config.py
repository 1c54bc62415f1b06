"""Run-time configuration: the debug switch.

Debug mode adds full jaxtyping + beartype checking and value checks that need a
device sync (``positions < P``, ``cache_loc < S``, duplicate slots). It is off by
default; ``TYPEDKV_DEBUG=1`` in the environment (or any non-zero integer, ``true``,
``yes``, ``on``, ``debug``) turns it on at import; an unrecognised value warns.
"""

from __future__ import annotations

import os
import warnings

_TRUE = frozenset({"true", "yes", "on", "y", "t", "debug"})
_FALSE = frozenset({"", "false", "no", "off", "n", "f"})


def parse_flag(name: str, text: str) -> bool:
    """An environment flag's value: any non-zero integer and the usual words mean on.

    Anything else warns and means off, so a typo never turns debug mode on or
    off silently.
    """
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    try:
        return int(word) != 0
    except ValueError:
        warnings.warn(
            f"typedkv: {name}={text!r} is not a flag value (1, 0, true, false, yes, no, on, off): debug mode stays off",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


# A one-element list rather than a bare global so the hot path reads it with a
# single index and no `global` statement is needed to flip it.
_debug = [parse_flag("TYPEDKV_DEBUG", os.environ.get("TYPEDKV_DEBUG", ""))]


def set_debug(flag: bool) -> None:
    """Turn debug checking on or off for every later call.

    Parameters
    ----------
    flag : bool
        ``True`` for debug mode (full jaxtyping + beartype checks and value
        checks that synchronise with the device), ``False`` for production.

    Examples
    --------
    >>> typedkv.set_debug(True)
    >>> typedkv.debug_enabled()
    True
    >>> typedkv.set_debug(False)  # back to production checks
    """
    _debug[0] = bool(flag)


def debug_enabled() -> bool:
    """Return whether debug checking is on.

    Returns
    -------
    bool
        ``True`` when debug mode is on (``TYPEDKV_DEBUG=1`` at import, or
        :func:`set_debug` ``(True)`` since).

    Examples
    --------
    >>> typedkv.set_debug(False)
    >>> typedkv.debug_enabled()
    False
    """
    return _debug[0]
