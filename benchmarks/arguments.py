"""Argument checks the benchmark scripts share, so that a bad argument is one line from argparse (exit 2) before
any work, as the command line's are: a device torch has here, counts that are whole and positive, an output that
is a file path (not a folder)."""

from __future__ import annotations

import argparse
from pathlib import Path


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """A device this torch has: cpu, or cuda / cuda:N with a GPU that is there."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parser.error(f"--device {device!r} is not a device (cpu, cuda or cuda:N)")
    if parsed.type == "cuda" and (not torch.cuda.is_available()
                                  or (parsed.index or 0) >= torch.cuda.device_count()):
        parser.error(f"--device {device}: torch sees no such GPU here (this torch {torch.__version__}, "
                     f"{torch.cuda.device_count()} GPU(s)); use --device cpu")
    if parsed.type not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: the benchmarks run on cpu or cuda")


def check_positive(parser: argparse.ArgumentParser, **values) -> None:
    """Every value >= 1 (a list: each of its items), named by its flag."""
    for name, value in values.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is None or v < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def check_output_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """An output file path: not a folder or a link (the results are written there, replacing a file)."""
    if path.is_symlink():
        parser.error(f"--out {path} is a symbolic link; give the real location")
    if path.is_dir():
        parser.error(f"--out {path} is a folder; give the JSON file to write (for example {path / 'result.json'})")
