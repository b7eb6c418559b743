"""Dirichlet-Prior Shaping Loss (DPSL, "Dirichlet-Prior Shaping: Guiding Expert Specialization in Upcycled MoEs";
docs/methods.md §4.4), with a Beta CDF that runs on the tensor's own device.

A batch of probability vectors p_BK (router softmaxes, or any categorical head) is pushed towards Dir(alpha):
each marginal p_k ~ Beta(alpha_k, A - alpha_k), A = sum alpha. For each k the B probabilities are sorted and the
Cramer-von Mises distance to that Beta is taken:

    L = sum_k (1/B) sum_j [ j/B - F_Beta(p_k,(j); alpha_k, A - alpha_k) ]^2

Gradients reach p through F_Beta, whose derivative is the Beta density; j/B is a constant. Priors: a float
(symmetric), a length-K vector (asymmetric), or a [G, K] table with `groups` (token group g uses row g; the
loss is computed per group and averaged over the groups present).

`beta_cdf` is the regularized incomplete beta I_x(a, b) by its continued fraction (evaluated with the modified
Lentz method, as in Numerical Recipes §6.4), using the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where
x > (a + 1) / (a + b + 2) so the fraction always converges fast. A fixed number of iterations (no data-dependent
loop, no host sync) in float64, chosen from the priors' largest parameter (`ITERATIONS`): within 1e-10 of
scipy.special.betainc for a, b in [0.05, 1000], x in [0, 1] (tests/package/test_dpsl.py checks 1e-9). Torch has no
betainc; the DPSL paper's implementation copied to the CPU for SciPy.

Which backend (`backend="auto"`): tensors on an accelerator use the continued fraction on the device (no copy to
the host, docs/methods.md §4.4); CPU tensors call scipy.special.betainc directly, which is the faster of the two there
(73,728 x 16, float64: 0.045 s against 0.49 s at alpha = 1, 0.30 s against 0.80 s at alpha = 0.75; the two agree
to 3e-15). The gradient is the Beta density either way.
"""

from __future__ import annotations

import functools

import torch

_TINY = 1e-300
# Continued-fraction steps by the largest Beta parameter, each measured against scipy.special.betainc over
# a, b in [0.05, limit] and x in [0, 1] to < 1e-10 (fewer steps, less time: the cost is linear in them).
ITERATIONS = ((5.0, 12), (10.0, 16), (20.0, 20), (50.0, 24), (200.0, 32), (1000.0, 40))
MAX_ITERATIONS = 64   # beyond the table, or when the parameters live on an accelerator (no host sync)


def iterations_for(largest_parameter: float) -> int:
    return next((n for limit, n in ITERATIONS if largest_parameter <= limit), MAX_ITERATIONS)


def _continued_fraction(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, iterations: int) -> torch.Tensor:
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = torch.ones_like(x)
    d = 1.0 - qab * x / qap
    d = torch.where(d.abs() < _TINY, _TINY, d).reciprocal()
    h = d
    for m in range(1, iterations + 1):
        m2 = 2.0 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),                    # even step
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):          # odd step
            d = 1.0 + aa * d
            d = torch.where(d.abs() < _TINY, _TINY, d).reciprocal()
            c = 1.0 + aa / c
            c = torch.where(c.abs() < _TINY, _TINY, c)
            h = h * d * c
    return h


def _log_beta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)


def _incomplete_beta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, iterations: int) -> torch.Tensor:
    x = x.clamp(0.0, 1.0)
    flip = x > (a + 1.0) / (a + b + 2.0)
    aa, bb, xx = torch.where(flip, b, a), torch.where(flip, a, b), torch.where(flip, 1.0 - x, x)
    # x^a (1-x)^b / B(a, b), as exp of logs; xlogy gives 0 log 0 = 0, so the endpoints are exact
    front = torch.exp(torch.special.xlogy(aa, xx) + torch.special.xlogy(bb, 1.0 - xx) - _log_beta(aa, bb))
    value = front * _continued_fraction(aa, bb, xx, iterations) / aa
    return torch.where(flip, 1.0 - value, value)


