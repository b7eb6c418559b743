"""Router regularizers (docs/methods.md §4.1-4.3): exact values, padding and token groups."""

from __future__ import annotations

import math

import pytest
import torch

from upcycle.training.loss.losses import eesd, limoe_global, limoe_local, load_balance, z_loss

E, K, T = 8, 2, 64


def uniform_routing():
    """Every token has uniform probabilities and the slots are spread evenly over the experts."""
    logits_TE = torch.zeros(T, E)
    ids_TK = torch.arange(T * K).reshape(T, K) % E
    return logits_TE, ids_TK


def test_load_balance_is_one_under_uniform_routing():
    logits, ids = uniform_routing()
    assert load_balance(logits, ids).item() == pytest.approx(1.0, abs=1e-6)


def test_load_balance_is_e_over_k_when_every_token_picks_the_same_k_experts():
    logits = torch.full((T, E), -1e4)
    logits[:, :K] = 0.0                     # probability 1/k on experts 0..k-1, ~0 elsewhere
    ids = torch.arange(K).expand(T, K)
    assert load_balance(logits, ids).item() == pytest.approx(E / K, rel=1e-6)


def test_load_balance_excludes_padding_and_averages_groups():
    logits, ids = uniform_routing()
    skewed = torch.full((T, E), -1e4)
    skewed[:, :K] = 0.0
    both = torch.cat([logits, skewed])
    both_ids = torch.cat([ids, torch.arange(K).expand(T, K)])
    mask = torch.cat([torch.ones(T, dtype=torch.bool), torch.zeros(T, dtype=torch.bool)])
    assert load_balance(both, both_ids, mask_T=mask).item() == pytest.approx(1.0, abs=1e-6)   # skewed half is padding
    groups = torch.cat([torch.zeros(T), torch.ones(T)]).long()
    assert load_balance(both, both_ids, groups_T=groups).item() == pytest.approx((1 + E / K) / 2, rel=1e-6)


def test_z_loss_equals_its_formula():
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0)) * 3
    expected = (torch.logsumexp(logits.double(), -1) ** 2).mean()
    assert z_loss(logits).item() == pytest.approx(expected.item(), rel=1e-6)
    mask = torch.arange(T) < 10
    assert z_loss(logits, mask_T=mask).item() == pytest.approx(
        (torch.logsumexp(logits[:10].double(), -1) ** 2).mean().item(), rel=1e-6)


def test_limoe_local_entropy():
    assert limoe_local(torch.zeros(T, E)).item() == pytest.approx(math.log(E), rel=1e-6)
    confident = torch.full((T, E), -1e4)
    confident[:, 3] = 0
    assert limoe_local(confident).item() == pytest.approx(0.0, abs=1e-6)


def test_limoe_global_vanishes_once_enough_experts_are_used():
    # tokens each confident on one expert, spread evenly over all E experts: H(P) = log E >= log m
    spread = torch.full((T, E), -1e4)
    spread[torch.arange(T), torch.arange(T) % E] = 0
    assert limoe_global(spread, m=6).item() == 0.0
    # all tokens on 2 experts: H(P) = log 2, loss = log 6 - log 2
    two = torch.full((T, E), -1e4)
    two[torch.arange(T), torch.arange(T) % 2] = 0
    assert limoe_global(two, m=6).item() == pytest.approx(math.log(6) - math.log(2), rel=1e-5)
    logits = two.clone().requires_grad_(True)
    limoe_global(logits * 1e-3, m=6).backward()       # logits -10: still mostly on 2 experts
    assert logits.grad.abs().sum() > 0              # it pushes towards more experts while below the threshold
    with pytest.raises(ValueError):
        limoe_global(two, m=E + 1)


def test_eesd_is_mean_squared_l2_over_real_tokens_and_stops_teacher_gradients():
    student = torch.randn(T, 16, requires_grad=True)
    teacher = torch.randn(T, 16, requires_grad=True)
    mask = torch.arange(T) % 3 != 0
    loss = eesd(student, teacher, mask_T=mask)
    assert loss.item() == pytest.approx(((student - teacher)[mask] ** 2).sum(-1).mean().item(), rel=1e-6)
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0
