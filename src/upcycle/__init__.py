"""upcycle: turn a pretrained dense transformer into a sparse Mixture-of-Experts model.

    import upcycle
    result = upcycle.convert(upcycle.ConvertConfig(model="default", method="copy"), "out/smollm2-moe")
    model = upcycle.load("out/smollm2-moe")
    from upcycle.train.trainer import train
    train(upcycle.TrainConfig(model="out/smollm2-moe", steps=40), "out/train-copy")
"""

import sys as _sys

from .config import ConvertConfig, MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig  # noqa: E402
from .conversion.converter import convert, upcycle_model  # noqa: E402
from .conversion.io import load  # noqa: E402
from .core.moe import MoELayer, RoutingRecord  # noqa: E402
from .errors import UpcycleError  # noqa: E402
from .methods import METHODS  # noqa: E402
from .train import balance, losses, teacher  # noqa: E402  (short names: upcycle.losses.*)
from .version import __version__  # noqa: E402

# The short names are also importable (`import upcycle.losses`, `from upcycle.losses import dpsl`), not only
# attributes: registered as aliases of the modules, so both spellings give the same module objects.
for _name, _module in (("balance", balance), ("losses", losses), ("teacher", teacher)):
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module

__all__ = ["ConvertConfig", "MoEConfig", "PlacementConfig", "RegularizerConfig", "TrainConfig", "convert",
           "upcycle_model",
           "UpcycleError", "load", "METHODS", "MoELayer", "RoutingRecord", "balance", "losses", "teacher",
           "__version__"]
