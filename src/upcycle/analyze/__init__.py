"""`upcycle analyze`: load a target (model, exported model or training run), run it on named data sources and
write every docs/methods.md §5 metric as analysis.json, figures and report.html. The numbers come from
`upcycle.metrics` (pure functions of tensors); this package only loads, runs and writes."""
