"""copy / noise / drop (docs/methods.md §2.1-2.3) and the registry's signature-as-schema."""

from __future__ import annotations

import pytest
import torch

from upcycle.core.ffn import FFNWeights
from upcycle.errors import UpcycleError
from upcycle.methods import METHODS, get_method

D, F, E = 16, 40, 4


def dense(gated=True, bias=False, seed=0) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    return FFNWeights(w_up=torch.randn(F, D, generator=g), w_down=torch.randn(D, F, generator=g) * 0.5 + 0.1,
                      w_gate=torch.randn(F, D, generator=g) if gated else None,
                      b_up=torch.randn(F, generator=g) if bias else None, b_down=torch.randn(D, generator=g) if bias
                      else None, activation="silu" if gated else "gelu")


def run(name, ffn=None, seed=0, **args):
    method = get_method(name)
    return method(ffn or dense(), method.resolve_args(args), num_experts=E, top_k=2,
                  generator=torch.Generator().manual_seed(seed))


def test_registry_lists_methods_with_papers_and_typed_args():
    assert {"copy", "noise", "drop"} <= set(METHODS)
    drop = METHODS["drop"]
    assert "2502.19261" in drop.paper
    assert drop.args["ratio"].type is float and drop.args["ratio"].default == 0.5
    assert drop.resolve_args({"ratio": 1}) == {"ratio": 1.0, "router_std": 0.02}   # int accepted for float


def test_registry_refuses_unknown_and_mistyped_args():
    with pytest.raises(UpcycleError, match="no argument.*'ratoi'.*ratio"):
        METHODS["drop"].resolve_args({"ratoi": 0.3})
    with pytest.raises(UpcycleError, match="must be float"):
        METHODS["drop"].resolve_args({"ratio": "half"})
    with pytest.raises(UpcycleError, match="true or false"):
        METHODS["noise"].resolve_args({"relative_std": 1})
    with pytest.raises(UpcycleError, match="unknown method 'nope'.*copy"):
        get_method("nope")


def test_copy_experts_are_the_dense_ffn_and_router_is_small_normal():
    ffn = dense(bias=True)
    init = run("copy", ffn)
    for name, t in ffn.tensors().items():
        stacked = getattr(init.experts, name)
        assert stacked.shape == (E, *t.shape) and all(torch.equal(s, t) for s in stacked)
    assert init.router_ED.shape == (E, D) and init.router_ED.dtype == torch.float32
    assert 0.01 < init.router_ED.std().item() < 0.04


def test_noise_fraction_zero_is_copy_and_fraction_one_perturbs_every_entry():
    ffn = dense()
    same = run("noise", ffn, fraction=0.0)
    assert all(torch.equal(e, ffn.w_up) for e in same.experts.w_up)
    full = run("noise", ffn, fraction=1.0, std=0.1)
    delta = full.experts.w_up - ffn.w_up
    assert (delta != 0).all()
    # relative std: noise std = 0.1 * std(W)
    assert delta.std().item() == pytest.approx(0.1 * ffn.w_up.std().item(), rel=0.1)
    absolute = run("noise", ffn, std=0.5, relative_std=False)
    assert (absolute.experts.w_down - ffn.w_down).std().item() == pytest.approx(0.5, rel=0.1)


def test_noise_fraction_is_the_share_of_perturbed_entries_and_experts_differ():
    init = run("noise", dense(), fraction=0.3)
    changed = (init.experts.w_up != dense().w_up).float().mean().item()
    assert changed == pytest.approx(0.3, abs=0.05)
    assert not torch.equal(init.experts.w_up[0], init.experts.w_up[1])


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_drop_reinitializes_exactly_ratio_F_neurons_per_expert(ratio):
    ffn = dense(bias=True)
    init = run("drop", ffn, ratio=ratio)
    n = round(ratio * F)
    subsets = []
    for e in range(E):
        rows_up = (init.experts.w_up[e] != ffn.w_up).any(1)
        rows_gate = (init.experts.w_gate[e] != ffn.w_gate).any(1)
        cols_down = (init.experts.w_down[e] != ffn.w_down).any(0)
        assert rows_up.sum() == n
        assert torch.equal(rows_up, rows_gate) and torch.equal(rows_up, cols_down)   # whole neurons
        assert torch.equal(init.experts.b_down[e], ffn.b_down)                       # b_down is nobody's neuron
        subsets.append(frozenset(rows_up.nonzero().view(-1).tolist()))
    assert len(set(subsets)) == E      # each expert drew its own subset


