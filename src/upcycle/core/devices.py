"""Where computation runs: the `device` setting ("auto", "cpu", "cuda", "cuda:N") as a torch device, checked
against what torch sees on this machine."""

from __future__ import annotations

import torch

from ..errors import UpcycleError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"


def resolve_device(setting: str) -> torch.device:
    """The device calibration, the methods' linear algebra and the checks run on: "auto" is the first GPU when
    torch sees one, else the CPU; a GPU that is not there is an error (not a silent CPU run)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except (RuntimeError, TypeError):
        raise UpcycleError(f"device must be one of {DEVICE_CHOICES}, got {setting!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UpcycleError(f"device must be one of {DEVICE_CHOICES}, got {setting!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UpcycleError(f"device {setting!r}: torch sees no CUDA GPU here (torch {torch.__version__}); use "
                               f"--device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UpcycleError(f"device {setting!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def pin_tensors(value):
    """`value` with every tensor in it page-locked (dicts and lists walked)."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, dict):
        return {k: pin_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [pin_tensors(v) for v in value]
    return value


def to_device(value, device: torch.device):
    """`value` with every tensor in it on `device` (dicts and lists walked); page-locked tensors are copied
    without waiting for the device."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=value.is_pinned())
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    return value
