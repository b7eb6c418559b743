"""Contract over every registered method: same seed, same bytes; a different seed changes what is random."""

from __future__ import annotations

import pytest
import torch
from test_calibration import batches_for

from conftest import make_tiny
from upcycle.config import ConvertConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.moe import moe_layers
from upcycle.methods import METHODS

# methods whose experts are a deterministic function of the dense FFN (only the router is drawn)
DETERMINISTIC_EXPERTS = {"copy", "granular"}


def converted(method: str, seed: int) -> dict[str, torch.Tensor]:
    model = make_tiny("llama")
    args = {"top_k": 4} if method == "granular" else {}     # granular scales top-k by its G (2 by default)
    cfg = build(ConvertConfig, {"method": method, "seed": seed, "moe": {"num_experts": 4, "top_k": 2, **args},
                                "placement": {"every": 2}, "calibration": {"tokens": 200}})
    upcycle_model(model, cfg, calibration=batches_for("llama"), progress=False)
    return {f"{name}.{k}": v.clone() for name, layer in moe_layers(model).items()
            for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_seed_same_bytes_and_seeds_matter(method):
    a, b, c = converted(method, 0), converted(method, 0), converted(method, 1)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    experts = [k for k in a if ".experts." in k]
    routers = [k for k in a if "router.weight" in k]
    assert all(not torch.equal(a[k], c[k]) for k in routers), "the router must depend on the seed"
    if method in DETERMINISTIC_EXPERTS:
        assert all(torch.equal(a[k], c[k]) for k in experts)
    else:
        assert any(not torch.equal(a[k], c[k]) for k in experts), f"{method}: experts ignore the seed"
