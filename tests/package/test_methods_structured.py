"""drop_svd (docs/methods.md §2.4, Cluster-aware supplementary) and spri (docs/methods.md §2.6, Shan et al. 2026)."""

from __future__ import annotations

import pytest
import torch

from upcycle.core.ffn import FFNWeights
from upcycle.core.moe import MoELayer
from upcycle.errors import UpcycleError
from upcycle.methods import METHODS, get_method

D, F, E, K = 16, 40, 4, 2


def dense(gated=True, bias=False, seed=0) -> FFNWeights:
    g = torch.Generator().manual_seed(seed)
    return FFNWeights(w_up=torch.randn(F, D, generator=g), w_down=torch.randn(D, F, generator=g) * 0.5 + 0.1,
                      w_gate=torch.randn(F, D, generator=g) if gated else None,
                      b_up=torch.randn(F, generator=g) if bias else None,
                      b_down=torch.randn(D, generator=g) if bias else None, activation="silu" if gated else "gelu")


def run(name, ffn=None, seed=0, num_experts=E, top_k=K, **args):
    method = get_method(name)
    return method(ffn or dense(), method.resolve_args(args), num_experts=num_experts, top_k=top_k,
                  generator=torch.Generator().manual_seed(seed))


def svd64(w):
    return torch.linalg.svd(w.double(), full_matrices=False)


