"""DPSL (docs/methods.md §4.4): the on-device Beta CDF against SciPy, its gradient, the loss, and shaping works."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import special

from upcycle.training.loss.dpsl import beta_cdf, beta_pdf, dpsl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))
from dpsl_shaping import ks_tests, shape  # noqa: E402


@pytest.mark.parametrize("backend", ["torch", "scipy"])
def test_beta_cdf_matches_scipy_over_the_prior_range_including_endpoints(backend):
    """The on-device continued fraction (torch) against SciPy, and the SciPy backend's own wiring (clamping,
    broadcasting, dtype), over the priors' range and the endpoints."""
    x = torch.cat([torch.tensor([0.0, 1e-300, 1e-12, 1e-6, 1 - 1e-6, 1 - 1e-12, 1.0], dtype=torch.float64),
                   torch.linspace(0, 1, 1001, dtype=torch.float64)])
    params = np.geomspace(0.1, 10, 15)
    a, b = np.meshgrid(params, params, indexing="ij")
    a_t = torch.tensor(a.ravel())[:, None]
    b_t = torch.tensor(b.ravel())[:, None]
    ours = beta_cdf(x[None, :].expand(a_t.shape[0], -1), a_t, b_t, backend=backend).numpy()
    ref = special.betainc(a.ravel()[:, None], b.ravel()[:, None], x.numpy()[None, :])
    assert np.abs(ours - ref).max() <= 1e-9
    # a realistic prior: 16 experts, alpha = 1 each -> Beta(1, 15); and a large-A table entry
    for aa, bb in ((1.0, 15.0), (10.0, 150.0), (0.2, 0.4)):
        assert np.abs(beta_cdf(x, aa, bb, backend=backend).numpy() - special.betainc(aa, bb, x.numpy())).max() <= 1e-9
    assert beta_cdf(x.float(), 0.5, 2.0, backend=backend).dtype == torch.float32   # float64 inside, returned as given


def test_dpsl_backends_agree_and_cpu_uses_scipy(monkeypatch):
    """The loss and its gradient are the same (1e-9) with either CDF backend; on CPU `auto` takes SciPy, the
    faster one there (benchmarks/speed/regularizers.py)."""
    import upcycle.training.loss.dpsl as module

    probs = torch.randn(2048, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64).softmax(-1)
    results = {}
    for backend in ("torch", "scipy"):
        monkeypatch.setattr(module, "beta_cdf", lambda *a, backend_=backend, **k: _cdf(*a, backend=backend_, **k))
        p = probs.clone().requires_grad_(True)
        loss = dpsl(p, [0.75] * 8)
        loss.backward()
        results[backend] = (loss.detach(), p.grad)
    assert abs(float(results["torch"][0] - results["scipy"][0])) <= 1e-9
    assert (results["torch"][1] - results["scipy"][1]).abs().max() <= 1e-9
    monkeypatch.undo()
    called = []
    real = module._incomplete_beta_scipy
    monkeypatch.setattr(module, "_incomplete_beta_scipy", lambda *a: called.append(1) or real(*a))
    dpsl(probs, 1.0)
    assert called
    with pytest.raises(ValueError, match="backend"):
        beta_cdf(probs, 1.0, 1.0, backend="fortran")


_cdf = beta_cdf


def test_beta_cdf_gradient_is_the_density_and_matches_finite_differences():
    x = torch.tensor([0.01, 0.2, 0.5, 0.77, 0.99], dtype=torch.float64, requires_grad=True)
    for a, b in ((0.3, 2.0), (2.0, 0.4), (5.0, 5.0), (1.0, 15.0)):
        assert torch.autograd.gradcheck(lambda t, a=a, b=b: beta_cdf(t, a, b), (x,), eps=1e-7, atol=1e-6)
        grad, = torch.autograd.grad(beta_cdf(x, a, b).sum(), x)
        expected = np.exp(special.xlogy(a - 1, x.detach().numpy()) + special.xlog1py(b - 1, -x.detach().numpy())
                          - special.betaln(a, b))
        np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-10)
    edge = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    beta_cdf(edge, 0.2, 0.2).sum().backward()
    assert torch.isfinite(edge.grad).all()                          # clamped density: large but finite
    assert torch.isfinite(beta_pdf(torch.tensor([0.0]), torch.tensor(0.5), torch.tensor(0.5))).all()


def test_dpsl_is_the_cramer_von_mises_distance():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(50, 4, generator=g).softmax(-1).double()
    alpha = [1.0, 2.0, 0.5, 0.5]
    A = sum(alpha)
    expected = 0.0
    for k, a in enumerate(alpha):
        p = np.sort(probs[:, k].numpy())
        expected += np.mean((np.arange(1, 51) / 50 - special.betainc(a, A - a, p)) ** 2)
    assert dpsl(probs, alpha).item() == pytest.approx(expected, rel=1e-9)
    # mask drops rows; groups with a table compute per group and average
    mask = torch.arange(50) < 30
    assert dpsl(probs, alpha, mask=mask).item() == pytest.approx(dpsl(probs[:30], alpha).item(), rel=1e-12)
    groups = (torch.arange(50) >= 20).long()
    table = [[1.0] * 4, [0.3] * 4]
    both = (dpsl(probs[:20], table[0]) + dpsl(probs[20:], table[1])) / 2
    assert dpsl(probs, table, groups=groups).item() == pytest.approx(both.item(), rel=1e-12)


def test_dpsl_refuses_bad_priors():
    probs = torch.full((10, 3), 1 / 3)
    with pytest.raises(ValueError, match="length-3"):
        dpsl(probs, [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        dpsl(probs, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="needs `groups`"):
        dpsl(probs, [[1.0] * 3, [2.0] * 3])
    with pytest.raises(ValueError, match="index the alpha table"):
        dpsl(probs, [[1.0] * 3, [2.0] * 3], groups=torch.full((10,), 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dpsl_runs_on_the_gpu_without_leaving_it():
    probs = torch.randn(4096, 16, device="cuda").softmax(-1).requires_grad_(True)
    loss = dpsl(probs, 1.0)
    loss.backward()
    assert loss.device.type == "cuda" and probs.grad.device.type == "cuda"


def test_dpsl_shapes_free_logits_to_their_dirichlet_priors():
    priors = [[5.0, 5.0, 5.0], [0.2, 0.2, 0.2]]
    probs, groups, history = shape(priors)          # Adam lr 0.1, 100 steps, 512 tokens per source
    assert history[-1] < history[0] / 50
    pvalues = ks_tests(probs, groups, priors)
    assert min(min(row) for row in pvalues) > 0.01, pvalues
    probs, _, _ = shape([[3.0, 1.0, 0.5]])
    means = probs.mean(0)
    assert means[0] > 0.6 and means[0] > means[1] > means[2]     # mass moves towards category 1 (alpha 3)
