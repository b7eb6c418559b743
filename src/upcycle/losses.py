"""The router losses of docs/methods.md §4, under a short public name (`upcycle.losses.load_balance`, ...); they
live in `upcycle.train.losses` and `upcycle.train.dpsl`."""

from .train.dpsl import dpsl
from .train.losses import eesd, limoe_global, limoe_local, load_balance, z_loss

__all__ = ["dpsl", "eesd", "limoe_global", "limoe_local", "load_balance", "z_loss"]
