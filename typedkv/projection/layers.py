"""What every materializer module shares: its layers' weights stacked once, and one GEMM per call.

`KVMaterializer` and `MLAKVMaterializer` each hold every layer's projection as
one ``[L*rows, hidden]`` weight, so a call is one GEMM whose layer-major output is
the fused kernel's input. The GEMM writes into a workspace that grows to the
next power of two of ``T`` and is then reused: a decode loop at a fixed ``T``
allocates nothing for it, and nothing in a call waits for the device. A call
captured in a CUDA graph writes into rows of the graph's own, never into the
eager workspace (`Workspace.rows`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from typedkv.core.checking import check_numbers
from typedkv.core.errors import InputError
from typedkv.core.launcher import current_raw_stream
from typedkv.core.messages import fmt_dtype
from typedkv.core.tensor_types import strided
from typedkv.core.value_checks import check_eps

# A materializer's calls come in a few layouts (T buckets, pools); past this many its plans are
# dropped and each layout is checked again (`typedkv.core.checking.CheckedLayouts`).
LAYOUTS_KEPT = 256


class Workspace:
    """The GEMM's output rows, kept between eager calls: one buffer per thread.

    A materializer called from several threads would otherwise have one thread's
    GEMM overwrite the rows another's kernel has yet to read (on the CPU, or on a
    GPU stream the threads share); with its own rows, each thread's GEMM and kernel
    pair up whatever the interleaving.

    One thread's calls on several CUDA streams share its rows. A call on another
    stream than the rows' last makes its stream wait for the work queued on that
    one so far (an event, no host sync) and marks the rows used on its stream
    (`Tensor.record_stream`, so that rows replaced later go back to the
    allocator only once that stream's work is done): otherwise a GEMM on one
    stream could overwrite rows a kernel on another has yet to read. Calls on one
    stream, the usual case, pay one comparison for this.

    The views of the rows a call takes (its ``T`` rows, and those as ``[T, L, width]``)
    are kept with them, per ``T``: making the two cost about 2 µs of host time a call.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self) -> tuple[type[Workspace], tuple[()]]:
        # A copy of a module (copy.deepcopy, pickling) starts with no rows of its own.
        return Workspace, ()

    @property
    def buffer(self) -> Tensor | None:
        """This thread's rows (None before its first eager call)."""
        return getattr(self._local, "buffer", None)

    def rows(self, num_tokens: int, weight: Tensor) -> Tensor:
        """``[num_tokens, weight rows]`` for the GEMM: the eager workspace (grown first if too small), or a capture's own.

        Eagerly, the same view of the workspace for every call of a ``num_tokens`` (`shaped` too).

        A CUDA graph writes on every replay to the buffer it was captured with,
        so a capture never uses the eager workspace, which a later eager call
        may replace and free: it allocates its own rows, which come from the
        graph's private memory pool and stay the graph's for as long as it can
        replay (the caching allocator hands a graph's blocks to nothing else).
        """
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return torch.empty((num_tokens, weight.shape[0]), dtype=weight.dtype, device=weight.device)
        buffer: Tensor | None = getattr(self._local, "buffer", None)
        if buffer is not None and buffer.is_cuda and buffer.device == weight.device:
            self._follow_stream(buffer)
        if (
            buffer is None
            or buffer.shape[0] < num_tokens
            or buffer.dtype != weight.dtype
            or buffer.device != weight.device
        ):
            capacity = 1 << max(num_tokens - 1, 0).bit_length()  # the next power of two: few sizes, ever
            # A normal tensor even when first called under inference_mode, so later calls outside it can write it.
            with torch.inference_mode(False):
                buffer = torch.empty((capacity, weight.shape[0]), dtype=weight.dtype, device=weight.device)
            self._local.buffer = buffer
            self._local.views = {}
            if buffer.is_cuda:
                stream = torch.cuda.current_stream(buffer.device)
                self._local.stream = (stream.cuda_stream, stream)
        views: dict[object, Tensor] = self._local.views
        rows = views.get(num_tokens)
        if rows is None:
            # Made outside inference mode, as the buffer: a view kept from a call under it stays an ordinary view.
            with torch.inference_mode(False):
                rows = views[num_tokens] = buffer[:num_tokens]
        return rows

    def shaped(self, rows: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``rows`` (from `rows`) viewed ``[T, *shape]``: kept with the rows' view when they are the workspace's."""
        num_tokens = rows.shape[0]
        views: dict[object, Tensor] | None = getattr(self._local, "views", None)
        if views is None or views.get(num_tokens) is not rows:
            return rows.view(num_tokens, *shape)  # a capture's own rows
        key = (num_tokens, shape)
        view = views.get(key)
        if view is None:
            with torch.inference_mode(False):
                view = views[key] = rows.view(num_tokens, *shape)
        return view

    def _follow_stream(self, buffer: Tensor) -> None:
        """Order this call after the rows' uses on the stream they were last used on, where that is another."""
        index = buffer.get_device()
        last: tuple[int, torch.cuda.Stream] = self._local.stream  # the rows' last stream: handle, object
        if current_raw_stream is not None and current_raw_stream(index) == last[0]:
            return
        stream = torch.cuda.current_stream(index)
        if stream != last[1]:
            stream.wait_stream(last[1])  # an event recorded there now: its work so far, not the host
            buffer.record_stream(stream)
        self._local.stream = (stream.cuda_stream, stream)


def project(rows: Workspace, hidden: Tensor, weight: Tensor, bias: Tensor | None, shape: tuple[int, int]) -> Tensor:
    """``hidden @ weight.T (+ bias)`` into the workspace's rows, viewed ``[T, *shape]`` (checked by the caller)."""
    out = rows.rows(hidden.shape[0], weight)
    gemm(hidden, weight, bias, out)
    return rows.shaped(out, shape)


def gemm(hidden: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """``out = hidden @ weight.T (+ bias)``, with no autograd history (inference only; out= could not record one)."""
    if hidden.requires_grad and torch.is_grad_enabled():
        with torch.no_grad():
            gemm(hidden, weight, bias, out)
        return
    if bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)


def split_gemm(hidden: Tensor, weight: Tensor, k_rows: Tensor, v_rows: Tensor) -> None:
    """Every layer's K rows of ``hidden @ weight.T`` into ``k_rows``, V's into ``v_rows``: both ``[L, T, H*D]``.

    ``weight`` is a materializer's ``[L*2*H*D, hidden]`` (layer-major, each layer's
    K rows before its V rows), so each part is one batched GEMM over the layers,
    ``hidden`` broadcast (no copy). No bias: on CUDA ``torch.baddbmm`` was seen to
    round the product before adding it (the oracle's V, rounded once, was missed),
    so a materializer with a bias takes GEMM + kernel. No autograd history, as `gemm`.
    """
    if hidden.requires_grad and torch.is_grad_enabled():
        with torch.no_grad():
            split_gemm(hidden, weight, k_rows, v_rows)
        return
    num_layers, num_tokens, width = k_rows.shape
    per_layer = weight.view(num_layers, 2, width, weight.shape[1])
    wide = hidden.expand(num_layers, num_tokens, hidden.shape[1])
    for part, out in enumerate((k_rows, v_rows)):
        torch.bmm(wide, per_layer[:, part].transpose(1, 2), out=out)


def check_layer_counts(arguments: Mapping[str, object], stacked_dims: Mapping[str, int]) -> None:
    """Every per-layer argument has as many layers as the first (the weight): the signature cannot tell for sequences.

    ``stacked_dims``: each argument's rank when it is one stacked tensor.
    """
    (weight_name, weight), *others = arguments.items()
    num_layers = _layer_count(weight, stacked_dims[weight_name])
    if num_layers == 0:
        raise InputError(f"{weight_name}: expected at least one layer, got none")
    if num_layers is None:
        return  # neither layers nor a sequence: the signature check names the problem
    for name, value in others:
        count = _layer_count(value, stacked_dims[name])
        if count is not None and count != num_layers:
            raise InputError(f"{name}: expected L={num_layers} layers ({weight_name} has {num_layers}), got {count}")


def _layer_count(value: object, stacked_dims: int) -> int | None:
    if isinstance(value, Tensor):
        # Another kind of tensor (sparse, nested: no sizes to read) is the signature check's to name.
        return int(value.shape[0]) if strided(value) and value.dim() == stacked_dims else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def eps_of_layers(eps: object, cos_sin_cache: object, norm_weight: object) -> object:
    """A sequence of per-layer numbers as an ``[L]`` float32 tensor on cos_sin_cache's device; else eps as is.

    Numbers out of range (NaN, negative, past float32's max) are rejected here, as at each call (`check_eps`:
    not without ``norm_weight``, except an int no float holds); a tensor's values in debug mode, at each call.
    """
    if not isinstance(eps, (list, tuple)):
        check_eps(eps, norm_weight)
        return eps
    check_numbers("eps", eps)
    check_eps(eps, norm_weight)
    device = cos_sin_cache.device if isinstance(cos_sin_cache, Tensor) else None
    return torch.tensor([float(x) for x in eps], dtype=torch.float32, device=device)


def check_layer_dtypes(arguments: Mapping[str, Tensor | Sequence[Tensor] | None], weight: str, bias: str) -> None:
    """The layers of each argument share one dtype, and the bias has the weight's."""
    for name, value in arguments.items():
        if isinstance(value, (list, tuple)) and value:
            for i, layer in enumerate(value):
                if layer.dtype != value[0].dtype:
                    raise InputError(
                        f"{name}[{i}]: expected dtype {fmt_dtype(value[0].dtype)} ({name}[0]'s), "
                        f"got {fmt_dtype(layer.dtype)}: the layers share one dtype"
                    )
    weights, biases = arguments[weight], arguments[bias]
    if weights is not None and biases is not None:
        weight_dtype, bias_dtype = _stacked_dtype(weights), _stacked_dtype(biases)
        if bias_dtype != weight_dtype:
            raise InputError(
                f"{bias}: expected dtype {fmt_dtype(weight_dtype)} ({weight}'s), got {fmt_dtype(bias_dtype)}: "
                f"convert it with {bias}.to(torch.{fmt_dtype(weight_dtype)})"
            )


def stacked(value: Tensor | Sequence[Tensor]) -> Tensor:
    """Per-layer tensors as one stacked tensor (a stacked tensor as it is), detached."""
    return value.detach() if isinstance(value, Tensor) else torch.stack([layer.detach() for layer in value])


def _stacked_dtype(value: Tensor | Sequence[Tensor]) -> torch.dtype:
    return value.dtype if isinstance(value, Tensor) else value[0].dtype


def keep_dtypes(module: torch.nn.Module, apply: Callable[[], torch.nn.Module], names: Sequence[str]) -> torch.nn.Module:
    """``module._apply(fn)`` (``apply``), the buffers ``names`` moved with it but never cast.

    ``.to(torch.bfloat16)`` or ``.half()`` of a draft model casts every floating-point
    buffer; a RoPE table or an eps rounded to bfloat16 would move K by a few ulps from
    the table the materializer was built with. Those keep their dtype: each is taken
    from before the cast, moved to the device the cast put it on.
    """
    buffers = module._buffers
    before = {name: tensor for name in names if (tensor := buffers.get(name)) is not None}
    result = apply()
    for name, tensor in before.items():
        after = buffers[name]
        if after is not None and after.dtype != tensor.dtype:
            buffers[name] = tensor.to(device=after.device)
    return result


def keep_layers(
    module: torch.nn.Module,
    names: tuple[str, str, str],
    weight: Tensor,
    bias: Tensor | Sequence[Tensor] | None,
    norm_weight: Tensor | Sequence[Tensor] | None,
    cos_sin_cache: Tensor,
    layer_eps: float | Tensor,
) -> None:
    """A materializer's checked weights as its buffers: ``names`` are its weight's, bias's and norm weight's.

    Every layer's rows become one ``nn.Linear`` weight ``[L*rows, hidden]``, so the GEMM's layer-major output is
    the kernel's input layout; the bias rows likewise; the norm weights stacked ``[L, width]``; the RoPE
    table as given; eps a buffer when it is a per-layer tensor, else a float attribute.
    """
    weight_name, bias_name, norm_name = names
    module.register_buffer(weight_name, weight.reshape(-1, weight.shape[-1]).contiguous(), persistent=False)
    module.register_buffer(bias_name, None if bias is None else stacked(bias).flatten(), persistent=False)
    module.register_buffer(norm_name, None if norm_weight is None else stacked(norm_weight), persistent=False)
    module.register_buffer("cos_sin_cache", cos_sin_cache.detach(), persistent=False)
    if isinstance(layer_eps, Tensor):
        module.register_buffer("eps", layer_eps.detach(), persistent=False)
    else:
        setattr(module, "eps", layer_eps)  # noqa: B010 (nn.Module types its attributes as tensors or modules)
