"""Which device types torch can autocast, read once at import, and autocast switched off around a region.

The MoE layer asks this on every forward (the router and the experts compute in dtypes they state, with autocast
off). torch.amp.is_autocast_available is a C function that torch 2.11's dynamo does not trace: under
torch.compile on CUDA each call broke the graph, and the layer compiled into 8 graphs instead of one
(benchmarks/results/gpu/h200-2026-11-28-contrastive/compile_explain.txt). A set membership test of a device type
string traces on every torch.
"""

from __future__ import annotations

import contextlib

import torch

_CANDIDATES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "privateuseone")


def _available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except (RuntimeError, ValueError):
        return False


AUTOCAST_DEVICE_TYPES = frozenset(t for t in _CANDIDATES if _available(t))


def autocast_available(device_type: str) -> bool:
    """Whether torch can autocast on this device type (read at import: traceable under torch.compile)."""
    return device_type in AUTOCAST_DEVICE_TYPES


def autocast_off(device_type: str):
    """A context with autocast off on this device type (nothing to switch off where torch cannot autocast)."""
    return torch.autocast(device_type, enabled=False) if autocast_available(device_type) \
        else contextlib.nullcontext()