def beta_pdf(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Beta(a, b) density, with x clamped to [1e-12, 1 - 1e-12] so the endpoints give large finite values
    (the density is infinite there when a < 1 or b < 1)."""
    x = x.clamp(1e-12, 1.0 - 1e-12)
    return torch.exp((a - 1.0) * torch.log(x) + (b - 1.0) * torch.log1p(-x) - _log_beta(a, b))


def _incomplete_beta_scipy(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """scipy.special.betainc on CPU float64 tensors (broadcast), as a tensor."""
    from scipy.special import betainc

    value = betainc(a.numpy(), b.numpy(), x.clamp(0.0, 1.0).numpy())
    return torch.from_numpy(value).broadcast_to(torch.broadcast_shapes(x.shape, a.shape, b.shape))


BACKENDS = ("auto", "torch", "scipy")


class _BetaCDF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, iterations, backend):
        x64, a64, b64 = x.double(), a.double(), b.double()
        ctx.save_for_backward(x64, a64, b64)
        ctx.dtype = x.dtype
        if backend == "scipy":
            return _incomplete_beta_scipy(x64, a64, b64).to(x.dtype)
        return _incomplete_beta(x64, a64, b64, iterations).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x64, a64, b64 = ctx.saved_tensors
        return (grad.double() * beta_pdf(x64, a64, b64)).to(ctx.dtype), None, None, None, None


def beta_cdf(x: torch.Tensor, a: torch.Tensor | float, b: torch.Tensor | float, *,
             iterations: int | None = None, backend: str = "auto") -> torch.Tensor:
    """I_x(a, b), the Beta(a, b) CDF at x (broadcast), on x's device; differentiable in x (gradient = density).
    a and b are treated as constants. `iterations` defaults to what the largest of a and b needs (read on the
    host when a and b are numbers or CPU tensors; MAX_ITERATIONS for accelerator tensors, to avoid a sync); given,
    a and b are taken as checked already (DPSL checks its priors once, `prior`), and nothing is read here.
    `backend`: auto (SciPy for CPU tensors, the on-device continued fraction elsewhere), torch or scipy."""
    if backend not in BACKENDS:
        raise ValueError(f"beta_cdf: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "scipy" if x.device.type == "cpu" else "torch"
    if backend == "scipy" and x.device.type != "cpu":
        raise ValueError("beta_cdf: the scipy backend needs CPU tensors (use torch on an accelerator)")
    if iterations is None:
        on_host = [t for t in (a, b) if not isinstance(t, torch.Tensor) or t.device.type == "cpu"]
        iterations = (iterations_for(max(float(torch.as_tensor(t).max()) for t in (a, b)))
                      if len(on_host) == 2 else MAX_ITERATIONS)
        if any(bool((torch.as_tensor(t) <= 0).any()) for t in on_host):
            raise ValueError("beta_cdf: a and b must be > 0")
    a = torch.as_tensor(a, dtype=torch.float64, device=x.device)
    b = torch.as_tensor(b, dtype=torch.float64, device=x.device)
    return _BetaCDF.apply(x, *torch.broadcast_tensors(a, b), iterations, backend)


def _frozen(value):
    """A prior (a number, a list or a list of lists) as a hashable key."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else float(value)


def prior(alpha, K: int) -> tuple[torch.Tensor, int]:
    """(alpha as a [G, K] table, the continued fraction's iteration count for it), checked once per prior and
    kept: a training step then reads nothing of the priors again (a read of a tensor is a host sync on a GPU)."""
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.tolist()
    return _prior(_frozen(alpha), K)


@functools.lru_cache(maxsize=64)
def _prior(alpha, K: int) -> tuple[torch.Tensor, int]:
    table = _alpha_table(alpha, K)
    b = table.sum(1, keepdim=True) - table
    return table, iterations_for(float(torch.cat([table, b]).max()))


def _alpha_table(alpha, K: int) -> torch.Tensor:
    """alpha as a [G, K] float64 table (G = 1 unless a per-group table was given), validated on the host (the
    priors are a handful of numbers; the CDF then needs no sync to pick its iteration count)."""
    table = torch.as_tensor(alpha, dtype=torch.float64).cpu()
    if table.dim() == 0:
        table = table.expand(K)
    if table.dim() == 1:
        table = table[None]
    if table.dim() != 2 or table.shape[1] != K:
        raise ValueError(f"dpsl: alpha must be a float, a length-{K} vector or a [groups, {K}] table, "
                         f"got shape {tuple(table.shape)}")
    if bool((table <= 0).any()):
        raise ValueError("dpsl: every alpha must be > 0")
    return table


def _cramer_von_mises(p_BK: torch.Tensor, alpha_K: torch.Tensor, keep_B: torch.Tensor | None = None,
                      iterations: int | None = None) -> torch.Tensor:
    """The distance over the rows `keep_B` marks (all when None). Rows left out sort last (they are set above
    1 before sorting) and take no part; their number stays on the device, so nothing is read back to the host."""
    B = p_BK.shape[0]
    if keep_B is not None:
        p_BK = torch.where(keep_B[:, None], p_BK, 2.0)
    sorted_BK = torch.sort(p_BK, dim=0).values
    cdf_BK = beta_cdf(sorted_BK.clamp_max(1.0), alpha_K, alpha_K.sum() - alpha_K,   # host priors: moved inside
                      iterations=iterations)
    j_B1 = torch.arange(1, B + 1, device=p_BK.device, dtype=cdf_BK.dtype)[:, None]
    if keep_B is None:
        return ((j_B1 / B - cdf_BK) ** 2).mean(0).sum()
    n = keep_B.sum().to(cdf_BK.dtype).clamp_min(1)
    taken_B1 = (j_B1 <= n).to(cdf_BK.dtype)
    return (((j_B1 / n - cdf_BK) ** 2) * taken_B1).sum(0).div(n).sum()


def dpsl(probs_BK: torch.Tensor, alpha, *, groups: torch.Tensor | None = None,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """DPSL of a batch of probability vectors [B, K] (rows sum to 1) against Dir(alpha); see the module docstring.
    `mask` [B] keeps rows (padding excluded); `groups` [B] integer ids select rows of a [G, K] alpha table."""
    if probs_BK.dim() != 2:
        raise ValueError(f"dpsl: expected probabilities [B, K], got shape {tuple(probs_BK.shape)}")
    K = probs_BK.shape[1]
    table, iterations = prior(alpha, K)
    keep = None if mask is None else mask.reshape(-1).to(probs_BK.device).bool()
    if groups is None:
        if table.shape[0] != 1:
            raise ValueError("dpsl: a per-group alpha table needs `groups`")
        return _cramer_von_mises(probs_BK, table[0], keep, iterations)
    groups = groups.reshape(-1).to(probs_BK.device)
    keep = torch.ones_like(groups, dtype=torch.bool) if keep is None else keep
    present = torch.unique(groups[keep]).tolist()       # the groups present: read once (a host sync)
    if present and (min(present) < 0 or (table.shape[0] > 1 and max(present) >= table.shape[0])):
        raise ValueError(f"dpsl: group ids must index the alpha table's {table.shape[0]} rows, got {present}")
    losses = [_cramer_von_mises(probs_BK, table[g if table.shape[0] > 1 else 0], keep & (groups == g), iterations)
              for g in present]
    return torch.stack(losses).mean()