def test_drop_draws_from_the_original_matrix_statistics():
    big = FFNWeights(w_up=torch.randn(2000, 64) * 3 + 1, w_down=torch.randn(64, 2000) * 0.2 - 0.5, activation="gelu")
    drop = get_method("drop")
    init = drop(big, drop.resolve_args({"ratio": 0.5, "router_std": 0.02}), num_experts=2, top_k=1,
                generator=torch.Generator().manual_seed(0))
    fresh = init.experts.w_up[0][(init.experts.w_up[0] != big.w_up).any(1)]
    assert fresh.mean().item() == pytest.approx(big.w_up.mean().item(), abs=0.05)
    assert fresh.std().item() == pytest.approx(big.w_up.std().item(), rel=0.05)
    fresh_down = init.experts.w_down[0][:, (init.experts.w_down[0] != big.w_down).any(0)]
    assert fresh_down.std().item() == pytest.approx(big.w_down.std().item(), rel=0.05)


def test_drop_ratio_zero_is_copy_and_bad_ratio_is_refused():
    ffn = dense()
    assert all(torch.equal(e, ffn.w_up) for e in run("drop", ffn, ratio=0.0).experts.w_up)
    with pytest.raises(UpcycleError, match="ratio"):
        run("drop", ffn, ratio=1.5)


@pytest.mark.parametrize("name", ["copy", "noise", "drop"])
def test_same_seed_same_bytes_different_seed_different_experts(name):
    a, b, c = run(name, seed=7), run(name, seed=7), run(name, seed=8)
    for t in ("w_up", "w_gate", "w_down"):
        assert torch.equal(getattr(a.experts, t), getattr(b.experts, t))
    assert torch.equal(a.router_ED, b.router_ED) and not torch.equal(a.router_ED, c.router_ED)
    if name != "copy":
        assert not torch.equal(a.experts.w_up, c.experts.w_up)


def test_plain_mlp_is_supported():
    init = run("drop", dense(gated=False, bias=True))
    assert init.experts.w_gate is None and init.experts.b_up.shape == (E, F)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_granular_layer_reproduces_the_dense_ffn(normalize, gated, bias):
    """16 experts top-8 = 4 replicas x 4 shards (the DPSL paper's granular setting): exact at init."""
    from upcycle.core.moe import MoELayer

    ffn = dense(gated=gated, bias=bias)
    method = get_method("granular")
    init = method(ffn, method.resolve_args({"granularity": 4}), num_experts=16, top_k=8,
                  generator=torch.Generator().manual_seed(0), normalize_topk=normalize)
    assert init.experts.w_up.shape == (16, F // 4, D)
    assert init.info["folded_scale"] == (4.0 if normalize else 16 * 4 / 8)
    layer = MoELayer.from_init(init.experts, init.router_ED, top_k=8, normalize_topk=normalize)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ffn(x), atol=1e-5, rtol=1e-5)
    ids = layer.last_record.topk_ids_TK
    replicas = (ids // 4).sort(-1).values.view(64, 2, 4)
    assert torch.all(replicas == replicas[..., :1])          # virtual groups: whole replicas are chosen


def test_granular_virtual_group_router_rows_and_errors():
    method = get_method("granular")
    init = method(dense(), method.resolve_args({"granularity": 2}), num_experts=8, top_k=4,
                  generator=torch.Generator().manual_seed(0), normalize_topk=True)
    rows = init.router_ED.view(4, 2, D)
    assert torch.equal(rows[:, 0], rows[:, 1]) and not torch.equal(rows[0, 0], rows[1, 0])
    for args, E, k, message in (({"granularity": 3}, 6, 3, "must divide the FFN width"),
                                ({"granularity": 4}, 6, 4, "multiples of granularity"),
                                ({"granularity": 4}, 8, 2, "multiples of granularity")):
        with pytest.raises(UpcycleError, match=message):
            method(dense(), method.resolve_args(args), num_experts=E, top_k=k,
                   generator=torch.Generator().manual_seed(0), normalize_topk=True)


@pytest.mark.parametrize("name", ["copy", "cluster", "drop", "drop_svd", "spri"])
def test_projections_a_method_does_not_change_are_views_not_copies(name):
    # FFNWeights.expand: unchanged projections cost no memory (stride 0 on the expert dimension); a method that
    # went back to repeat() would hold E copies of them (1.6 GB of float32 per layer of a 2B model)
    ffn = dense(bias=True)
    method = get_method(name)
    common = {"activations": torch.randn(256, D, generator=torch.Generator().manual_seed(3))} if name == "cluster" \
        else {"top_k": 2}
    init = method(ffn, method.resolve_args({}), num_experts=E, generator=torch.Generator().manual_seed(0), **common)
    unchanged = [n for n, t in init.experts.tensors().items()
                 if all(torch.equal(t[i], getattr(ffn, n)) for i in range(E))]
    assert unchanged, "every method here keeps at least one projection (or bias) of the dense FFN"
    for n in unchanged:
        assert getattr(init.experts, n).stride(0) == 0, f"{name}: {n} is a copy"
    single = FFNWeights(w_up=torch.ones(3, 2), w_down=torch.ones(2, 3), activation="relu")
    assert single.expand(5).w_up.stride(0) == 0 and single.expand(5).num_experts == 5
    with pytest.raises(ValueError, match="single FFN"):
        single.expand(2).expand(2)
