"""What the GEMM probes (tma_probe.py, splitk_probe.py, persistent_probe.py, epilogue_probe.py, ...) share.

Their inputs at one T beside ``torch.mm`` (`gemm_inputs`); each variant checked once, then timed (`measure`);
the medians printed over ``torch.mm``'s (`report`).

Not part of the package; imported by those scripts (run as ``python benchmarks/NAME.py``, this
directory first on the path).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

import typedkv
from typedkv import _bench

Variants = Mapping[str, Sequence[Callable[[], object]]]


def gemm_inputs(
    weight: torch.Tensor, num_tokens: int, sets: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[Callable[[], object]]]:
    """``(hiddens, outs, ref, mm)``: ``sets`` random ``[T, K]`` inputs and ``[T, N]`` outputs in ``weight``'s dtype
    (``weight`` ``[N, K]``), the first input's product, and ``torch.mm`` into each output (the probes' baseline)."""
    n, k = weight.shape
    hiddens = [torch.randn(num_tokens, k, device=weight.device, dtype=weight.dtype) for _ in range(sets)]
    outs = [torch.empty(num_tokens, n, device=weight.device, dtype=weight.dtype) for _ in range(sets)]
    mm: list[Callable[[], object]] = [
        lambda h=h, o=o: torch.mm(h, weight.t(), out=o) for h, o in zip(hiddens, outs, strict=True)
    ]
    return hiddens, outs, hiddens[0] @ weight.t(), mm


def measure(
    label: str, variants: Variants, check: Callable[[str, Sequence[Callable[[], object]]], str], *,
    rounds: int = 3, replays: int = 10, min_calls: int = 20,
) -> tuple[dict[str, float], dict[str, str]]:  # fmt: skip
    """Each variant's median microseconds and ``check``'s verdict on it.

    ``check(name, calls)`` runs the variant's first call (as often as it needs) and returns what
    it found (its largest error, say); a variant whose check raises (a configuration that does not
    compile or fit) is reported under ``label`` and left out. The others are timed as
    `typedkv._bench` times (CUDA-graph replays over the rotating calls), each variant once per
    round, ``rounds`` rounds, so that the host's slow spells fall on all of them.
    """
    errors: dict[str, str] = {}
    for name, calls in variants.items():
        try:
            errors[name] = check(name, calls)
            torch.cuda.synchronize()
        except Exception as e:  # a configuration that does not compile or fit: skip it
            print(f"{label} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in errors}
    for _ in range(rounds):
        for name in errors:
            times[name].append(_bench.gpu_time_us(variants[name], replays=replays, min_calls=min_calls))
    return {name: statistics.median(t) for name, t in times.items()}, errors


def largest_error(
    out: torch.Tensor, ref: torch.Tensor, calls: int = 1
) -> Callable[[str, Sequence[Callable[[], object]]], str]:
    """A `measure` check: a variant's first call run ``calls`` times into ``out`` (NaN before each, so that
    a call that writes nothing shows), then its largest difference from ``ref``."""

    def check(name: str, variant: Sequence[Callable[[], object]]) -> str:
        for _ in range(calls):
            out.fill_(float("nan"))
            variant[0]()
        torch.cuda.synchronize()
        return f"{(out.float() - ref.float()).abs().max().item():.3g}"

    return check


def report(label: str, med: Mapping[str, float], errors: Mapping[str, str] | None = None) -> None:
    """``label`` with ``torch.mm``'s median (``med["mm"]``, microseconds), then each variant's median over it,
    fastest first, with its check's verdict (``errors``) where given."""
    mm = med["mm"]
    print(f"{label} mm {mm:.2f} us", flush=True)
    width = max(map(len, med))
    for name, us in sorted(med.items(), key=lambda item: item[1]):
        verdict = f"  (err {errors[name]})" if errors is not None else ""
        print(f"   {name:<{width}} {us / mm:.3f}{verdict}", flush=True)


def check_against_whole(
    variants: Mapping[str, object], results: Callable[[str], tuple[torch.Tensor, ...]], prefixes: tuple[str, ...],
    dtype: torch.dtype, label: str,
) -> int:  # fmt: skip
    """The ``--check`` of the probes that cut the materializer's work into parts (chunk_probe.py,
    layer_overlap_probe.py): each variant named with one of ``prefixes`` against ``whole``, dense
    and into pools (names ending ``_pools``), through ``results(name)``, which runs a variant and
    returns its K and V. A part's GEMM may sum in another order: within a few storage ulps.
    Prints a line a variant; returns the number that failed."""
    bad = 0
    for pools in ("", "_pools"):
        want = results(f"whole{pools}")
        for name in variants:
            if name.startswith(prefixes) and name.endswith(pools) and (pools or not name.endswith("_pools")):
                got = results(name)
                error = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))
                ok = error <= 4 * torch.finfo(dtype).eps * 8
                bad += not ok
                print(f"check {name:<16} max |{label} - whole| {error:.3g} {'ok' if ok else 'FAILED'}", flush=True)
    return bad


class DraftWeights:
    """A draft's random weights (its layers' K/V rows ``[L*2*H*D, hidden]``, K norm weights, a cos/sin
    cache of 4096 positions): bfloat16 on CUDA, float32 on the CPU (the probes' ``--check``)."""

    def __init__(self, layers: int, heads: int, head_dim: int, hidden: int, device: torch.device) -> None:
        self.L, self.H, self.D, self.hidden = layers, heads, head_dim, hidden
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dtype, self.device = dtype, device
        rows = layers * 2 * heads * head_dim
        self.weight = (torch.randn(rows, hidden, device=device) / hidden**0.5).to(dtype)
        self.norm = (torch.rand(layers, head_dim, device=device) + 0.5).to(dtype)
        self.cos_sin = typedkv.cos_sin_cache(4096, head_dim, device=device)


def outputs_left(
    run: Callable[[], object], pools: bool, k_out: torch.Tensor, v_out: torch.Tensor, k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor], cache_loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """K and V as ``run`` (one variant's call) leaves them: the pools' rows at ``cache_loc`` (``pools``), else
    ``k_out`` / ``v_out``; every one NaN before the call, so that a variant that writes nothing shows."""
    for t in (*k_layers, *v_layers, k_out, v_out):
        t.fill_(float("nan"))
    run()
    if k_out.is_cuda:
        torch.cuda.synchronize(k_out.device)
    if pools:
        return torch.stack(list(k_layers))[:, cache_loc].clone(), torch.stack(list(v_layers))[:, cache_loc].clone()
    return k_out.clone(), v_out.clone()
