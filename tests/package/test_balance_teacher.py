"""Aux-loss-free balancing (docs/methods.md §4.5), the EESD EMA teacher (§4.6), and the train_step composition."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import make_tiny
from upcycle.config import ConvertConfig, RegularizerConfig
from upcycle.config_reader import build
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.training.loss.balance import AuxFreeBalancer
from upcycle.training.loss.objective import Objective, router_losses
from upcycle.training.loss.teacher import EMATeacher, ensemble_output
from upcycle.training.step import train_step

D, F, E = 16, 32, 8


def layer(top_k=2, seed=0, skew=0.0, shared=False) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    experts = FFNWeights(w_up=torch.randn(E, F, D, generator=g) * 0.3, w_gate=torch.randn(E, F, D, generator=g) * 0.3,
                         w_down=torch.randn(E, D, F, generator=g) * 0.3, activation="silu")
    router = torch.randn(E, D, generator=g) * 0.1
    router[0] += skew                         # x has a positive mean: expert 0 wins most tokens
    shared_ffn = experts.expert(0).repeat(1) if shared else None
    return MoELayer.from_init(experts, router, top_k=top_k, shared=shared_ffn)


def inputs(T=512, seed=1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed)) + 0.5


def cov(counts: torch.Tensor) -> float:
    return float(counts.std(unbiased=False) / counts.mean())


def test_aux_free_bias_balances_a_skewed_router_without_touching_combine_weights():
    moe, x = layer(skew=0.15), inputs()
    model = nn.Sequential(moe).train()
    balancer = AuxFreeBalancer(model, rate=1e-3)
    covs = []
    for _ in range(300):
        model(x)
        covs.append(cov(balancer.counts["0"].clone()))
        balancer.step()
    assert covs[0] > 0.5 and covs[-1] < covs[0] / 4, (covs[0], covs[-1])
    assert moe.selection_bias[0] < 0 and moe.selection_bias.abs().max() <= 300 * 1e-3 + 1e-9
    record = moe.last_record                    # combine weights: the router's own probabilities, renormalized
    probs = record.logits_TE.softmax(-1).gather(-1, record.topk_ids_TK)
    torch.testing.assert_close(record.topk_weights_TK, probs / probs.sum(-1, keepdim=True))
    model.eval()
    model(x)
    balancer.step()                             # eval forwards are not counted
    assert balancer.counts["0"].sum() == 0
    state = {k: v for k, v in model.state_dict().items() if "selection_bias" in k}
    assert state and torch.equal(state["0.selection_bias"], moe.selection_bias)   # saved with the model


def test_teacher_equals_the_dense_ensemble_at_step_zero():
    moe, x = layer(shared=True), inputs(64)
    model = nn.Sequential(moe).train()
    teacher = EMATeacher(model, beta=0.999)
    with torch.no_grad():
        expected = sum(moe.router(x).softmax(-1)[:, e:e + 1] * moe.experts.weights().expert(e)(x) for e in range(E))
        expected = expected + moe.shared_experts.weights().expert(0)(x)
    torch.testing.assert_close(ensemble_output(teacher.teachers["0"], x), expected, rtol=1e-5, atol=1e-5)
    model(x)
    assert teacher.loss().item() > 0 and teacher.tokens_distilled == 64


def test_eesd_loss_vanishes_when_the_student_uses_every_expert():
    moe, x = layer(top_k=E), inputs(64)
    model = nn.Sequential(moe).train()
    teacher = EMATeacher(model)
    model(x)
    assert teacher.loss().item() < 1e-10


def test_ema_lags_as_beta_says():
    moe = layer()
    model = nn.Sequential(moe)
    beta, steps = 0.9, 5
    teacher = EMATeacher(model, beta=beta)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    with torch.no_grad():
        for p in moe.parameters():
            p.add_(1.0)                          # theta1 = theta0 + 1, held for `steps` updates
    for _ in range(steps):
        teacher.update()
    for name, value in teacher.teachers["0"].named_parameters():
        # theta_ema = theta1 + beta^n (theta0 - theta1) = theta0 + 1 - beta^n
        torch.testing.assert_close(value, before[name] + 1 - beta**steps, rtol=0, atol=1e-6)


def test_uncertain_only_teacher_runs_on_the_highest_entropy_tokens():
    moe, x = layer(), inputs(100)
    model = nn.Sequential(moe).train()
    teacher = EMATeacher(model, uncertain_fraction=0.25)
    model(x)
    assert teacher.tokens_distilled == 25
    probs = moe.last_record.probs_TE
    entropy = -(probs * probs.log()).sum(-1)
    chosen = teacher._select(moe, 100)
    assert set(chosen.tolist()) == set(entropy.topk(25).indices.tolist())
    with pytest.raises(ValueError):
        EMATeacher(model, uncertain_fraction=0.0)


def tiny_moe():
    model = make_tiny("llama")
    upcycle_model(model, build(ConvertConfig, {"method": "noise", "moe": {"num_experts": 4, "top_k": 2}}),
                  progress=False)
    return model


def test_train_step_composes_every_regularizer():
    model = tiny_moe()
    cfg = RegularizerConfig(load_balance=0.01, z_loss=0.001, limoe_local=0.01, limoe_global=0.01, limoe_m=3,
                            dpsl=0.01, dpsl_alpha=1.0, eesd=1.0, eesd_beta=0.9, aux_free_rate=1e-3)
    reg = Objective(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (4, 32), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    teacher_before = [p.clone() for p in reg.teacher._teacher_params]
    logs = [train_step(model, batch, opt, reg).loss for _ in range(3)]
    for log in logs:
        assert set(log) == {"task", "load_balance", "z_loss", "limoe_local", "limoe_global", "dpsl", "eesd", "total"}
        assert all(math.isfinite(v) for v in log.values())
        weighted = log["task"] + sum(getattr(cfg, k) * log[k] for k in log if k not in ("task", "total"))
        assert log["total"] == pytest.approx(weighted, rel=1e-5)
    assert all(log["eesd"] > 0 for log in logs)     # top-2 of 4 student vs the all-expert ensemble
    assert any(not torch.equal(a, b) for a, b in zip(teacher_before, reg.teacher._teacher_params, strict=True))
    assert any(layer.selection_bias.abs().sum() > 0 for layer in reg.balancer.layers.values())
    # the records hold the padding mask, so every layer loss saw 4*32 - 12 real tokens
    assert all(int(layer.last_record.mask_T.sum()) == 116 for layer in reg.balancer.layers.values())


def test_router_losses_per_group_need_matching_token_counts():
    model = tiny_moe().train()
    ids = torch.randint(3, 128, (2, 16))
    model(input_ids=ids)
    groups = torch.tensor([[0] * 16, [1] * 16])
    by_group = router_losses(model, RegularizerConfig(load_balance=1.0), groups=groups)["load_balance"]
    pooled = router_losses(model, RegularizerConfig(load_balance=1.0))["load_balance"]
    assert by_group.item() != pytest.approx(pooled.item(), rel=1e-9)    # per-group then averaged differs
