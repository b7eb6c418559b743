"""Auxiliary-loss-free balancing (docs/methods.md §4.5) under a short public name; it lives in
`upcycle.train.balance`."""

from .train.balance import AuxFreeBalancer

__all__ = ["AuxFreeBalancer"]