def layer_error(ffn, init, top_k=K):
    """max |MoE(x) - FFN(x)| relative to max |FFN(x)| on random inputs."""
    layer = MoELayer.from_init(init.experts, init.router_ED, top_k=top_k, shared=init.shared)
    x = torch.randn(256, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ffn(x)
        return ((layer(x) - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------- drop_svd

def test_drop_svd_fraction_zero_is_the_dense_copy():
    ffn = dense(bias=True)
    init = run("drop_svd", ffn, fraction=0.0)
    for name, t in ffn.tensors().items():
        assert all(torch.equal(e, t) for e in getattr(init.experts, name))
    assert METHODS["drop_svd"].preserves({"fraction": 0.0}, True, True)
    assert not METHODS["drop_svd"].preserves({"fraction": 0.25}, True, True)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_drop_svd_keeps_top_subspace_and_spectrum(gated, fraction):
    ffn = dense(gated=gated, bias=not gated)
    init = run("drop_svd", ffn, fraction=fraction)
    for name in ("w_up", "w_gate", "w_down") if gated else ("w_up", "w_down"):
        U, s, Vh = svd64(getattr(ffn, name))
        keep = s.numel() - round(fraction * s.numel())
        stack = getattr(init.experts, name)
        assert stack.dtype == torch.float32 and stack.shape == (E, *getattr(ffn, name).shape)
        for w_i in stack:
            core = U[:, :keep].T @ w_i.double() @ Vh[:keep].T
            torch.testing.assert_close(core, torch.diag(s[:keep]), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.linalg.svdvals(w_i.double()), s, rtol=1e-4, atol=1e-6)
            assert (w_i - getattr(ffn, name)).abs().max() > 1e-3            # the weak part did change
        assert all(not torch.equal(stack[a], stack[b]) for a in range(E) for b in range(a))
    if not gated:
        assert init.experts.w_gate is None
        assert all(torch.equal(b, ffn.b_up) for b in init.experts.b_up)
        assert all(torch.equal(b, ffn.b_down) for b in init.experts.b_down)
    assert init.info["replaced_singular_vectors"]["w_up"] == round(fraction * D)


def test_drop_svd_seeds_and_errors():
    a, b, c = (run("drop_svd", seed=s) for s in (7, 7, 8))
    for t in ("w_up", "w_gate", "w_down"):
        assert torch.equal(getattr(a.experts, t), getattr(b.experts, t))
        assert not torch.equal(getattr(a.experts, t), getattr(c.experts, t))
    assert torch.equal(a.router_ED, b.router_ED) and not torch.equal(a.router_ED, c.router_ED)
    for bad in (-0.1, 1.5):
        with pytest.raises(UpcycleError, match="fraction"):
            run("drop_svd", fraction=bad)


# ---------------------------------------------------------------- spri

PLACEMENTS = [(True, "down"), (True, "gate"), (True, "up"), (False, "down"), (False, "up")]


@pytest.mark.parametrize("gated,placement", PLACEMENTS)
def test_spri_rho_zero_is_exactly_the_dense_ffn(gated, placement):
    ffn = dense(gated=gated, bias=not gated)
    init = run("spri", ffn, rho=0.0, placement=placement)
    assert init.shared.num_experts == 1 and init.shared.stacked
    assert layer_error(ffn, init) <= 1e-5
    assert METHODS["spri"].preserves(METHODS["spri"].resolve_args({"rho": 0.0}), False, False)


@pytest.mark.parametrize("gated,placement", PLACEMENTS)
def test_spri_small_rho_is_dense_plus_a_small_residual(gated, placement):
    ffn = dense(gated=gated, bias=not gated)
    init = run("spri", ffn, placement=placement)
    assert 1e-5 < layer_error(ffn, init) < 1e-2
    assert not METHODS["spri"].preserves(METHODS["spri"].resolve_args({}), True, True)
    w_name = "w_" + placement
    for name in ("w_up", "w_gate", "w_down"):          # the other projections are dense copies
        if name != w_name and getattr(ffn, name) is not None:
            assert all(torch.equal(e, getattr(ffn, name)) for e in getattr(init.experts, name))
    if not gated:                                       # the shared expert carries the dense biases
        assert torch.equal(init.experts.b_down, torch.zeros(E, D)) and torch.equal(init.shared.b_down[0], ffn.b_down)


def test_spri_alpha_and_groups_match_a_hand_computation():
    ffn = dense()
    init = run("spri", ffn, num_experts=8, top_k=2, rho=1e-2, perturbation=0.0)
    W = ffn.w_down.double()
    U, s, Vh = svd64(W)
    blocks = [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]   # r = 16 into G = 4 contiguous blocks
    assert init.info["groups"] == 4 and init.info["rank"] == 16 and init.info["placement"] == "down"
    for g, idx in enumerate(blocks):
        idx = list(idx)
        R = U[:, idx] @ torch.diag(s[idx]) @ Vh[idx]
        alpha = 1e-2 * torch.linalg.norm(W) / (torch.linalg.norm(R) + 1e-12)
        assert init.info["alpha"][g] == pytest.approx(alpha.item(), rel=1e-12)
        for i in (2 * g, 2 * g + 1):                    # expert i+1 (1-based) is in group ceil((i+1)/2)
            torch.testing.assert_close(init.experts.w_down[i].double(), alpha * R, atol=1e-7, rtol=1e-5)
            assert torch.linalg.norm(init.experts.w_down[i].double()).item() == pytest.approx(
                1e-2 * torch.linalg.norm(W).item(), rel=1e-5)


def test_spri_perturbation_breaks_ties_inside_a_group_only_slightly():
    init = run("spri", num_experts=8, top_k=2)
    w = init.experts.w_down
    inside = (w[0] - w[1]).norm() / w[0].norm()
    across = (w[0] - w[2]).norm() / w[0].norm()
    assert 1e-4 < inside < 0.1 and across > 1.0
    sigma = 1e-2 * 1e-3 * dense().w_down.norm().item() / (D * F) ** 0.5
    assert init.info["perturbation_std"] == pytest.approx(sigma)


def test_spri_without_shared_expert():
    ffn = dense(gated=False, bias=True)
    init = run("spri", ffn, shared_expert=False)
    assert init.shared is None
    assert torch.equal(init.experts.w_down[0], ffn.w_down)            # the dense copy, now routed
    assert all(torch.equal(b, ffn.b_down) for b in init.experts.b_down)
    assert 1e-5 < layer_error(ffn, init) < 1e-2
    assert not METHODS["spri"].preserves(METHODS["spri"].resolve_args({"rho": 0.0, "shared_expert": False}),
                                         True, True)


def test_spri_seeds_and_errors():
    a, b, c = (run("spri", seed=s) for s in (3, 3, 4))
    assert torch.equal(a.experts.w_down, b.experts.w_down) and torch.equal(a.router_ED, b.router_ED)
    assert not torch.equal(a.experts.w_down, c.experts.w_down) and not torch.equal(a.router_ED, c.router_ED)
    with pytest.raises(UpcycleError, match="divisible"):
        run("spri", num_experts=6, top_k=4)
    with pytest.raises(UpcycleError, match="gated"):
        run("spri", dense(gated=False), placement="gate")
    with pytest.raises(UpcycleError, match="placement"):
        run("spri", placement="both")
    with pytest.raises(UpcycleError, match="rho"):
        run("spri", rho=-1.0)
    with pytest.raises(UpcycleError, match="rank"):
        run("spri", num_experts=32, top_k=1)
