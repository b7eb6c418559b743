"""`upcycle grow MODEL OUT --num-experts N`: every MoE layer gains copies of its experts (by utility, or each in
turn), each copy's router row its source's and every copied expert's logits shifted by -log n, so that its n copies
share the probability it had (`upcycle.resize`)."""

from __future__ import annotations

import argparse

from . import prune


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prune.add_arguments(parser, grow=True)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    return prune.run(args, argv, grow=True)
