"""`upcycle.losses`: the short name of `upcycle.train.losses` (the same module object, not a copy)."""

import sys

from .train import losses as _module

sys.modules[__name__] = _module
