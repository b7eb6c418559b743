"""Random streams named by what they are for: one generator per (seed, purpose, ...) key, so that what one layer,
source or sample draws depends on the run's seed and its own key only, never on what was drawn before it.

    keyed_generator(seed, tower, index)                       a layer's initialization
    keyed_generator("calibration", seed, tower, index)        a layer's calibration sample
    keyed_generator(seed, "source", i, tower, index)          a merge source's experts at a layer
    keyed_generator(seed, "reservoir", i, group, layer)       a merge source's text sample at a layer

The key is the parts joined by ":" and hashed with CRC-32 (stable across Python runs and machines, unlike hash()).
"""

from __future__ import annotations

import zlib

import torch


def keyed_generator(*parts) -> torch.Generator:
    """A CPU generator seeded by the CRC-32 of `parts` joined by ":"."""
    return torch.Generator().manual_seed(zlib.crc32(":".join(str(p) for p in parts).encode()))
