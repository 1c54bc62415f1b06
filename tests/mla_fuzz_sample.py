"""A few MLA fuzz examples as a plain script: ``tests/test_mla_fuzz.py``'s property, for ``compute-sanitizer``.

Production mode first (positions and slots out of range reach the kernel, which must
neither read nor write out of bounds), then debug mode. Run from the repository root
on a CUDA machine::

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/mla_fuzz_sample.py --examples 30

It prints ``mla fuzz sample done`` at the end; memcheck adds ``ERROR SUMMARY: 0 errors``.
``tests/test_mla_gpu.py::test_mla_fuzz_sample_under_memcheck`` (``gpu``) runs it with 8 examples.
"""

from __future__ import annotations

import argparse
import sys

from hypothesis import given, settings
from test_mla_fuzz import FUZZ, Spec, check, specs

import typedkv


def sample(debug: bool, device: str, examples: int) -> None:
    """``examples`` drawn calls in one mode."""
    typedkv.set_debug(debug)

    @settings(FUZZ, max_examples=examples)
    @given(spec=specs(debug=debug))
    def run(spec: Spec) -> None:
        check(spec, debug, device)

    run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--examples", type=int, default=30, help="drawn calls per mode (default 30)")
    args = parser.parse_args(argv)
    for debug in (False, True):
        sample(debug, args.device, args.examples)
        print(f"MLA ops, {'debug' if debug else 'production'}: {args.examples} examples passed", flush=True)
    print("mla fuzz sample done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
