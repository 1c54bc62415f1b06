"""Calls from several threads at once: each gives its single-threaded result and none raises.

What is covered
---------------
The ops keep process-wide state between calls: the checked plan of each layout
(``Signature.plan``), the launch built for each plan, and, for per-layer pools, a
device table of layer offsets per set of pool addresses (``typedkv.core.device_tables._TABLES``, least
recently used evicted; held to 8 entries here, so that the scripts overflow it). An engine may call
from several threads (a scheduler and a draft model, one thread per device). Here `THREADS` threads, released
together by a `threading.Barrier`, each play a script of `CALLS` calls, each call with
fresh values in a layout drawn from a shared palette (``T``, ``L``, ``H``, ``D``, ``R``,
dtypes, stacked and per-layer pools, FP8 pools, ``k_out`` slabs): threads build plans
for new layouts while others use the same plans. Per-layer pools are either kept for
the thread's whole script (an engine's pool: table hits, new slots each call) or fresh
at every call (new addresses: table misses that evict other threads' entries), so the
table churns while other threads read it. ``sys.setswitchinterval`` is lowered so that threads interleave
inside calls.

Every call's outputs, and every byte of the buffers around its outputs and pools
(`tests/test_fuzz.py`'s guarded arenas), must equal what the same script gives when
it is played alone: the ops are deterministic. Numerics against the float64 oracle are
`tests/test_fuzz.py`'s business.

Runs on the PyTorch reference path, under ``TRITON_INTERPRET=1`` (fewer, smaller calls:
the interpreter takes ~50 ms per launch here; typedkv makes interpreted launches
take turns) and on CUDA (``gpu`` marker; a palette of 12 layouts, so that
Triton compiles a few kernels, not one per call).

`test_layer_table_entry_evicted_between_lookup_and_reuse` forces one interleaving of
two threads in the layer-table cache that the free-running test can only hit by chance.
"""

from __future__ import annotations

import copy
import random
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from test_fuzz import HEAD_DIMS, KV_LAYOUTS, MODES, OUT_KINDS, PARAM_FLOATS, STORAGE, Call, Spec, build
from test_pool import FP8
from test_pool import LAYOUTS as POOL_LAYOUTS
from torch import Tensor

import typedkv
from typedkv.core import device_tables, launcher

THREADS, CALLS = (6, 10) if launcher.INTERPRETED else (8, 20)
# Distinct layouts the threads draw from. On CUDA each one is compiled once (the
# single-threaded run warms Triton's cache): a few, so that the threads hammer the
# same plans and compiled launches.
LAYOUTS = 24 if launcher.INTERPRETED else 64
GPU_THREADS, GPU_CALLS, GPU_LAYOUTS = 8, 50, 12


@dataclass(frozen=True)
class Step:
    """One call of a script: a valid `Spec` (values from its seed), and whether it reuses the pools."""

    spec: Spec
    keep_pools: bool  # into the pools of this spec's previous call, at other slots


