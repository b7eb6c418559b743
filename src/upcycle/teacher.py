"""`upcycle.teacher`: the short name of `upcycle.train.teacher` (the same module object, not a copy)."""

import sys

from .train import teacher as _module

sys.modules[__name__] = _module
