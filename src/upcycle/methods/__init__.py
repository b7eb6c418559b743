"""Upcycling initializations, one registered method per file (mergekit style); the registry and the method
contract are in `registry.py`. Importing this package registers every method.
"""

from ..config import OneOf, Range
from . import cluster, copy, drop, drop_svd, granular, noise, spri  # noqa: E402,F401  (registers the methods)
from .registry import (
    COMMON_ARGS,
    METHODS,
    ExpertInit,
    LayerInputs,
    LayerLayout,
    Method,
    MethodArg,
    get_method,
    random_router,
    register,
)

__all__ = ["COMMON_ARGS", "METHODS", "ExpertInit", "LayerInputs", "LayerLayout", "Method", "MethodArg", "OneOf",
           "Range", "get_method", "random_router", "register"]
