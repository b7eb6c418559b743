"""The expert count changed after conversion (`core.resize`, `metrics.saliency`, `resize.expert_count`): the rows
that go together go together, pruning to E is the identity, REAP removes a dead expert first and keeps a dominant
one, growth keeps every expert's logits and shares its tokens out between it and its copies so the router reaches
every copy, and a folder grown with shifted copies prunes back to the layer's function."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny
from upcycle.config import ConvertConfig, MoEConfig
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer, moe_layers
from upcycle.core.resize import copy_groups, duplicate_experts, select_experts
from upcycle.core.router_split import copy_row_offsets, simplex_vertices
from upcycle.errors import UpcycleError
from upcycle.metrics.saliency import expert_saliency
from upcycle.resize.expert_count import ExpertCount, grow_model, prune_model, replace_layer

E, K, D, F = 6, 2, 8, 16


def layer(router_bias: bool = True, **moe) -> MoELayer:
    g = torch.Generator().manual_seed(0)
    experts = FFNWeights(w_gate=torch.randn(E, F, D, generator=g), w_up=torch.randn(E, F, D, generator=g),
                         w_down=torch.randn(E, D, F, generator=g) / 4, activation="silu")
    made = MoELayer.from_init(experts, torch.randn(E, D, generator=g), config=MoEConfig(**{"num_experts": E, "top_k": K,
                                                                                            **moe}),
                              router_bias_E=torch.randn(E, generator=g) if router_bias else None)
    with torch.no_grad():
        made.selection_bias.copy_(torch.randn(E, generator=g))
    return made.eval()


def x(n: int = 64) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1))


def test_selected_experts_keep_their_router_rows_biases_and_weights():
    old = layer()
    keep = [4, 1, 5]
    new = select_experts(old, keep)
    assert new.num_experts == 3 and new.top_k == K
    assert torch.equal(new.router.weight, old.router.weight[keep])
    assert torch.equal(new.router.bias, old.router.bias[keep])
    assert torch.equal(new.selection_bias, old.selection_bias[keep])
    for name, t in new.experts.weights().tensors().items():
        assert torch.equal(t, old.experts.weights().tensors()[name][keep]), name
    # the kept experts' logits are what they were, for every token
    assert torch.equal(new.router(x()), old.router(x())[:, keep])


def test_keeping_every_expert_is_the_identity():
    old = layer()
    assert torch.equal(select_experts(old, list(range(E)))(x()), old(x()))


def test_copies_keep_their_sources_logits_and_weights_and_add_their_row_offsets():
    """No logit is shifted: the experts that were there route exactly as before, and copy i's logit is its
    source's plus offsets[i] . x (its weights, router bias and selection bias its source's)."""
    old = layer(router_bias=True)
    sources = [1, 1, 3]
    offsets = torch.randn(3, D, generator=torch.Generator().manual_seed(7)) / 10
    new = duplicate_experts(old, sources, offsets)
    assert new.num_experts == E + 3 and new.top_k == K
    z_old, z_new = old.router(x()), new.router(x())
    assert torch.equal(z_new[:, :E], z_old)
    torch.testing.assert_close(z_new[:, E:], z_old[:, sources] + x() @ offsets.T, atol=1e-6, rtol=1e-6)
    assert torch.equal(new.router.bias[E:], old.router.bias[sources])
    assert torch.equal(new.selection_bias[E:], old.selection_bias[sources])
    assert torch.equal(new.experts.w_down[E:], old.experts.w_down[sources])
    assert torch.equal(duplicate_experts(old, sources).router.weight[E:], old.router.weight[sources])


def test_simplex_vertices_are_unit_equidistant_and_sum_to_zero():
    for n in (1, 2, 3, 7):
        s = simplex_vertices(n)
        assert s.shape == (n + 1, n)
        torch.testing.assert_close(s.norm(dim=1), torch.ones(n + 1, dtype=torch.float64))
        torch.testing.assert_close(s.sum(0), torch.zeros(n, dtype=torch.float64), atol=1e-12, rtol=0)
        dots = s @ s.T
        off = dots[~torch.eye(n + 1, dtype=torch.bool)]
        torch.testing.assert_close(off, torch.full_like(off, -1 / n))      # a regular simplex: cos = -1/n


@pytest.mark.parametrize(("top_k", "sources"), [(1, [0, 1, 2, 3, 4, 5]), (2, [0, 0, 0]), (1, [4, 4])])
def test_the_split_shares_each_sources_tokens_between_it_and_its_copies(top_k, sources):
    """On the calibration tokens the source took, the source and each of its copies take a part: none empty and
    none over 3/4 of them (a median split of a Gaussian cloud gives about 1/(n + 1) each, 0.33 measured for two
    copies); with top-1 and one expert copied, each of its tokens goes to one member of its group (the others'
    logits are unchanged)."""
    old = layer(router_bias=False, top_k=top_k)
    with torch.no_grad():
        old.selection_bias.zero_()             # no expert switched off by its selection bias
    tokens = torch.randn(4000, D, generator=torch.Generator().manual_seed(3)) + 0.5
    before = old.route(tokens).topk_ids_TK
    new = duplicate_experts(old, sources, copy_row_offsets(old, tokens, sources))
    after = new.route(tokens).topk_ids_TK
    members = {e: [e, *(E + i for i, s in enumerate(sources) if s == e)] for e in set(sources)}
    for e, group in members.items():
        took = (before == e).any(dim=1)
        share = torch.stack([(after[took] == m).any(dim=1).float().mean() for m in group])
        assert torch.all(share > 0.05) and torch.all(share < 0.75), (e, share)
        if len(members) == 1 and top_k == 1:
            assert share.sum() == 1, share


def test_a_folder_grown_with_shifted_copies_prunes_back_to_its_function():
    """A folder grown before copies kept their logits holds exact copies (rows, biases, weights) whose logits were
    shifted by -log n: pruning back to E removes the copies first (exact copies of an earlier expert) and gives
    the kept ones their share back (+log 2): the same routing and the same output."""
    model = _upcycled()
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(2))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    with torch.no_grad():
        before = model(**batches[0]).logits
    for name, moe in moe_layers(model).items():
        grown = duplicate_experts(moe, [0, 1, 2, 3])           # exact copies, then the old -log 2 shift
        grown.router.bias = torch.nn.Parameter(torch.full((8,), -math.log(2)))
        replace_layer(model, name, grown)
    pruned = prune_model(model, ExpertCount(4, "reap"), batches)
    assert all(r["kept"] == [0, 1, 2, 3] and r["removed"] == [4, 5, 6, 7] for r in pruned.values())
    assert all(r["copies_of"] == {4: 0, 5: 1, 6: 2, 7: 3} for r in pruned.values())
    with torch.no_grad():
        after = model(**batches[0]).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("method", "top_k", "n", "by"), [("noise", 1, 6, "utility"), ("noise", 2, 12, "uniform"),
                                                          ("copy", 2, 6, "utility")])
def test_grown_copies_are_reached_and_are_no_exact_copies(method, top_k, n, by):
    """After growth every expert, copies included, takes some of the calibration tokens (the bug this guards:
    copies whose logits were shifted down by -log n lost every top-k choice, and the experts they copied with
    them); no copy is an exact copy of its source, so a later prune does not mistake it for an old shifted one."""
    model = _upcycled(method=method, top_k=top_k)
    ids = torch.randint(3, 120, (8, 32), generator=torch.Generator().manual_seed(2))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    grow_model(model, ExpertCount(n, by), batches)
    with torch.no_grad():
        model(**batches[0])
    for moe in moe_layers(model).values():
        load = torch.bincount(moe.last_record.topk_ids_TK.reshape(-1), minlength=n)
        assert torch.all(load > 0), load
        assert copy_groups(moe) == list(range(n))


def _upcycled(layers: int = 2, method: str = "noise", top_k: int = 2):
    model = make_tiny("llama", layers=layers)
    cfg = ConvertConfig(model="x", method=method, moe=MoEConfig(num_experts=4, top_k=top_k), seed=3)
    upcycle_model(model, cfg, progress=False)
    return model.eval()


def test_reap_removes_a_dead_expert_first_and_keeps_a_dominant_one():
    model = _upcycled()
    name, moe = next(iter(moe_layers(model).items()))
    with torch.no_grad():
        moe.experts.w_down[2].zero_()           # a dead expert: every output 0, so g * ||f|| = 0
        moe.experts.w_down[1].mul_(50)          # a dominant one
    ids = torch.randint(3, 120, (4, 16), generator=torch.Generator().manual_seed(0))
    report = prune_model(model, ExpertCount(3, "reap"), [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    score = report[name]["saliency"]
    assert score[2] == 0 and score[1] == max(score) and report[name]["removed"] == [2]
    assert moe_layers(model)[name].num_experts == 3


def test_pruning_to_every_expert_leaves_the_logits_equal():
    model = _upcycled()
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        before = model(**batch).logits
    prune_model(model, ExpertCount(4, "frequency"), [batch])
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


def test_saliency_by_each_rule():
    moe = layer()
    tokens = x(256)
    ids = moe.route(tokens).topk_ids_TK
    frequency = expert_saliency(moe, tokens, "frequency")
    assert frequency.sum().item() == pytest.approx(1.0) and frequency[0] == (ids == 0).sum() / ids.numel()
    random = expert_saliency(moe, tokens, "random", seed=5)
    assert torch.equal(random, expert_saliency(moe, tokens, "random", seed=5))
    utility = expert_saliency(moe, tokens, "utility")
    assert torch.equal(utility > 0, frequency > 0) and not torch.equal(utility, frequency)    # 0 where no token goes
    with pytest.raises(ValueError, match="one of reap"):
        expert_saliency(moe, tokens, "largest")


@pytest.mark.parametrize(("grow", "n", "message"), [
    (False, 1, "keeps at least 2 experts"), (False, 5, "use grow"), (True, 3, "use prune")])
def test_impossible_counts_are_refused_before_any_layer_changes(grow, n, message):
    model = _upcycled()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UpcycleError, match=message):
        (grow_model if grow else prune_model)(model, ExpertCount(n, "uniform" if grow else "reap"), [])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_dense_model_and_a_sigmoid_router_are_refused():
    with pytest.raises(UpcycleError, match="has no MoE layer"):
        prune_model(make_tiny("llama"), ExpertCount(2, "reap"), [])
    with pytest.raises(UpcycleError, match="scores with sigmoid"):
        duplicate_experts(layer(score="sigmoid"), [0])


@pytest.mark.parametrize("how", ["noise", "drop"])
def test_perturbed_growth_changes_only_the_copies_as_the_init_method_does(how):
    """--perturb: the copies' weights move (noise: every matrix entry, by about 0.01 of the matrix's std; drop:
    half of each copy's neurons re-drawn, the rest bit for bit its source's), while the experts they copy, the
    router rows and the biases stay as unperturbed growth makes them."""
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(2))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    exact, perturbed = _upcycled(), _upcycled()
    grow_model(exact, ExpertCount(8, "uniform", seed=5), batches)
    report = grow_model(perturbed, ExpertCount(8, "uniform", seed=5, perturb=how), batches)
    assert all(r["perturbed"] == how for r in report.values())
    for name, old in moe_layers(exact).items():
        new = moe_layers(perturbed)[name]
        assert torch.equal(new.router.weight, old.router.weight) and new.router.bias is None is old.router.bias
        w_old, w_new = old.experts.weights(), new.experts.weights()
        for field in ("w_gate", "w_up", "w_down"):
            a, b = getattr(w_old, field), getattr(w_new, field)
            assert torch.equal(b[:4], a[:4]), field                     # the sources untouched
            changed = b[4:] != a[4:]
            if how == "noise":
                assert changed.float().mean() > 0.99, field
                ratio = ((b[4:] - a[4:]).std(dim=(1, 2)) / a[4:].std(dim=(1, 2)))
                assert torch.all((ratio > 0.008) & (ratio < 0.012)), (field, ratio)   # 0.01, +-20 %
            else:
                F_ = a.shape[1] if field != "w_down" else a.shape[2]
                neuron_dim = 2 if field == "w_up" or field == "w_gate" else 1   # a neuron's whole row / column
                neurons = changed.any(dim=neuron_dim)
                assert torch.all(neurons.sum(-1) == round(0.5 * F_)), field
        # the same neurons in the gate, up and down projections of each copy
        if how == "drop":
            rows = (w_new.w_up[4:] != w_old.w_up[4:]).any(-1)
            cols = (w_new.w_down[4:] != w_old.w_down[4:]).any(-2)
            assert torch.equal(rows, cols)
    # the same seed draws the same perturbation
    again = _upcycled()
    grow_model(again, ExpertCount(8, "uniform", seed=5, perturb=how), batches)
    assert all(torch.equal(moe_layers(again)[n].experts.w_down, m.experts.w_down)
               for n, m in moe_layers(perturbed).items())


def test_perturb_is_refused_for_pruning_and_an_unknown_kind():
    with pytest.raises(UpcycleError, match="--perturb"):
        prune_model(_upcycled(), ExpertCount(2, "reap", perturb="noise"), [])
    with pytest.raises(UpcycleError, match="--perturb"):
        grow_model(_upcycled(), ExpertCount(8, "uniform", perturb="jitter"), [])
