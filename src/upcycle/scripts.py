"""What upcycle's own scripts (`benchmarks/`) share, importable wherever upcycle is installed (no script edits
`sys.path`): argument checks that make a bad argument one line from argparse (exit 2) before any work, as the
command line's are, and a script's scratch folder under the command line's rules for outputs.

  check_device, check_positive   a device torch has here; counts that are whole and positive
  output_file, output_folder     argparse types of an output that can be written where it is given (every
                                 benchmark's --out, --work, --json and --results use one; a test checks)
  perturbed_copy                 a stand-in for a fine-tune: a checkpoint with seeded noise on its FFN weights
  claim_work, note, clear        a benchmark's scratch folder (`upcycle.outputs.ownership`): a benchmark makes it,
                                 or takes an empty one or one it made before (its record, kind "benchmark-work",
                                 proves it), never one that holds anything it did not write, and removes only what
                                 its record lists, the folder itself only when it made it

The machine a result was measured on is `upcycle.machine.machine`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy

from .outputs.ownership import files_below, kind_of, read_record, record, remove_owned, why_not_own
from .outputs.ownership import write_marker as _write_record

__all__ = ["check_device", "check_positive", "claim_work", "clear", "note", "output_file", "output_folder",
           "perturbed_copy"]


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
    but folders on its way. What may be in it is the benchmark's own rule (`claim_work`)."""
    path = Path(text).expanduser()
    if path.is_symlink():
        raise argparse.ArgumentTypeError(f"{path} is a symbolic link; give the real location")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a folder")
    why = _blocked(path)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{path} cannot be made: {why}")
    return path


KIND = "benchmark-work"


def claim_work(path: Path) -> Path:
    """`path` made (with parents) and recorded as a benchmark's; an existing one only when it is empty or a
    benchmark's holding nothing else. Anything else ends the script with one line, before any work."""
    path = Path(path)
    if path.is_symlink():
        sys.exit(f"{path} is a symbolic link; give the real location (a benchmark never writes through a link)")
    if path.exists() and not path.is_dir():
        sys.exit(f"{path} exists and is not a folder; give a folder for the benchmark's scratch files")
    if path.is_dir() and any(path.iterdir()):
        if read_record(path) is None or kind_of(path) != KIND:
            sys.exit(f"{path} holds files a benchmark did not make (no record of a benchmark's there), and the "
                     f"benchmark deletes what is in its folder; give a new or empty folder")
        from .outputs.ownership import foreign_files

        if foreign_files(path):
            sys.exit(f"{path} holds files a benchmark did not make: {why_not_own(path)}; give a new or empty "
                     f"folder, or move them away")
        return path
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    _write_record(path, KIND, files=(), made=made)
    return path


def note(*paths: Path) -> None:
    """Record what the benchmark just wrote: each path and, for a folder, everything in it (what a tool other than
    upcycle wrote, say), in the record of the nearest folder above it that has one (the claimed work folder, or an
    upcycle output inside it that the benchmark adds a file to), so that `clear` may remove it."""
    for path in map(Path, paths):
        owner = next((p for p in path.parents if read_record(p) is not None), None)
        if owner is None:
            raise RuntimeError(f"{path} is in no folder upcycle or a benchmark recorded")    # a bug in the script
        rel = path.relative_to(owner).as_posix()
        record(owner, files_below(owner, rel) if path.is_dir() and not path.is_symlink() else [rel])


def clear(path: Path, work: Path) -> None:
    """Remove what of `path` (the claimed `work` folder itself, or something inside it) the benchmark recorded
    writing; anything else there stays, and is named."""
    path, work = Path(path), Path(work)
    if work.is_symlink() or read_record(work) is None or kind_of(work) != KIND:
        raise RuntimeError(f"{work} is not a claimed benchmark folder")          # a bug in the script: say so
    if path != work and work.resolve() not in path.resolve().parents:
        raise RuntimeError(f"{path} is outside the benchmark's folder {work}")
    if not path.exists() and not path.is_symlink():
        return
    if path == work:
        left = remove_owned(work)
    else:
        rel = path.relative_to(work).as_posix()
        inside = [rel, *(f"{rel}/{p.relative_to(path).as_posix()}" for p in path.rglob("*"))] if path.is_dir() \
            and not path.is_symlink() else [rel]
        left = remove_owned(work, inside)
    if left:
        print(f"[benchmark] {path}: kept what the benchmark did not write ({', '.join(left[:5])})", file=sys.stderr)


def perturbed_copy(base: Path, folder: Path, seed: int, tensors: dict | None = None) -> None:
    """A stand-in for a fine-tune of `base` in `folder`: its config and tokenizer files, and its weights with
    N(0, 0.002²) added to every FFN tensor (seeded), so that the experts differ as fine-tunes' do."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(base / "model.safetensors")) if tensors is None else tensors
    folder.mkdir(parents=True, exist_ok=True)
    rng = numpy.random.default_rng(seed)
    changed = {k: (v + rng.normal(0, 0.002, v.shape).astype(v.dtype)) if ".mlp." in k else v
               for k, v in tensors.items()}
    save_file(changed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():         # a merge refuses a source whose tokenizer it cannot check
            shutil.copy(base / name, folder / name)
