"""upcycle: turn a pretrained dense transformer into a sparse Mixture-of-Experts model.

    import upcycle
    result = upcycle.convert(upcycle.ConvertConfig(model="default", method="copy"), "out/smollm2-moe")
    model = upcycle.load("out/smollm2-moe")
    from upcycle.train.trainer import train
    train(upcycle.TrainConfig(model="out/smollm2-moe", steps=40), "out/train-copy")
"""

from .config import ConvertConfig, MoEConfig, PlacementConfig, RegularizerConfig, TrainConfig  # noqa: E402
from .conversion.converter import convert, upcycle_model  # noqa: E402
from .conversion.io import load  # noqa: E402
from .core.moe import MoELayer, RoutingRecord  # noqa: E402
from .errors import UpcycleError  # noqa: E402
from .methods import METHODS  # noqa: E402
from .train import balance, losses, teacher  # noqa: E402  (short names: upcycle.losses.*)
from .version import __version__  # noqa: E402

__all__ = ["ConvertConfig", "MoEConfig", "PlacementConfig", "RegularizerConfig", "TrainConfig", "convert",
           "upcycle_model",
           "UpcycleError", "load", "METHODS", "MoELayer", "RoutingRecord", "balance", "losses", "teacher",
           "__version__"]
