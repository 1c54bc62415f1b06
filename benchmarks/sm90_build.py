"""What the scripts that compile kernels for sm_90 without a GPU share (gluon_probe.py --compile,
gluon_ws_compile.py, small_t_probe.py --compile): a compiled kernel written out, and its registers.

Not part of the package; imported by those scripts (run as ``python benchmarks/NAME.py``, this
directory first on the path).
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any, NamedTuple

import triton


class Built(NamedTuple):
    """A compiled kernel's TTGIR and PTX, and its registers, local and stack bytes as cuobjdump reads them.

    ptxas's spills show in the stack frame (``STACK``), not in ``LOCAL``: a kernel with ``local 0``
    can still spill (the warp-specialised kernel built with its norm weights' and cos/sin rows' column
    strides as arguments: 456 bytes a thread; as Triton's launch builds it, with those strides 1 as
    constants, none).
    """

    ttgir: str
    ptx: str
    regs: str  # "?" where cuobjdump printed none
    local: str
    stack: str


def dump(kernel: Any, folder: str, name: str) -> Built:
    """``kernel`` (`triton.compile`'s result)'s TTGIR, PTX and cubin written under ``folder`` as ``name.*``."""
    ttgir, ptx = str(kernel.asm["ttgir"]), str(kernel.asm["ptx"])
    os.makedirs(folder, exist_ok=True)
    for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
        with open(os.path.join(folder, f"{name}.{ext}"), "w") as f:
            f.write(text)
    cubin = os.path.join(folder, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    found = [re.search(rf"{key}:(\d+)", usage) for key in ("REG", "LOCAL", "STACK")]
    reg, local, stack = (m.group(1) if m else "?" for m in found)
    return Built(ttgir, ptx, reg, local, stack)
