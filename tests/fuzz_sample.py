"""A few fuzz examples as a plain script: ``tests/test_fuzz.py``'s property, for ``compute-sanitizer``.

Hypothesis draws calls of each op (derandomized: the same calls every run) and
`test_fuzz.check` runs them: the result matches the float64 oracle, or the call is
rejected naming the culprit and writes nothing, and no byte around an output or
pool changes. Production mode first: out-of-range positions and slots reach the
kernel, which must neither read nor write out of bounds; then debug mode. With
memcheck watching, an access out of bounds that lands in no guarded byte is seen too.

Run from the repository root on a CUDA machine::

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/fuzz_sample.py --device cuda --examples 30

It prints ``fuzz sample done`` at the end; memcheck adds ``ERROR SUMMARY: 0 errors``.
Without ``compute-sanitizer`` it is a quick smoke run (``--device cpu`` runs the
reference path, or the kernel under ``TRITON_INTERPRET=1``).
``tests/test_fuzz.py::test_fuzz_sample_under_memcheck`` (``gpu``) runs it with 8 examples.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from hypothesis import given, settings
from test_fuzz import CPU_TOKENS, FUZZ, GPU_TOKENS, Spec, check, specs

import typedkv


def sample(device: torch.device, examples: int, *, pool: bool, debug: bool) -> None:
    """``examples`` drawn calls of one op in one mode."""
    typedkv.set_debug(debug)
    tokens = GPU_TOKENS if device.type == "cuda" else CPU_TOKENS

    @settings(FUZZ, max_examples=examples)
    @given(spec=specs(pool=pool, max_tokens=tokens))
    def run(spec: Spec) -> None:
        check(spec, device)

    run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--examples", type=int, default=30, help="drawn calls per op and mode (default 30)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    start = time.perf_counter()
    for debug in (False, True):
        for pool in (False, True):
            sample(device, args.examples, pool=pool, debug=debug)
            op = "materialize_kv_into_pool" if pool else "materialize_kv"
            print(f"{op}, {'debug' if debug else 'production'}: {args.examples} examples passed", flush=True)
    print(f"fuzz sample done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
