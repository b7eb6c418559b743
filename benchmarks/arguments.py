"""Argument checks the benchmark scripts share, so that a bad argument is one line from argparse (exit 2) before
any work, as the command line's are: a device torch has here, counts that are whole and positive, an output file
or folder that can be written where it is given (`output_file`, `output_folder`: argparse types; every benchmark's
--out, --work, --json and --results use one, which tests/test_benchmark_arguments.py checks)."""

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


def _blocked(path: Path) -> str | None:
    """Why `path` cannot be made: a file, or a link to nothing, on its way (the nearest existing folder above it
    must be a folder)."""
    for parent in path.parents:
        if parent.is_symlink() and not parent.exists():
            return f"{parent} is a link to nothing"
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, not a folder"
    return None


def output_file(text: str) -> Path:
    """argparse type of a file a benchmark writes (replacing a file there): not a folder or a link, and with
    nothing but folders on its way."""
    path = Path(text).expanduser()
    if path.is_symlink():
        raise argparse.ArgumentTypeError(f"{path} is a symbolic link; give the real location")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give the JSON file to write (for example "
                                         f"{path / 'result.json'})")
    why = _blocked(path)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{path} cannot be written: {why}")
    return path


def output_folder(text: str) -> Path:
    """argparse type of a folder a benchmark writes into (made when absent): not a file or a link, and with nothing
    but folders on its way. What may be in it is the benchmark's own rule (`work_folder.claim_work`)."""
    path = Path(text).expanduser()
    if path.is_symlink():
        raise argparse.ArgumentTypeError(f"{path} is a symbolic link; give the real location")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a folder")
    why = _blocked(path)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{path} cannot be made: {why}")
    return path
