"""Analysis of upcycled MoE layers: metrics as plain numbers (docs/methods.md §5), then figures and an HTML report.

    from upcycle.analysis import layer_metrics
    layer_metrics(layer, x_TD)          # every §5 metric of one MoE layer on its input tokens, a plain dict

metrics.py, similarity.py, routing.py, compactness.py, specialization.py: the numbers (torch only);
layer.py: all of them for one layer; figures.py and html_report.py: pictures and a page from those dicts.
"""

from .layer import layer_metrics

__all__ = ["layer_metrics"]     # the notebook entry point: upcycle.analysis.layer_metrics
