"""Objects that watch a model through forward hooks (the routing of a stock model, the aux-loss-free balancer's
load counts, the EMA teacher's targets) register them into `_handles` and are let go with one `remove()`."""

from __future__ import annotations

from torch.utils.hooks import RemovableHandle


class HookHolder:
    """Owns the forward hooks in `_handles`; `remove()` takes every one off its module (again: a no-op)."""

    _handles: list[RemovableHandle]

    def remove(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []
