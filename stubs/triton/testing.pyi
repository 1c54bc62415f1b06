from collections.abc import Callable, Sequence
from typing import Literal, overload

from torch import Tensor

# Runtimes in milliseconds: one float for a summary statistic, a list for
# quantiles (which override return_mode) or for return_mode="all".
@overload
def do_bench(
    fn: Callable[[], object],
    warmup: int = 25,
    rep: int = 100,
    grad_to_none: Sequence[Tensor] | None = None,
    quantiles: None = None,
    return_mode: Literal["min", "max", "mean", "median"] = "mean",
) -> float: ...
@overload
def do_bench(
    fn: Callable[[], object],
    warmup: int = 25,
    rep: int = 100,
    grad_to_none: Sequence[Tensor] | None = None,
    *,
    quantiles: Sequence[float],
    return_mode: Literal["min", "max", "mean", "median", "all"] = "mean",
) -> list[float]: ...
@overload
def do_bench(
    fn: Callable[[], object],
    warmup: int = 25,
    rep: int = 100,
    grad_to_none: Sequence[Tensor] | None = None,
    quantiles: None = None,
    *,
    return_mode: Literal["all"],
) -> list[float]: ...
