"""A training step's batches made ahead: on the host, in a worker thread, while the device runs the step before.

Each step's micro-batches are cut from the global batch (`step.micro_batches`), laid out by the task for the
device (the contrastive task's length-bucketed chunks; page-locked on a GPU, so the copy in the step does not
wait), one step ahead of the loop. What a step trains on is still a function of (seed, step) alone: the worker
computes the very batch the loop would, only earlier, and an error in making it (a batch without a negative pair)
is raised when the loop asks for that step.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BatchesAhead:
    """`get(step)` returns `make(step)`, made in a worker thread while the step before ran; `end` bounds what is
    made ahead. Use as a context manager (the worker stops on leaving)."""

    def __init__(self, make: Callable[[int], object], end: int) -> None:
        self.make, self.end = make, end
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upcycle-batches")
        self.pending: dict[int, Future] = {}

    def get(self, step: int):
        future = self.pending.pop(step, None)
        self.pending.clear()            # a step asked out of turn: whatever was made ahead is not it
        value = future.result() if future is not None else self.make(step)
        if step + 1 < self.end:
            self.pending[step + 1] = self.pool.submit(self.make, step + 1)
        return value

    def __enter__(self) -> BatchesAhead:
        return self

    def __exit__(self, *exc) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
