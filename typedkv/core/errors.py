"""The one error type typedkv raises for misuse."""

from __future__ import annotations


class InputError(ValueError, TypeError):
    """An argument was rejected before anything was launched or written.

    Subclasses both :class:`ValueError` and :class:`TypeError`, so callers that
    already catch either keep working. The message names the argument first,
    then shows what was expected (with the bound dimensions) and what was got,
    and, where the cause is recognisable, how to fix it.
    """
