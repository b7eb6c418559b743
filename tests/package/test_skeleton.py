"""The conversion planned before any weight exists: the weightless MoE model built from each method's
declared layout has exactly the tensors (names, shapes, dtypes) the real conversion writes."""

from __future__ import annotations

import pytest
import torch
from test_calibration import batches_for

from conftest import make_tiny
from upcycle.checkpoint.skeleton import tensor_specs
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.conversion.planned import planned_model
from upcycle.methods import METHODS, get_method

VARIANTS = [(name, {}) for name in sorted(METHODS)] + [
    ("spri", {"shared_expert": False}), ("granular", {"granularity": 4}),
    ("cluster", {"pca_factor": 2, "router_bias": True}), ("cluster", {"pca_factor": 2})]


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("method, method_args", VARIANTS, ids=lambda v: str(v))
def test_the_planned_model_has_the_tensors_the_conversion_writes(family, method, method_args):
    moe = {"num_experts": 4, "top_k": 4 if method == "granular" else 2}
    cfg = build(ConvertConfig, {"method": method, "method_args": method_args, "moe": moe, "placement": {"every": 2},
                                "calibration": {"tokens": 200}})
    model = make_tiny(family)
    upcycle_model(model, cfg, calibration=batches_for(family), progress=False)
    m = get_method(method)
    args = m.resolve_args(method_args)
    planned, targets = planned_model(make_tiny(family).config, cfg.moe, cfg.placement,
                                     lambda dense: m.layout(dense.intermediate_size, args), dtype=torch.float32)
    assert len(targets) == 2 and all(p.is_meta for p in planned.parameters())
    assert tensor_specs(planned) == tensor_specs(model)
