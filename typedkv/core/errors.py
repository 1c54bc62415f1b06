"""The one error type typedkv raises for misuse."""

from __future__ import annotations


class InputError(ValueError, TypeError):
    """An argument was rejected before anything was launched or written.

    Subclasses both :class:`ValueError` and :class:`TypeError`, so callers that
    already catch either keep working. The message names the argument first,
    then shows what was expected (with the bound dimensions) and what was got,
    and, where the cause is recognisable, how to fix it.

    Examples
    --------
    >>> kv, k_norm_weight = torch.randn(4, 2, 64), torch.ones(3, 16)  # kv has 2 layers, the weight 3
    >>> cos_sin_cache, positions = typedkv.cos_sin_cache(8, 16), torch.arange(4)
    >>> try:
    ...     typedkv.materialize_kv(kv, k_norm_weight, 1e-6, cos_sin_cache, positions, num_kv_heads=2)
    ... except typedkv.InputError as err:
    ...     print(err)
    k_norm_weight: expected shape (L=2, D), got (3, 16): L=2 comes from kv
    >>> issubclass(typedkv.InputError, ValueError) and issubclass(typedkv.InputError, TypeError)
    True
    """
