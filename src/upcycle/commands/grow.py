"""`upcycle grow MODEL OUT --num-experts N`: every MoE layer gains copies of its experts (by utility, or each in
turn), each copy's router row its source's plus an offset that shares the source's calibration tokens out between
them, no logit shifted, so the router reaches every copy (`upcycle.resize`, `upcycle.core.router_split`)."""

from __future__ import annotations

import argparse

from . import prune


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prune.add_arguments(parser, grow=True)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    return prune.run(args, argv, grow=True)
