"""Timing for ``typedkv bench``: CUDA-graph replays of many calls, alternated variants, host wall-clock time."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch


def _discard(_: object) -> None:
    return None


def gpu_time_us(calls: Sequence[Callable[[], None]], replays: int = 25, min_calls: int = 20) -> float:
    """Median device time of one call, from CUDA-graph replays over rotating inputs.

    One replay holds at least ``min_calls`` calls: a graph of one large call
    would add the replay's own start-up (a few microseconds) to every call.
    """
    graph, num_calls = _captured(calls, min_calls)
    return _replay_us(graph, num_calls, replays)


def paired_gpu_time_us(
    calls: Mapping[str, Sequence[Callable[[], None]]],
    rounds: int = 7,
    replays: int = 5,
    min_calls: int = 20,
    *,
    sampling: AbstractContextManager[object] | None = None,
) -> dict[str, list[float]]:
    """Each implementation's device time of one call, round by round, the implementations interleaved.

    The host drifts (clocks, temperature) over the minutes a section takes, so a
    ratio of two implementations timed one after the other compares two states
    of the host, and the one always timed first is always timed in the earlier
    state. Here every implementation's graph is captured first, as `gpu_time_us`
    captures it, and all are kept; then each round times every graph, in the
    order `round_order` gives (a balanced Latin square's rows, so none always
    runs first or always after the same one). Two times of one round were
    taken moments apart: their ratio compares one state, and a ratio's median
    over the rounds is that of ``rounds`` such comparisons.

    Parameters
    ----------
    calls : Mapping[str, Sequence[Callable[[], None]]]
        Each implementation's calls by its name, one call per rotating input
        set (what `gpu_time_us` takes).
    rounds : int
        Rounds; each times every implementation once.
    replays : int
        Timed replays of an implementation's graph in a round; the round's time
        is their median.
    min_calls : int
        Calls per graph at least (the rotation repeated), as `gpu_time_us`.
    sampling : AbstractContextManager, optional
        Entered while the rounds run, after every graph is captured (a
        `typedkv.tools.gpu_state.Window`: the GPU's clock and power while timed).

    Returns
    -------
    dict[str, list[float]]
        Each implementation's microseconds per call in each round, round 0 first.

    Notes
    -----
    Every implementation's graph, with what its calls allocate, is alive until
    this returns; its memory then stays with torch's caching allocator, for the
    caller to hand back (``torch.cuda.empty_cache()``) before larger calls.
    """
    graphs = {impl: _captured(fns, min_calls) for impl, fns in calls.items()}
    times: dict[str, list[float]] = {impl: [] for impl in graphs}
    with sampling if sampling is not None else nullcontext():
        for round_index in range(rounds):
            for impl in round_order(list(graphs), round_index):
                graph, num_calls = graphs[impl]
                times[impl].append(_replay_us(graph, num_calls, replays))
    return times


def round_order(impls: Sequence[str], round_index: int) -> list[str]:
    """The order round ``round_index`` of `paired_gpu_time_us` times ``impls`` in: a balanced Latin square's row.

    What ran just before an implementation sets the clock it starts at where
    the GPU is held at its power limit, so every implementation must follow
    each other one as often. A plain rotation does not: there ``impls[i]``
    always follows ``impls[i - 1]`` unless it runs first, which biased the
    ratios by up to 15% (docs/decisions/013-end-to-end-timing.md). The rows are
    Williams's design: the first is
    ``0, 1, n-1, 2, n-2, ...``, round ``r`` adds ``r`` to each index (mod
    ``n``), and where ``n`` is odd the second ``n`` rounds run those rows
    backwards. Over ``n`` rounds (``2n`` where ``n`` is odd) each
    implementation runs first equally often and follows each other one
    equally often within a round.
    """
    n = len(impls)
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [impls[(i + round_index) % n] for i in first]
    return row[::-1] if n % 2 and (round_index // n) % 2 else row


def _captured(calls: Sequence[Callable[[], None]], min_calls: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """``calls`` captured in one CUDA graph, replayed once: the graph and the number of calls it holds."""
    sequence = list(calls) * max(1, math.ceil(min_calls / len(calls)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # Repeat the rotation so one replay lasts long enough to time well.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in sequence:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, len(sequence)


def _replay_us(graph: torch.cuda.CUDAGraph, num_calls: int, replays: int) -> float:
    """Median over ``replays`` timed replays of ``graph`` of its time per call (it holds ``num_calls``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[float] = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    return statistics.median(times)


def copy_roofline_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written) over a 1 GiB buffer.

    The faster of ``copy_`` (cudaMemcpy) and an elementwise kernel, timed with
    events outside any graph: in a graph a copy becomes a memcpy node, which can
    run on the slower copy engines.
    """
    import triton.testing

    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    best = 0.0
    for fn in (lambda: dst.copy_(src), lambda: torch.mul(src, 1.0, out=dst)):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        best = max(best, 2 * src.numel() * src.element_size() / (ms * 1e3) / 1e3)
    return best


def host_time_us(fn: Callable[[], None], calls: int = 3000) -> float:
    """Wall-clock host time per call, the device kept busy asynchronously."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def paired_host_time_us(
    fn: Callable[[], None], bare: Callable[[], None], rounds: int = 7, calls: int = 500
) -> tuple[float, float, float]:
    """``fn``'s and ``bare``'s host time per call, alternated in ``rounds`` of ``calls`` each.

    This host's call times are bimodal, and a mode outlasts a round: a ratio of two
    measurements taken apart can compare two modes. Returns the median of each one's
    rounds and the median of the per-round ratios (``fn`` over ``bare``).
    """
    pairs = [(host_time_us(fn, calls), host_time_us(bare, calls)) for _ in range(rounds)]
    return (
        statistics.median(us for us, _ in pairs),
        statistics.median(us for _, us in pairs),
        statistics.median(us / bare_us for us, bare_us in pairs),
    )
