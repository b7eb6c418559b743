"""No compute on padding in contrastive training (docs/contrastive.md, "Speed"): a batch of pairs runs as
length-bucketed chunks whose MoE layers route and compute the real tokens alone; the loss, every router loss,
EESD and every gradient are those of the padded batch, within float32 rounding. Also: the bucket plan is the
optimal cut, biased experts need no index_put in their backward, batches are made ahead."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from test_contrastive import tokenizer, toy_pairs
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_tiny
from upcycle import ConvertConfig, MoEConfig
from upcycle.config import RegularizerConfig
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.ffn import FFNWeights
from upcycle.core.grouped_ffn import SegmentBias, forced_kernel_path
from upcycle.core.moe import MoELayer, moe_layers
from upcycle.core.routing_context import padding_mask, real_positions, real_tokens
from upcycle.data.length_buckets import bucket_plan, positions_computed
from upcycle.errors import UpcycleError
from upcycle.tasks.contrastive import PairBatches, info_nce, lay_out_pairs, pair_loss
from upcycle.tasks.embedding import last_hidden, mean_pool
from upcycle.training.batches_ahead import BatchesAhead
from upcycle.training.loss.objective import Objective

REGULARIZERS = RegularizerConfig(load_balance=0.01, z_loss=1e-3, limoe_local=0.01, limoe_global=0.01, limoe_m=2.0,
                                 dpsl=0.01, eesd=0.5)


def upcycled_bert(seed: int = 0) -> nn.Module:
    """A tiny BERT whose FFNs (with biases) became 4 drop-upcycled experts, top-2, dropout off (the padded and
    the bucketed computations must see the same network)."""
    torch.manual_seed(seed)
    model = make_tiny("bert", seed=seed)
    upcycle_model(model, ConvertConfig(method="drop", moe=MoEConfig(num_experts=4, top_k=2), seed=seed),
                  progress=False)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    layers = moe_layers(model)
    assert layers and all(l.experts.b_in is not None and l.experts.b_down is not None for l in layers.values())
    return model.train()


def padded_loss(model: nn.Module, batch: dict, temperature: float) -> torch.Tensor:
    """The reference: all 2B texts in one forward, padded to the longest, every position computed."""
    b = batch["input_ids"].shape[0]
    ids = batch["input_ids"].transpose(0, 1).reshape(2 * b, -1)
    mask = batch["attention_mask"].transpose(0, 1).reshape(2 * b, -1)
    embedding = mean_pool(last_hidden(model, ids, mask).float(), mask)
    doc, query = batch["doc_index"], batch["query_index"]
    same = (doc[:, None] == doc[None, :]) | (query[:, None] == query[None, :])
    return info_nce(embedding[:b], embedding[b:], temperature, same)


def loss_and_gradients(model, objective, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    total, logged = objective.loss(loss_fn(model, batch, 0.05))
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: float(v) for k, v in logged.items()}, grads


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_bucketed_chunks_give_the_padded_loss_and_gradients(kernel):
    model, tok = upcycled_bert(), tokenizer()
    batch = PairBatches(tok, toy_pairs(64), 16, seed=0, max_length=64).batch(2)
    laid = lay_out_pairs(batch, overhead=0)
    assert len(laid["chunks"]) >= 3 and laid["positions"] < batch["attention_mask"].numel()
    objective = Objective(model, REGULARIZERS)
    with forced_kernel_path(kernel):
        padded, padded_grads = loss_and_gradients(model, objective, padded_loss, batch)
        bucketed, bucketed_grads = loss_and_gradients(model, objective, pair_loss, laid)
    assert set(padded) == set(bucketed) >= {"task", "load_balance", "z_loss", "dpsl", "eesd", "total"}
    for name in padded:
        # float32 sums of a few hundred terms in another order; measured on this VM: 9e-8 relative at most
        assert bucketed[name] == pytest.approx(padded[name], rel=1e-5, abs=1e-7), name
    assert set(padded_grads) == set(bucketed_grads)
    for name, g in padded_grads.items():
        # measured on this VM: 3e-6 of the largest entry at most; the attention key biases' gradients are zero up
        # to ~1e-11 of rounding (softmax ignores a shift of every key), which the 1e-8 absolute term takes
        scale = float(g.abs().max()) + 1e-12
        assert float((bucketed_grads[name] - g).abs().max()) <= 1e-4 * scale + 1e-8, name


def test_moe_layers_route_and_compute_only_the_real_tokens():
    model, tok = upcycled_bert(), tokenizer()
    batch = PairBatches(tok, toy_pairs(64), 16, seed=0, max_length=64).batch(0)
    laid = lay_out_pairs(batch, overhead=64)
    real = int(batch["attention_mask"].sum())
    computed: dict[str, int] = {}
    for name, layer in moe_layers(model).items():
        def count(module, args, name=name):
            computed[name] = computed.get(name, 0) + args[0].shape[0]
        layer.experts.register_forward_pre_hook(count)
    pair_loss(model, laid, 0.05)
    # every layer's experts saw exactly the real tokens (their slots: k per token), no padding position
    assert computed and set(computed.values()) == {real}
    for layer in moe_layers(model).values():
        assert layer.last_record.logits_TE.shape[0] == real and layer.last_record.mask_T is None
    assert real < laid["positions"] < batch["attention_mask"].numel()


def test_padding_positions_get_no_expert_output_and_real_ones_are_unchanged():
    g = torch.Generator().manual_seed(0)
    E, D, F_ = 4, 16, 32
    weights = FFNWeights(w_up=torch.randn(E, F_, D, generator=g), b_up=torch.randn(E, F_, generator=g),
                         w_down=torch.randn(E, D, F_, generator=g), b_down=torch.randn(E, D, generator=g),
                         activation="gelu")
    layer = MoELayer.from_init(weights, torch.randn(E, D, generator=g), config=MoEConfig(num_experts=E, top_k=2))
    x = torch.randn(3, 5, D, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    with padding_mask(mask):
        full = layer(x)
        with real_tokens(mask, real_positions(mask)):
            real = layer(x)
    keep = mask.bool()
    # the same rows through the same kernels: equal on this VM (atol 1e-6 against outputs of size ~50)
    assert torch.allclose(real[keep], full[keep], atol=1e-6) and bool((real[~keep] == 0).all())


def test_the_bucket_plan_is_the_least_cost_cut():
    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0, 3, 10, 40])
        plan = bucket_plan(lengths, overhead)
        assert sorted(int(i) for c in plan for i in c) == list(range(len(lengths)))
        cost = positions_computed(lengths, plan) + overhead * len(plan)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(                           # every cut of the sorted texts into contiguous chunks
            sum(len(order[a:b]) * max(lengths[i] for i in order[a:b]) + overhead for a, b in
                zip((0, *cuts), (*cuts, len(order)), strict=True))
            for r in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), r))
        assert cost == best, (lengths, overhead)
    assert len(bucket_plan([3, 1, 3, 2, 1], 0)) == 3               # no overhead: a chunk per length
    assert len(bucket_plan([3, 1, 3, 2, 1], 10**6)) == 1           # a huge one: the whole batch, padded
    assert [c.tolist() for c in bucket_plan([3, 1, 3, 2, 1], math.inf)] == [[1, 4, 3, 0, 2]]


def test_batch_tables_match_the_tokenizer_and_negatives_are_checked_per_epoch():
    tok, pairs = tokenizer(), toy_pairs(48)
    batches = PairBatches(tok, pairs, 8, seed=3, max_length=64)
    batch = batches.batch(5)
    picked = batches._order(0)[5 * 8:6 * 8].tolist()
    for row, i in enumerate(picked):
        for side, text in enumerate((pairs.queries[i], pairs.documents[i])):
            ids = tok(text, truncation=True, max_length=64)["input_ids"]
            n = int(batch["attention_mask"][row, side].sum())
            assert batch["input_ids"][row, side, :n].tolist() == ids and n == len(ids)
    assert int(batch["attention_mask"].sum(-1).max()) == batch["input_ids"].shape[-1]      # trimmed


def test_a_biased_moe_backward_runs_no_index_put():
    g = torch.Generator().manual_seed(0)
    E, D, F_ = 4, 16, 32
    weights = FFNWeights(w_gate=torch.randn(E, F_, D, generator=g), w_up=torch.randn(E, F_, D, generator=g),
                         b_gate=torch.randn(E, F_, generator=g), b_up=torch.randn(E, F_, generator=g),
                         w_down=torch.randn(E, D, F_, generator=g), b_down=torch.randn(E, D, generator=g),
                         activation="silu")
    layer = MoELayer.from_init(weights, torch.randn(E, D, generator=g), config=MoEConfig(num_experts=E, top_k=2))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    for kernel in ("grouped_mm", "loop"):
        layer.zero_grad(set_to_none=True)
        with forced_kernel_path(kernel):
            y = layer(torch.randn(40, D, generator=g))
        with Ops() as seen:
            y.square().sum().backward()
        assert seen.names and not [n for n in seen.names if "index_put" in n], kernel
        assert layer.experts.b_in.grad is not None and layer.experts.b_down.grad is not None


def test_segment_bias_gradient_is_each_experts_sum():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 5, generator=g, requires_grad=True)
    b = torch.randn(3, 5, generator=g, requires_grad=True)
    expert = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2])
    up = torch.randn(9, 5, generator=g)
    (SegmentBias.apply(x, b, expert) * up).sum().backward()
    assert torch.equal(x.grad, up)
    expected = torch.stack([up[expert == e].sum(0) for e in range(3)])
    assert torch.allclose(b.grad, expected, atol=1e-6)


def test_batches_made_ahead_are_the_ones_asked_for_and_errors_come_at_their_step():
    made = []

    def make(step):
        made.append(step)
        if step == 3:
            raise UpcycleError("step 4 is bad")
        return {"step": step}

    with BatchesAhead(make, end=6) as ahead:
        assert ahead.get(0) == {"step": 0} and ahead.get(1) == {"step": 1}
        assert ahead.get(2) == {"step": 2}           # step 3 is being made now, and fails
        with pytest.raises(UpcycleError, match="step 4"):
            ahead.get(3)
        assert ahead.get(5) == {"step": 5}           # out of turn: made when asked
    assert made[:4] == [0, 1, 2, 3]


def test_processes_on_one_machine_share_its_cores(monkeypatch):
    from upcycle.training.parallel import accelerator

    before = torch.get_num_threads()
    monkeypatch.setattr(accelerator, "usable_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RAYON_RS_NUM_CPUS", "7")      # a setting given stays
    try:
        assert accelerator.share_cores(3) == 5 and torch.get_num_threads() == 5
        assert accelerator.share_cores(32) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")    # an explicit setting wins
        assert accelerator.share_cores(3) == 2
        assert __import__("os").environ["RAYON_RS_NUM_CPUS"] == "7"
    finally:
        torch.set_num_threads(before)


def test_each_pytest_worker_computes_on_its_share_of_the_cores():
    from conftest import worker_threads

    assert worker_threads(16, 14) == 1 and worker_threads(16, 4) == 4 and worker_threads(2, 8) == 1
    cores = len(__import__("os").sched_getaffinity(0))
    workers = int(__import__("os").environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = worker_threads(cores, workers)
    # the setting that every later run in this worker reads (a training run's share_cores, a subprocess's torch)
    assert int(__import__("os").environ["OMP_NUM_THREADS"]) <= share and torch.get_num_threads() <= share