def layouts(count: int, *, small: bool) -> list[Spec]:
    """``count`` valid call layouts: sizes, dtypes, pool kinds (each call draws its values)."""
    rng = random.Random("layouts")
    specs: list[Spec] = []
    for _ in range(count):
        num_tokens = rng.randint(1, 3 if small else 7)
        head_dim = rng.choice((16, 32) if small else HEAD_DIMS)
        kv_dtype = rng.choice(STORAGE)
        pool_dtype = rng.choice((kv_dtype, *FP8))
        spec = Spec(
            num_tokens=num_tokens,
            num_layers=rng.randint(1, 2 if small else 4),
            num_kv_heads=rng.randint(1, 2 if small else 4),
            head_dim=head_dim,
            rotary_dim=2 * rng.randint(1, head_dim // 2),
            num_positions=rng.randint(1, 64),
            kv_dtype=kv_dtype,
            weight_dtype=rng.choice(PARAM_FLOATS),
            cache_dtype=rng.choice(PARAM_FLOATS),
            positions_dtype=rng.choice((torch.int32, torch.int64)),
            eps=rng.choice((1e-6, 0.25, torch.float32, torch.bfloat16)),
            rope_style=rng.choice(("neox", "gptj")),
            kv_layout=rng.choice(KV_LAYOUTS),
            position_faults=(None,) * num_tokens,
            seed=0,
            mutation=None,
            pool=rng.random() < 0.7,
            k_out=rng.choice(OUT_KINDS),
            v_out=rng.choice(OUT_KINDS),
            pool_layout=rng.choice([name for name in POOL_LAYOUTS if name.startswith("list")] + ["stacked"]),
            num_slots=num_tokens + rng.randint(0, 6),
            pool_dtype=pool_dtype,
            k_scale=rng.choice((None, 0.5, torch.float32)) if pool_dtype in FP8 else None,
            v_scale=rng.choice((None, 2.0, torch.float64)) if pool_dtype in FP8 else None,
            loc_dtype=rng.choice((torch.int32, torch.int64)),
            slot_kinds=tuple(rng.choice(("slot", "slot", "skip")) for _ in range(num_tokens)),
        )
        specs.append(spec)
    return specs


def _per_layer(spec: Spec) -> bool:
    return spec.pool and spec.pool_layout.startswith("list")


def script(thread: int, calls: int, palette: Sequence[Spec]) -> list[Step]:
    """The calls of one thread: layouts drawn from ``palette``, fresh values each call,
    and every third call or so into per-layer pools the thread used before."""
    rng = random.Random(f"thread {thread}")
    steps: list[Step] = []
    kept: list[Spec] = []
    for _ in range(calls):
        if kept and rng.random() < 0.3:
            steps.append(Step(rng.choice(kept), keep_pools=True))
            continue
        spec = replace(rng.choice(palette), seed=rng.getrandbits(32))
        if _per_layer(spec):
            kept.append(spec)
        steps.append(Step(spec, keep_pools=False))
    return steps


def play(steps: Sequence[Step], device: torch.device) -> list[list[Tensor]]:
    """Run a script; per call, copies of its outputs and of every buffer around its outputs and pools."""
    calls: dict[Spec, Call] = {}
    results: list[list[Tensor]] = []
    for step in steps:
        call = calls.get(step.spec) if step.keep_pools else None
        if call is None:
            call = build(step.spec, device)
            calls[step.spec] = call
        else:
            call.args["cache_loc"] = call.args["cache_loc"].roll(1)  # other rows of the same pools
        out = call.run()
        results.append([t.clone() for t in out or ()] + call.arena.snapshot())
    return results


def play_together(scripts: Sequence[Sequence[Step]], device: torch.device) -> list[list[list[Tensor]]]:
    """Play each script in a thread of its own, all released at once; re-raise the first error."""
    return together(lambda i: play(scripts[i], device), len(scripts))


def together(work: Callable[[int], list[list[Tensor]]], count: int) -> list[list[list[Tensor]]]:
    """``work(i)`` in ``count`` threads, all released at once, switching often; re-raise the first error."""
    barrier = threading.Barrier(count)
    results: list[list[list[Tensor]]] = [[] for _ in range(count)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as err:  # reported by the main thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"typedkv-{i}") for i in range(count)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads every 10 us instead of 5 ms
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return results


def _assert_same(got: list[list[list[Tensor]]], want: list[list[list[Tensor]]]) -> None:
    for thread, (got_calls, want_calls) in enumerate(zip(got, want, strict=True)):
        assert len(got_calls) == len(want_calls), f"thread {thread} made {len(got_calls)} calls"
        for call, (got_tensors, want_tensors) in enumerate(zip(got_calls, want_calls, strict=True)):
            for i, (a, b) in enumerate(zip(got_tensors, want_tensors, strict=True)):
                same = a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
                assert same, f"thread {thread}, call {call}: tensor {i} differs from the single-threaded run"


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _check_threads(device: torch.device, threads: int, calls: int, num_layouts: int) -> None:
    palette = layouts(num_layouts, small=launcher.INTERPRETED)
    scripts = [script(i, calls, palette) for i in range(threads)]
    fresh = sum(_per_layer(step.spec) and not step.keep_pools for steps in scripts for step in steps)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_tables, "_TABLES_MAX", 8)
        assert fresh > device_tables._TABLES_MAX, "the scripts must overflow the layer-table cache"
        alone = [play(steps, device) for steps in scripts]
        _assert_same(play_together(scripts, device), alone)


@pytest.mark.parametrize("mode", MODES)
def test_threads(mode: str) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    _check_threads(torch.device("cpu"), THREADS, CALLS, LAYOUTS)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_threads_cuda(mode: str) -> None:
    assert typedkv.debug_enabled() == (mode == "debug")
    _check_threads(torch.device("cuda"), GPU_THREADS, GPU_CALLS, GPU_LAYOUTS)


# --------------------------------------------------------------------------- one materializer, shared


def _materializers(device: torch.device) -> dict[str, Any]:
    torch.manual_seed(5)
    hidden_size, layers, heads, dim = 48, 2, 2, 16
    kv = typedkv.KVMaterializer(
        torch.randn(layers, 2 * heads * dim, hidden_size, device=device) / 8, torch.rand(layers, dim, device=device),
        1e-6, typedkv.cos_sin_cache(64, dim, device=device), num_kv_heads=heads,
    )  # fmt: skip
    mla = typedkv.MLAKVMaterializer(
        torch.randn(layers, 24, hidden_size, device=device) / 8, torch.rand(layers, 16, device=device), 1e-6,
        typedkv.cos_sin_cache(64, 8, device=device), rope_style="neox",
    )  # fmt: skip
    return {"kv": kv, "mla": mla}


def _shared_calls(m: Any, device: torch.device, thread: int, calls: int) -> list[list[Tensor]]:
    """``calls`` calls of ``m`` with this thread's own hidden states, at a few T (the workspace regrows)."""
    gen = torch.Generator().manual_seed(thread)
    out = []
    for call in range(calls):
        tokens = (3, 17, 40)[(thread + call) % 3]
        hidden = torch.randn(tokens, 48, generator=gen).to(device)
        positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
        result = m(hidden, positions)
        out.append([t.clone() for t in (result if isinstance(result, tuple) else (result,))])
    return out


@pytest.mark.parametrize("kind", ["kv", "mla"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_materializer_called_from_threads(kind: str, device: str) -> None:
    """One materializer called from several threads at once: each call gives what it gives alone. The GEMM's
    workspace is per thread (`typedkv.projection.layers.Workspace`): shared, one thread's GEMM overwrote the rows
    another's kernel had yet to read (318 of 320 calls wrong, seen on the CPU)."""
    m = _materializers(torch.device(device))[kind]
    threads, calls = (4, 6) if launcher.INTERPRETED else (8, 30)
    alone = [_shared_calls(m, torch.device(device), i, calls) for i in range(threads)]
    results = together(lambda i: _shared_calls(m, torch.device(device), i, calls), threads)
    if device == "cuda":
        torch.cuda.synchronize()
    _assert_same(results, alone)


def _large_materializer(kind: str) -> Any:
    """A materializer whose GEMM at T = 4096 runs long enough on an H200 (tens of microseconds) for two to overlap."""
    torch.manual_seed(6)
    hidden_size, layers = 2048, 4
    if kind == "kv":
        heads, dim = 8, 128
        m = typedkv.KVMaterializer(
            (torch.randn(layers, 2 * heads * dim, hidden_size, device="cuda") / 45).bfloat16(),
            torch.rand(layers, dim, device="cuda") + 0.5, 1e-6, typedkv.cos_sin_cache(8192, dim, device="cuda"),
            num_kv_heads=heads,
        )  # fmt: skip
        m.projection_path = "gemm"  # the path with a workspace
        return m
    return typedkv.MLAKVMaterializer(
        (torch.randn(layers, 512 + 64, hidden_size, device="cuda") / 45).bfloat16(),
        torch.rand(layers, 512, device="cuda") + 0.5, 1e-6, typedkv.cos_sin_cache(8192, 64, device="cuda"),
        rope_style="neox",
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_one_materializer_on_two_streams_cuda(kind: str) -> None:
    """One thread calls one materializer on two CUDA streams whose work starts together (both held behind one
    event): each call gives what it gives alone. Both calls' GEMMs write the thread's workspace, so the second
    call's stream waits for the first's work (`typedkv.projection.layers.Workspace`); without that wait one stream's
    GEMM overwrote the rows the other's kernel read."""
    typedkv.set_debug(False)
    m = _large_materializer(kind)
    gen = torch.Generator().manual_seed(7)
    tokens = 4096
    calls = [
        (
            torch.randn(tokens, 2048, generator=gen).bfloat16().cuda(),
            torch.randint(0, 8192, (tokens,), generator=gen).cuda(),
        )
        for _ in range(2)
    ]
    alone = [[t.clone() for t in _as_tuple(m(*call))] for call in calls]
    torch.cuda.synchronize()
    first, second, gate = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Event()
    for stream in (first, second):
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        with torch.cuda.stream(second):
            # ~10 ms: both calls are queued before either starts.
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
            gate.record(second)
        first.wait_event(gate)
        with torch.cuda.stream(first):
            got_first = _as_tuple(m(*calls[0]))
        with torch.cuda.stream(second):
            got_second = _as_tuple(m(*calls[1]))
        torch.cuda.synchronize()
        _assert_same([[list(got_first)], [list(got_second)]], [[alone[0]], [alone[1]]])


def _as_tuple(result: Any) -> tuple[Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def test_a_copied_materializer_has_its_own_workspace() -> None:
    """copy.deepcopy (and pickling) of a materializer: the copy computes alike, into rows of its own."""
    for m in _materializers(torch.device("cpu")).values():
        hidden, positions = torch.randn(5, 48), torch.arange(5)
        first = m(hidden, positions)
        twin = copy.deepcopy(m)
        assert twin._workspace is None
        again = twin(hidden, positions)
        for a, b in zip(
            first if isinstance(first, tuple) else (first,),
            again if isinstance(again, tuple) else (again,),
            strict=True,
        ):
            assert torch.equal(a, b)
        assert twin._workspace is not None and twin._workspace.data_ptr() != m._workspace.data_ptr()


# --------------------------------------------------------------------------- the layer-table cache


def _per_layer_pools(num_layers: int = 2) -> tuple[list[Tensor], list[Tensor]]:
    base = torch.empty(2, num_layers, 4, 1, 16, dtype=torch.bfloat16)
    return list(base[0]), list(base[1])


def _table(k_layers: list[Tensor], v_layers: list[Tensor]) -> Tensor:
    return device_tables.layer_table(k_layers, v_layers, [t.data_ptr() for t in (*k_layers, *v_layers)])[0]


@pytest.mark.gpu
def test_tables_copied_on_a_busy_stream_read_on_another_cuda() -> None:
    """The per-layer pool table and per-layer eps (`typedkv.core.device_tables.Upload`: copied without a sync, on
    the stream of the call that first needs them, then shared) read on another stream.

    Pending copy: a call on stream A makes both, its copies queued behind ~10 ms of work, over blocks of
    zeros (offsets 0 send every layer to layer 0; eps 0 changes K); a call on stream B right after reads
    them and must wait for the copies. Dropped table: a call on A makes the table; a call on B queued behind
    ~20 ms reads it; then A passes 17 other pool sets, which drops the table from the cache and offers its
    memory to A's next tables (other offsets): the allocator must hold it until B has read it. Every pool
    row is compared with the same calls made one after the other on one stream."""
    typedkv.set_debug(False)
    torch.manual_seed(8)
    layers, heads, dim, slots, tokens = 6, 8, 128, 4096, 2048
    norm = torch.rand(layers, dim, device="cuda") + 0.5
    # A list: a device tensor made once (`layer_eps`); large enough that an eps of 0 shows in K.
    eps = [0.1 * (i + 1) for i in range(layers)]
    rope = typedkv.cos_sin_cache(4096, dim, device="cuda")
    order = torch.randperm(slots, device="cuda")  # the two calls write disjoint slots
    calls = [
        (
            torch.randn(tokens, layers, 2 * heads * dim, device="cuda").bfloat16(),
            torch.randint(0, 4096, (tokens,), device="cuda"),
            order[i * tokens : (i + 1) * tokens],
        )
        for i in range(2)
    ]

    def pools(spare: int = 0) -> tuple[list[Tensor], list[Tensor]]:
        """Per-layer pools; with ``spare`` rows more per layer, other offsets between layers (another table)."""
        both = torch.zeros(2, layers, slots + spare, heads, dim, dtype=torch.bfloat16, device="cuda")
        return list(both[0]), list(both[1])

    def write(call: tuple[Tensor, Tensor, Tensor], k: list[Tensor], v: list[Tensor]) -> None:
        typedkv.materialize_kv_into_pool(call[0], norm, eps, rope, call[1], call[2], k, v, num_kv_heads=heads)

    def check(got: tuple[list[Tensor], list[Tensor]], phase: str) -> None:
        torch.cuda.synchronize()
        for name, got_layers, want_layers in zip("kv", got, want, strict=True):
            for layer, (g, w) in enumerate(zip(got_layers, want_layers, strict=True)):
                assert torch.equal(_bytes(g), _bytes(w)), f"{phase}: {name} layer {layer} differs"

    want = pools()
    for call in calls:
        write(call, *want)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (a, b):
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        device_tables._TABLES.clear()
        device_tables._EPS.clear()
        got = pools()  # new addresses: a new table
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            zeros = [torch.zeros(2 * layers, dtype=torch.int64, device="cuda") for _ in range(64)]
            del zeros  # 64 small blocks of zeros, free on A: the eps and the table land in two of them
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
            write(calls[0], *got)
        with torch.cuda.stream(b):
            write(calls[1], *got)
        check(got, "pending copy")

        device_tables._TABLES.clear()
        got = pools()
        with torch.cuda.stream(a):
            write(calls[0], *got)
        torch.cuda.synchronize()  # the table copied
        with torch.cuda.stream(b):
            torch.cuda._sleep(40_000_000)  # type: ignore[no-untyped-call]
            write(calls[1], *got)
        with torch.cuda.stream(a):
            for spare in range(1, device_tables._TABLES_MAX + 2):  # the table dropped; its memory offered on A
                other = pools(spare)
                write(calls[0], *other)
        check(got, "dropped table")


def test_layer_table_entry_evicted_between_lookup_and_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table hit stays usable when another thread evicts its entry right after the lookup.

    Python may switch threads after any call returns: here, right after
    ``_TABLES.get(key)`` has found the entry and before ``_TABLES.move_to_end(key)``.
    If the other thread then passes more than `_TABLES_MAX` new sets of per-layer pools (on
    CUDA ~30 us each: about 2 ms, inside one 5 ms switch interval), the entry is
    evicted and ``move_to_end`` raised ``KeyError`` out of
    ``materialize_kv_into_pool`` (before the cache got its lock). The switch is
    forced here: the other thread runs, really in another thread, exactly at that point.
    """
    k_layers, v_layers = _per_layer_pools()
    _table(k_layers, v_layers)
    others = [_per_layer_pools() for _ in range(device_tables._TABLES_MAX + 1)]  # alive: distinct addresses
    caller = threading.current_thread()

    def other_thread() -> None:
        for k_other, v_other in others:
            _table(k_other, v_other)

    class SwitchAfterLookup(OrderedDict[tuple[object, ...], device_tables.Upload]):
        def get(self, key: tuple[object, ...], default: Any = None) -> Any:
            hit = super().get(key, default)
            if threading.current_thread() is caller:
                thread = threading.Thread(target=other_thread)
                thread.start()
                thread.join(timeout=2)  # a lock in _layer_table would hold it back: then go on
            return hit

    monkeypatch.setattr(device_tables, "_TABLES", SwitchAfterLookup(device_tables._TABLES))
    table = _table(k_layers, v_layers)
    assert table.tolist() == [[0, 64], [0, 64]]
