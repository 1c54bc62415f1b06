"""Small device tensors built from host values once and reused: per-layer pool offset tables, per-layer eps.

A call at a given layout passes the same host values again and again (the
addresses of an engine's per-layer pools, a model's epsilons): each becomes a
device tensor once, copied from pinned memory without a sync, and is looked up
after that. What a CUDA graph was captured with is read on every replay, so it
is never freed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

# Per-layer pool lists -> [2, L] int64 element offsets from layer 0, on the device,
# and the multiple every offset is of: 16 bytes' elements when every layer starts
# on 16 bytes (the kernels then store whole vectors), else 1.
# Built once per set of pool addresses (a pinned host copy, no sync) and reused;
# the last _TABLES_MAX sets are kept. A table a CUDA graph was captured with is
# read on every replay, so it moves to _PINNED and is never freed: otherwise its
# memory could go to another tensor (or another table) and the graph would write
# through whatever offsets that holds. _PINNED grows by one [2, L] table (and its
# pinned host copy) per set of pools ever captured. Threads share both under _LOCK.
_TABLES: OrderedDict[tuple[object, ...], tuple[Tensor, Tensor, int]] = OrderedDict()
_TABLES_MAX = 16
_PINNED: dict[tuple[object, ...], tuple[Tensor, Tensor, int]] = {}
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
            return entry[0], entry[2]
        entry = entry or _PINNED.get(key)
        if entry is None:
            size = k_layers[0].element_size()
            rows = [[(t.data_ptr() - layers[0].data_ptr()) // size for t in layers] for layers in (k_layers, v_layers)]
            host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
            multiple = 1 if any(a & 15 for a in addresses) else 16 // size
            # The pinned source lives as long as the table: a copy made during
            # capture is a graph node that reads it again on every replay.
            entry = (host.to(device, non_blocking=True), host, multiple)
        if capturing:
            _TABLES.pop(key, None)
            _PINNED[key] = entry
        elif key not in _PINNED:
            _TABLES[key] = entry
            _TABLES.move_to_end(key)
            if len(_TABLES) > _TABLES_MAX:
                _TABLES.popitem(last=False)
        return entry[0], entry[2]


# eps given as a sequence of per-layer numbers -> an [L] float32 tensor on the
# device, made once per set of values and device and kept for good: a CUDA graph
# captured with it reads it on every replay (as with _PINNED). One small tensor
# per distinct set of a model's epsilons.
_EPS: dict[tuple[tuple[float, ...], torch.device], tuple[Tensor, Tensor]] = {}


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
            # The pinned source lives as long as the copy: a copy made during capture reads it on every replay.
            entry = _EPS[key] = (host.to(device, non_blocking=True), host)
        return entry[0]
