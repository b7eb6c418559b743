"""The memory a piece of work holds on a device, followed tensor by tensor: what the memory plan measures
(`memory_simulation`, on fake tensors) and what it is checked against (`measure_peak`, on real ones).

  cuda  torch.cuda.max_memory_allocated over the work: the caching allocator's count of live tensor bytes (what it
        keeps cached but unused is not counted)
  cpu   `LiveTensors`: every storage an operation creates, from its creation until Python releases it (a weak
        reference to the storage, whose Python object lives exactly as long as the storage), and every
        `UntypedStorage.resize_` (FSDP2 frees and refills its gathered weights that way), on the thread that runs
        the work. Collective libraries' own buffers (gloo's) are not tensors and are not counted.

Either way the figure is the most bytes live at once during the work, beyond what existed when it started
(`ignore`d tensors and anything made before are not counted: build the model inside the work to count it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..parallel.sharding import is_dtensor

KINDS = ("other", "grads", "optimizer", "teacher")


@dataclass
class Timeline:
    """The bytes live, by kind, after every change (`samples`: the KINDS' bytes and the phase it fell in)."""

    samples: list[tuple[int, int, int, int, str]] = field(default_factory=list)
    phase: str = "set-up"
    kind: str = "other"           # what a new storage counts as (the optimizer step's temporaries: "optimizer")

    def peak(self, scale: dict[str, float] | None = None) -> tuple[int, dict[str, int], str]:
        """The most bytes live at once with each kind multiplied by `scale` (one process's share of a sharded
        kind), the kinds' bytes then, and the phase it fell in."""
        factors = [(scale or {}).get(kind, 1.0) for kind in KINDS]
        best, at = -1.0, (0, 0, 0, 0, self.phase)
        for sample in self.samples:
            total = sum(f * v for f, v in zip(factors, sample[:4], strict=True))
            if total > best:
                best, at = total, sample
        kinds = {kind: int(f * v) for kind, f, v in zip(KINDS, factors, at[:4], strict=True)}
        return int(max(best, 0)), kinds, at[4]


class LiveTensors(TorchDispatchMode):
    """Counts each storage the work's operations create until it is released (module docstring), by kind."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline
        self.live = dict.fromkeys(KINDS, 0)
        self.entries: dict[int, list] = {}        # id(storage) -> [kind, bytes]
        self.fixed: set[int] = set()              # storages that existed before (`ignore`)
        self._resize = None

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _aliases(func):          # a view, or an in-place or out= operation: its output is an input's storage
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):     # a DTensor's memory is its local tensor's
                self.add(t.to_local() if is_dtensor(t) else t)
        return out

    def ignore(self, tensors) -> None:
        """Storages that exist before the work and are counted elsewhere (a model's parameters and buffers): an
        in-place update of one returns it, and it must not count as new."""
        self.fixed |= {id(t.untyped_storage()) for t in tensors}

    def add(self, t: torch.Tensor, kind: str | None = None) -> None:
        kind = kind or self.timeline.kind
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.entries or key in self.fixed:
            return
        entry = [kind, storage.nbytes()]
        self.entries[key] = entry
        self.live[kind] += entry[1]
        weakref.finalize(storage, self._release, key)
        self._sample()

    def move(self, t: torch.Tensor | None, kind: str) -> None:
        """Count `t`'s storage as `kind` from now on."""
        if t is None:
            return
        entry = self.entries.get(id(t.untyped_storage()))
        if entry is None:
            self.add(t, kind)
        elif entry[0] != kind:
            self.live[entry[0]] -= entry[1]
            self.live[kind] += entry[1]
            entry[0] = kind

    def _resized(self, storage) -> None:
        entry = self.entries.get(id(storage))
        if entry is None:
            return
        self.live[entry[0]] += storage.nbytes() - entry[1]
        entry[1] = storage.nbytes()
        self._sample()

    def _release(self, key: int) -> None:
        kind, nbytes = self.entries.pop(key)
        self.live[kind] -= nbytes
        self._sample()

    def _sample(self) -> None:
        self.timeline.samples.append((*(self.live[k] for k in KINDS), self.timeline.phase))


def _aliases(func) -> bool:
    """Whether an operator's outputs alias its inputs (its schema marks them so)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


@dataclass
class Measured:
    result: Any
    peak_bytes: int             # the most bytes live at once during the work, beyond what existed before
    start_bytes: int | None = None   # what existed before, where the device counts it (CUDA); None on the CPU


def measure_peak(work: Callable[[], Any], device: torch.device | str = "cpu") -> Measured:
    """Run `work()` and measure the peak of the memory it holds on `device` (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = work()
        torch.cuda.synchronize(device)
        return Measured(result, torch.cuda.max_memory_allocated(device) - start, start)
    if device.type != "cpu":
        raise ValueError(f"peak memory is measured on the CPU and CUDA, not {device.type}")
    timeline = Timeline()
    with LiveTensors(timeline):
        result = work()
    return Measured(result, timeline.peak()[0])


@contextlib.contextmanager
def tracking(timeline: Timeline) -> Iterator[LiveTensors]:
    with LiveTensors(timeline) as tracker:
        yield tracker
