"""The EMA teacher of Expert-Ensemble Self-Distillation (docs/methods.md §4.6) under a short public name; it lives
in `upcycle.train.teacher`."""

from .train.teacher import EMATeacher, ensemble_output

__all__ = ["EMATeacher", "ensemble_output"]
