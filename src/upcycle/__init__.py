"""upcycle: turn a pretrained dense transformer into a sparse Mixture-of-Experts model.

    import upcycle
    result = upcycle.convert(upcycle.ConvertConfig(model="default", method="copy"), "out/smollm2-moe")
    model = upcycle.load("out/smollm2-moe")          # or AutoModelForCausalLM.from_pretrained, after import upcycle
    upcycle.save(model, "out/copy")                    # model.save_pretrained("out/copy") writes the same format
    upcycle.train(upcycle.TrainConfig(model="out/smollm2-moe", steps=40), "out/train-copy")

The names below load on first use, so that `import upcycle` (and the `upcycle` command's start) does not import
torch and transformers before they are needed.
"""

from importlib import import_module

from .checkpoint.auto_registration import install as _install_auto_classes
from .version import __version__

# transformers' AutoConfig / AutoModel / AutoModelForCausalLM read upcycle folders once this package is imported
# (checkpoint/auto_registration.py: at no cost until transformers' Auto classes are imported themselves)
_install_auto_classes()

_NAMES = {
    "ConvertConfig": "config", "MoEConfig": "config", "PlacementConfig": "config", "RegularizerConfig": "config",
    "TrainConfig": "config", "UpcycleError": "errors", "convert": "conversion.pipeline", "train": "training.trainer",
    "upcycle_model": "conversion.pipeline", "load": "checkpoint.save_load", "save": "checkpoint.save_load",
    "MoELayer": "core.moe",
    "RoutingRecord": "core.router", "METHODS": "methods",
}
__all__ = [*_NAMES, "__version__"]


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(import_module(f".{_NAMES[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
