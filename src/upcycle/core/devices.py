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
