"""`upcycle.balance`: the short name of `upcycle.train.balance` (the same module object, not a copy)."""

import sys

from .train import balance as _module

sys.modules[__name__] = _module
