"""Small device tensors built from host values once and reused: per-layer pool offset tables, per-layer eps.

A call at a given layout passes the same host values again and again (the
addresses of an engine's per-layer pools, a model's epsilons): each becomes a
device tensor once, copied from pinned memory without a sync, and is looked up
after that. What a CUDA graph was captured with is read on every replay, so it
is never freed.

The copy runs on the stream current when the tensor is made, and the cache is
shared by every thread: a call on another stream first makes its stream wait for
the copy and marks the tensor used on its stream, so that a table dropped from
the cache goes back to the allocator only once that stream's work is done
(`Upload.on_current_stream`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from typedkv.core.launcher import current_raw_stream


class Upload:
    """A device tensor copied from a pinned host tensor without a sync, readable on any stream.

    ``host``: the pinned source; it lives as long as the copy, since a copy made during
    a CUDA graph's capture reads it again on every replay. ``multiple``: the caller's
    (a layer table's `table_multiple`).
    """

    __slots__ = ("_index", "_ready", "_streams", "device_tensor", "host", "multiple")

    def __init__(self, host: Tensor, device: torch.device, multiple: int = 0) -> None:
        self.host = host
        self.multiple = multiple
        self.device_tensor = host.to(device, non_blocking=True)
        self._index = -1
        self._ready: torch.cuda.Event | None = None  # recorded after the copy, on the stream that made it
        # The streams ordered after the copy; None on the CPU (nothing to order); empty for a copy made
        # during a capture, which only that graph's replays run.
        self._streams: set[int] | None = None
        if device.type == "cuda":
            self._index = self.device_tensor.get_device()
            self._streams = set()
            if not torch.cuda.is_current_stream_capturing():
                self._copied_on_current_stream()

    def _copied_on_current_stream(self) -> None:
        stream = torch.cuda.current_stream(self._index)
        self._ready = torch.cuda.Event()
        self._ready.record(stream)
        self._streams = {stream.cuda_stream}

    def on_current_stream(self) -> Tensor:
        """The device tensor, with the current stream ordered after its copy and known to the allocator.

        On another stream than the copy's (the cache is shared by every thread and stream), the
        stream waits for the copy (an event: free on the device once the copy is done; never
        queried, since a query during another thread's capture would break that capture) and
        the tensor is recorded as used there, so that once dropped from the cache its memory goes
        to no other tensor before that stream's work is done. During a capture the stream is left
        as it is (the warm-up before it ordered the capture after the copy: docs/integration.md),
        except that a tensor made during an earlier capture is copied again inside this one.
        """
        streams = self._streams
        if streams is None or (current_raw_stream is not None and current_raw_stream(self._index) in streams):
            return self.device_tensor
        capturing = torch.cuda.is_current_stream_capturing()
        if not streams:
            # Made during a capture: its copy runs only in that graph's replays. Copy it again, here: inside
            # this capture, or eagerly (then this stream is the copy's).
            self.device_tensor.copy_(self.host, non_blocking=True)
            if not capturing:
                self._copied_on_current_stream()
            return self.device_tensor
        if capturing:
            return self.device_tensor
        stream = torch.cuda.current_stream(self._index)
        if stream.cuda_stream not in streams:
            if self._ready is not None:
                stream.wait_event(self._ready)
            self.device_tensor.record_stream(stream)
            streams.add(stream.cuda_stream)
        return self.device_tensor


# Per-layer pool lists -> [2, L] int64 element offsets from layer 0, on the device,
# and the multiple every offset is of: 16 bytes' elements when every layer starts
# on 16 bytes (the kernels then store whole vectors), else 1.
# Built once per set of pool addresses (a pinned host copy, no sync) and reused;
# the last _TABLES_MAX sets are kept. A set missing here when a CUDA graph captures
# its call is copied inside the graph, at every replay (microseconds a call), so the
# cache holds as many sets as a benchmark rotates through (`tools.cases.rotating_sets`).
# A table a CUDA graph was captured with is read on every replay, so it moves to
# _PINNED and is never freed: otherwise its memory could go to another tensor (or
# another table) and the graph would write through whatever offsets that holds.
# _PINNED grows by one [2, L] table (and its pinned host copy) per set of pools ever
# captured. Threads share both under _LOCK.
_TABLES: OrderedDict[tuple[object, ...], Upload] = OrderedDict()
_TABLES_MAX = 64
_PINNED: dict[tuple[object, ...], Upload] = {}
_LOCK = threading.Lock()


def layer_table(k_layers: Sequence[Tensor], v_layers: Sequence[Tensor], addresses: Sequence[int]) -> tuple[Tensor, int]:
    """The ``[2, L]`` element offsets of each layer's K and V tensor from layer 0's, on their device,
    and the multiple of elements every offset is of: 16 bytes' worth when every one of those
    tensors starts on 16 bytes, else 1 (the launches' ``table_multiple``).

    ``addresses``: every tensor's ``data_ptr()``, K's then V's (the caller has them already).
    """
    # Offsets are in elements: the same addresses in another dtype need another table.
    device = k_layers[0].device
    key = (k_layers[0].element_size(), device, *addresses)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    with _LOCK:
        entry = _TABLES.get(key)
        if entry is not None and not capturing:
            # The usual eager call: a table built before, still kept (host time per call).
            _TABLES.move_to_end(key)
            return entry.on_current_stream(), entry.multiple
        entry = entry or _PINNED.get(key)
        if entry is None:
            size = k_layers[0].element_size()
            rows = [[(t.data_ptr() - layers[0].data_ptr()) // size for t in layers] for layers in (k_layers, v_layers)]
            host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
            entry = Upload(host, device, 1 if any(a & 15 for a in addresses) else 16 // size)
        if capturing:
            _TABLES.pop(key, None)
            _PINNED[key] = entry
        elif key not in _PINNED:
            _TABLES[key] = entry
            _TABLES.move_to_end(key)
            if len(_TABLES) > _TABLES_MAX:
                _TABLES.popitem(last=False)
        return entry.on_current_stream(), entry.multiple


# eps given as a sequence of per-layer numbers -> an [L] float32 tensor on the
# device, made once per set of values and device and kept for good: a CUDA graph
# captured with it reads it on every replay (as with _PINNED). One small tensor
# per distinct set of a model's epsilons.
_EPS: dict[tuple[tuple[float, ...], torch.device], Upload] = {}


def layer_eps(eps: float | Sequence[float] | Tensor, on: Tensor) -> float | Tensor:
    """``eps`` as the kernel and the reference take it: a float, or an ``[L]`` tensor on ``on``'s device.

    A sequence (checked already: numbers, one per layer) becomes a tensor even
    when its values are equal, so that one layout always launches alike.
    ``on`` is the call's input tensor: its device is read only for a sequence
    (a float or a tensor, the common case, costs no attribute lookup per call).
    """
    if isinstance(eps, (float, int, Tensor)):
        return eps
    device = on.device
    key = (tuple(map(float, eps)), device)
    with _LOCK:
        entry = _EPS.get(key)
        if entry is None:
            host = torch.tensor(key[0], dtype=torch.float32, pin_memory=device.type == "cuda")
            entry = _EPS[key] = Upload(host, device)
        return entry.on_current_stream()
