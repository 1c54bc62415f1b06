"""The ``typedkv`` command: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``typedkv`` and ``python -m typedkv``."""
    import typedkv

    parser = argparse.ArgumentParser(prog="typedkv", description="Fused, typed KV materialization.")
    parser.add_argument("--version", action="version", version=f"typedkv {typedkv.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo",
        help="materialize a small draft model's KV, check it, show a caught misuse, time it",
        description="Materialize a small draft model's KV on the best available device, check it against "
        "the unfused model path, show one caught misuse with its message, print the time.",
    )
    bench = commands.add_parser(
        "bench",
        help="benchmark against the copy roofline, PyTorch eager and torch.compile",
        description="Sweep T and real draft shapes; print a table, write bench.json and bench.png.",
    )
    bench.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out)")
    bench.add_argument(
        "--quick", action="store_true", help="only T <= 2048 (the end-to-end and real-drafts sections: T <= 256)"
    )
    bench.add_argument("--no-compare", action="store_true", help="skip the eager and torch.compile baselines")
    bench.add_argument("--only", default="", metavar="TEXT", help="only the cases whose name contains TEXT")
    bench.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        metavar="T",
        help="only these token counts (the per-case sweep and the real drafts, on a GPU)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from typedkv.tools.demo import main as demo

        return demo()
    from typedkv.tools.bench import main as run_bench

    return run_bench(args.out, quick=args.quick, compare=not args.no_compare, only=args.only, tokens=args.tokens)
