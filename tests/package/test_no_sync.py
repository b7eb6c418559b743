"""No host synchronization in a dropless forward and backward of the MoE layer, its routing record and the
router losses (what a training step runs between its optimizer steps).

On a GPU every read of device data by the host (`.item()`, `int(t)`, `.tolist()`, a boolean index, `bincount`,
`unique`, `nonzero`...) waits for the device to drain its queue. The CUDA test runs the step under
`torch.cuda.set_sync_debug_mode("error")`, which turns any such read into an error. CI has no GPU, so the same
step also runs on the CPU under `HostReads`, a dispatch mode that records every operation that reads device
data back to the host on a GPU (the ones torch's sync debug mode reports, by their aten names), and the test
asserts it saw none: a change that adds a sync is caught on any machine. With capacity, the reads that remain
are counted and pinned (`CAPACITY_SYNCS`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from upcycle.config import MoEConfig, RegularizerConfig
from upcycle.core.ffn import FFNWeights
from upcycle.core.grouped_ffn import forced_kernel_path
from upcycle.core.moe import MoELayer
from upcycle.core.routing_context import padding_mask, real_tokens
from upcycle.training.loss.objective import Objective

aten = torch.ops.aten
# aten operations whose result size or value the host needs: on a GPU each waits for the device
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
         aten.is_nonzero.default, aten.equal.default}
# on the grouped path (the rule's choice on a GPU) and with capacity: the kept tokens' count for the capacity
# (mask.sum()), and the number of kept slots (counts.sum()) that sizes the dispatch
CAPACITY_SYNCS = 2


class HostReads(TorchDispatchMode):
    """Records the operations that read device data back to the host (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func in READS:
            self.reads.append(name)
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.reads.append(f"{name} with a boolean index")
        elif func == aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.reads.append(f"{name} without output_size")
        return func(*args, **kwargs)


class ToList(TorchFunctionMode):
    """Records `Tensor.tolist`, which copies to the host without passing through the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def prepared_step(device: torch.device, *, capacity: float | None = None, real: bool = False):
    """One forward and backward of a padded batch through an MoE layer, with every router loss and EESD, as a
    function whose layer, objective and inputs are already on `device` (moving them there copies from pageable
    host memory, which CUDA's sync debug mode counts; a training step finds them there). `real`: the real tokens'
    positions given, made on the host as the contrastive task makes them, so the layer routes and computes those
    alone (`moe.real_tokens`)."""
    g = torch.Generator().manual_seed(0)
    E, D, F_ = 4, 32, 64
    weights = FFNWeights(w_gate=torch.randn(E, F_, D, generator=g) * 0.1, w_up=torch.randn(E, F_, D, generator=g) * 0.1,
                         w_down=torch.randn(E, D, F_, generator=g) * 0.1, activation="silu")
    layer = MoELayer.from_init(weights, torch.randn(E, D, generator=g) * 0.1,
                               config=MoEConfig(num_experts=E, top_k=2, capacity_factor_train=capacity)).to(device)
    model = nn.Sequential(layer).train()
    objective = Objective(model, RegularizerConfig(load_balance=0.01, z_loss=1e-3, limoe_local=0.01,
                                                   limoe_global=0.01, limoe_m=2.0, dpsl=0.01, eesd=0.1))
    objective.to(device)
    x = torch.randn(2, 24, D, generator=g).to(device).requires_grad_()
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    positions = torch.tensor(list(range(24)) + list(range(24, 24 + 17))).to(device)   # the mask's ones, on the host
    mask = mask.to(device)

    def step() -> tuple[torch.Tensor, dict]:
        with padding_mask(mask), real_tokens(mask, positions) if real else contextlib.nullcontext():
            y = model(x)
            total, logged = objective.loss(y.float().square().mean())
        total.backward()
        return total, logged
    return step


def moe_step(device: torch.device, *, capacity: float | None = None, real: bool = False) -> tuple:
    return prepared_step(device, capacity=capacity, real=real)()


def test_a_dropless_step_reads_nothing_back_to_the_host():
    """On the CPU, the operations of a dropless step on the grouped path include none that reads device data
    back to the host on a GPU. (A first step first: the DPSL prior is checked once, on the host, then kept.)"""
    with forced_kernel_path("grouped_mm"):
        moe_step(torch.device("cpu"))
        with ToList() as lists, HostReads() as seen:
            moe_step(torch.device("cpu"))
    assert seen.reads == [] and lists.calls == 0


def test_a_step_on_the_real_tokens_alone_reads_nothing_back_to_the_host():
    """The layer given its real tokens' positions (padding neither routed nor computed) adds no host read: the
    positions come from the host with the batch, and the gather and scatter of the tokens have fixed sizes."""
    with forced_kernel_path("grouped_mm"):
        moe_step(torch.device("cpu"), real=True)
        with ToList() as lists, HostReads() as seen:
            moe_step(torch.device("cpu"), real=True)
    assert seen.reads == [] and lists.calls == 0


def test_the_detector_sees_what_a_sync_looks_like():
    """The detector above would fail the test for each kind of host read (so its silence means something)."""
    x = torch.randn(6)
    with ToList() as lists, HostReads() as seen:
        x.sum().item()
        x[x > 0]
        torch.bincount(torch.tensor([0, 2]))
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
        torch.unique(torch.tensor([1, 1, 2]))
        bool(x.max() > 0)
        x.tolist()
    assert len(seen.reads) == 6 and lists.calls == 1, seen.reads


def test_with_capacity_the_reads_that_remain_are_counted():
    with forced_kernel_path("grouped_mm"):
        moe_step(torch.device("cpu"), capacity=1.5)
        with ToList() as lists, HostReads() as seen:
            moe_step(torch.device("cpu"), capacity=1.5)
    assert len(seen.reads) + lists.calls == CAPACITY_SYNCS, seen.reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
def test_a_dropless_step_on_cuda_does_not_synchronize():
    device = torch.device("cuda")
    moe_step(device)                       # warm-up: first calls may initialise (cuBLAS handles, caches)
    moe_step(device, real=True)
    dropless, on_real_tokens = prepared_step(device), prepared_step(device, real=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total, logged = dropless()
        on_real_tokens()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(total).item() and set(logged) >= {"load_balance", "z_loss", "dpsl", "eesd", "total"}
