"""How a run stops early: a signal asks for a clean stop after the current step (Ctrl-C or SIGTERM; a second Ctrl-C
aborts), and `TrainingStopped` carries a reason the user must see (a non-finite loss or weights)."""

from __future__ import annotations

import signal

from ..config import TrainConfig
from ..errors import UpcycleError


class TrainingStopped(UpcycleError):
    """The run stopped before its end for a reason the user must see (non-finite loss, a second Ctrl-C); the
    message says what OUT holds now."""


class StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM asks the loop to stop after the current step; a second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def check_skip(cfg: TrainConfig, step: int, reason: str, skipped: int) -> None:
    """A step that did not update the weights (`reason`) stops the run unless on_nonfinite is skip and fewer
    than max_skipped_steps were skipped before (`skipped`)."""
    if cfg.on_nonfinite == "stop" or skipped >= cfg.max_skipped_steps:
        raise TrainingStopped(
            f"step {step + 1}: {reason}; training diverged and the run stopped without updating the weights"
            + ("" if cfg.on_nonfinite == "stop" else f" ({skipped} steps were already skipped)")
            + ". Lower the learning rate, or set on_nonfinite: skip to skip such steps")
