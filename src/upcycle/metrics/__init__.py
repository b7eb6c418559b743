"""What an upcycled MoE layer's experts and router do, as plain numbers (docs/methods.md §5; torch only, no I/O):

    from upcycle.metrics import layer_metrics
    layer_metrics(layer, x_TD)          # every §5 metric of one MoE layer on its input tokens, a plain dict

experts.py (expert similarity, diversity), similarity.py (per-projection weight and output cosines), routing.py,
compactness.py, specialization.py; layer.py: all of them for one layer. Their pictures are `upcycle.figures`'.
"""

from .layer import TokenSources, layer_metrics

__all__ = ["TokenSources", "layer_metrics"]     # the notebook entry point: upcycle.metrics.layer_metrics
