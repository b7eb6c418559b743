"""`upcycle methods`: the upcycling methods, their papers and their arguments with defaults."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from ..methods import METHODS

    for method in METHODS.values():
        print(f"{method.name}: {method.summary}")
        print(f"    paper: {method.paper}")
        print(f"    needs calibration data: {'yes' if method.needs_calibration else 'no'}")
        print("    as delta experts (moe.experts: delta): "
              + ("yes, the dense FFN plus each expert's change" if method.no_deltas is None
                 else f"no: {method.no_deltas}"))
        for arg in method.args.values():
            print(f"    --set method_args.{arg.name}={arg.describe()}   (default {arg.default!r})")
    return 0
