"""The Router module: softmax and sigmoid (DeepSeek-V3) scores, the selection bias, route scale,
exact copy preservation where it holds, export only where a stock class computes it, and old checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import make_tiny
from upcycle import ConvertConfig, MoEConfig, convert
from upcycle.core.expert_shape import ExpertShape
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.core.router import Router
from upcycle.errors import UpcycleError
from upcycle.training.loss.losses import load_balance


def _copies(E: int = 4, seed: int = 0) -> tuple[FFNWeights, FFNWeights]:
    """(one dense SwiGLU FFN, E identical copies of it)."""
    g = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(1, 48, 32, generator=g) * 0.2, torch.randn(1, 48, 32, generator=g) * 0.2,
                      torch.randn(1, 32, 48, generator=g) * 0.2)
    dense = FFNWeights(w_gate=gate, w_up=up, w_down=down, activation="silu")
    experts = FFNWeights(w_gate=gate.expand(E, -1, -1).clone(), w_up=up.expand(E, -1, -1).clone(),
                         w_down=down.expand(E, -1, -1).clone(), activation="silu")
    return dense, experts


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_identical_experts_with_normalized_top_k_compute_the_dense_ffn(score):
    dense, experts = _copies()
    router = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    layer = MoELayer.from_init(experts, router, top_k=2, score=score).eval()
    one = MoELayer.from_init(dense, torch.zeros(1, 32), top_k=1).eval()    # the dense FFN as a 1-expert layer
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), one(x), rtol=0, atol=1e-6)        # weights sum to 1 up to rounding
    # a route scale scales the routed output exactly by itself
    scaled = MoELayer.from_init(experts, router, top_k=2, score=score, route_scale=2.5).eval()
    torch.testing.assert_close(scaled(x), 2.5 * one(x), rtol=0, atol=1e-5)


def test_sigmoid_weights_are_normalized_scores_of_the_biased_selection():
    router = Router(8, MoEConfig(num_experts=4, top_k=2, score="sigmoid", route_scale=1.5))
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.tensor([0.0, 0.3, 0.0, -0.3])
    record = router.route(x, bias)
    s = torch.sigmoid(x @ router.weight.t())
    ids = (s + bias).topk(2, dim=-1).indices
    assert torch.equal(record.topk_ids_TK, ids)
    chosen = s.gather(-1, ids)
    torch.testing.assert_close(record.topk_weights_TK, 1.5 * chosen / chosen.sum(-1, keepdim=True))
    # the losses' probabilities: normalized affinities s / sum s (DeepSeek-V3's balance loss)
    torch.testing.assert_close(record.probs_TE, s / s.sum(-1, keepdim=True))
    # load balance on a sigmoid record reads those probabilities, not softmax(z)
    expected = load_balance((s / s.sum(-1, keepdim=True)).log(), ids)
    torch.testing.assert_close(load_balance(record.balance_logits_TE, ids), expected)


def test_softmax_record_is_unchanged_by_the_router_module():
    router = Router(8, MoEConfig(num_experts=4, top_k=2))
    x = torch.randn(10, 8)
    record = router.route(x, torch.zeros(4))
    p = torch.softmax(x @ router.weight.t(), -1)
    torch.testing.assert_close(record.probs_TE, p)
    assert torch.equal(record.balance_logits_TE, record.logits_TE)
    w, ids = p.topk(2, -1)
    assert torch.equal(record.topk_ids_TK, ids)
    torch.testing.assert_close(record.topk_weights_TK, w / w.sum(-1, keepdim=True))


def test_the_layer_config_refuses_what_no_router_computes():
    """One place validates the routing options: MoEConfig, before any layer exists (from a recipe, the CLI, or
    Python); the layer, the router, the saved spec and the converter all take that object."""
    for options, message in (({"score": "sigmoid", "normalize_topk": False}, "normalize_topk must be true"),
                             ({"score": "relu"}, "score must be one of"), ({"route_scale": 0.0}, "route_scale"),
                             ({"top_k": 9}, "top_k must be between"), ({"capacity_factor_eval": -1.0},
                              r"capacity_factor_eval must be a finite number in \(0, inf\)"),
                             ({"num_experts": 0}, "num_experts must be >= 1")):
        with pytest.raises(UpcycleError, match=message):
            MoEConfig(**options)


def test_the_layer_keeps_one_config_through_its_spec():
    config = MoEConfig(num_experts=4, top_k=1, score="sigmoid", route_scale=2.0, capacity_factor_train=1.5)
    layer = MoELayer(ExpertShape(hidden_size=8, intermediate_size=16, activation="silu", gated=True), config)
    assert layer.config is config and layer.router.config is config
    rebuilt = MoELayer.from_spec(layer.spec())
    assert rebuilt.config == config and rebuilt.spec() == layer.spec()
    with pytest.raises(TypeError, match="MoELayer: .*unexpected keyword argument 'top_kk'"):
        MoELayer.from_spec({**layer.spec(), "top_kk": 2})


def _tiny_folder(tmp_path):
    folder = tmp_path / "llama"
    make_tiny("llama").save_pretrained(folder)
    return folder


def test_sigmoid_copy_conversion_preserves_and_round_trips(tmp_path):
    import upcycle

    folder = _tiny_folder(tmp_path)
    cfg = ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=4, top_k=2, score="sigmoid"))
    result = convert(cfg, tmp_path / "moe", progress=False)
    report = result.report.to_dict()
    assert report["preservation"]["promised"] and report["preservation"]["passed"]
    spec = json.loads((tmp_path / "moe" / "upcycle_config.json").read_text())
    assert {layer["score"] for layer in spec["layers"]} == {"sigmoid"}
    loaded = upcycle.load(tmp_path / "moe")
    ids = torch.randint(0, 128, (2, 12))
    assert torch.equal(loaded(input_ids=ids).logits, result.model(input_ids=ids).logits)
    # a route scale breaks the promise: reported as drift, not refused
    scaled = convert(ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=4, top_k=2, route_scale=2.0)),
                     None, progress=False).report.to_dict()
    assert not scaled["preservation"]["promised"] and scaled["max_abs_logit_diff"] > 1e-3


def test_sigmoid_routing_is_not_exported_to_softmax_classes(tmp_path):
    folder = _tiny_folder(tmp_path)
    cfg = ConvertConfig(model=str(folder), moe=MoEConfig(num_experts=4, top_k=2, score="sigmoid"), export="hf",
                        export_class="qwen2_moe")
    with pytest.raises(UpcycleError, match="sigmoid routing"):
        convert(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UpcycleError, match="normalize_topk must"):
        convert(ConvertConfig(model=str(folder), moe=MoEConfig(score="sigmoid", normalize_topk=False)), None,
                progress=False)


def test_a_checkpoint_without_router_keys_still_loads(tiny_lm, tmp_path):
    """upcycle_config.json files written before the Router module have no score / route_scale: softmax, 1."""
    import shutil

    import upcycle

    old = tmp_path / "old"
    shutil.copytree(tiny_lm[1], old)
    spec_file = old / "upcycle_config.json"
    spec = json.loads(spec_file.read_text())
    for layer in spec["layers"]:
        layer.pop("score", None)
        layer.pop("route_scale", None)
    spec_file.write_text(json.dumps(spec))
    from upcycle.core.moe import moe_layers

    model = upcycle.load(old)
    layers = moe_layers(model)
    assert layers and all(layer.router.score == "softmax" and layer.router.route_scale == 1.0
                          for layer in layers.values())
    ids = torch.randint(0, 20, (2, 8))
    assert torch.equal(model(input_ids=ids).logits, upcycle.load(tiny_lm[1])(input_ids=ids).logits)


@pytest.mark.parametrize("bias", [False, True])
def test_the_router_is_not_an_nn_linear_yet_initializes_and_saves_as_one(bias):
    """Adapters that wrap every nn.Linear (peft's all-linear) must leave the router alone, so it is a module of its
    own; its state dict names and its seeded initial weights are an nn.Linear's, draw for draw."""
    torch.manual_seed(3)
    router = Router(16, MoEConfig(num_experts=4, top_k=2), bias=bias)
    torch.manual_seed(3)
    linear = nn.Linear(16, 4, bias=bias)
    assert not isinstance(router, nn.Linear)
    assert router.state_dict().keys() == linear.state_dict().keys()
    for name, tensor in linear.state_dict().items():
        assert torch.equal(router.state_dict()[name], tensor) and router.state_dict()[name].dtype == torch.float32
