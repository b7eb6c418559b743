"""Activation checkpointing (`activation_checkpointing: full | moe`, `upcycle.training.parallel.recompute`): for each
task (causal LM, CLIP, the contrastive pair task) the losses and every gradient equal those without it, and what counts
a forward counts the real one once: the router losses (read from the routing records), the aux-free balancer's
loads and bias update, EESD's teacher pass and its loss. A recomputation that counted again would change the
counts (doubled), the bias, the teacher's token count or the EESD loss, and these tests would fail."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny
from upcycle.config import CheckConfig, ConvertConfig, MoEConfig, RegularizerConfig
from upcycle.conversion.pipeline import upcycle_model
from upcycle.core.routing_context import ROUTING
from upcycle.errors import UpcycleError
from upcycle.training.loss.objective import Objective
from upcycle.training.parallel.recompute import apply_activation_checkpointing

REGULARIZERS = RegularizerConfig(load_balance=0.01, z_loss=0.001, limoe_local=0.01, dpsl=0.01, eesd=0.5,
                                 aux_free_rate=0.01)


def _upcycled(kind: str, experts: str = "full") -> torch.nn.Module:
    model = make_tiny(kind)
    upcycle_model(model, ConvertConfig(method="drop", moe=MoEConfig(num_experts=4, top_k=2, experts=experts,
                                                                    delta_rank=4),
                                       check=CheckConfig(per_layer=False), device="cpu"), progress=False)
    return model


def _causal_lm(model, batch):
    from upcycle.tasks.causal_lm import causal_lm_loss

    return causal_lm_loss(model, batch)


def _clip(model, batch):
    return model(**batch, return_loss=True).loss


def _pairs(model, batch):
    from upcycle.tasks.contrastive import pair_loss

    return pair_loss(model, batch, 0.05)


def _batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if kind == "bert":       # 4 pairs of texts of different lengths: laid out in length-bucketed chunks
        from upcycle.tasks.contrastive import lay_out_pairs

        ids = torch.randint(3, 128, (4, 2, 12), generator=g)
        lengths = torch.tensor([[12, 5], [3, 9], [7, 12], [4, 4]])
        mask = (torch.arange(12)[None, None, :] < lengths[:, :, None]).long()
        return lay_out_pairs({"input_ids": ids * mask, "attention_mask": mask, "doc_index": torch.arange(4),
                              "query_index": torch.arange(4)}, overhead=0)
    ids = torch.randint(3, 128, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[3, 5:] = 0
    if kind == "clip":
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(4, 3, 16, 16, generator=g)}
    return {"input_ids": ids, "attention_mask": mask}


def _step(base: torch.nn.Module, mode: str, loss_fn, batch: dict) -> dict:
    """One forward and backward with the objective, then the teacher's and the balancer's updates: every number
    that a recomputation could count twice."""
    model = copy.deepcopy(base)
    model.train()
    apply_activation_checkpointing(model, mode)
    objective = Objective(model, REGULARIZERS)
    torch.manual_seed(7)           # dropout (CLIP has none; BERT's and GPT-2's would differ without it)
    total, logged = objective.loss(loss_fn(model, batch))
    total.backward()
    counts = {k: v.clone() for k, v in objective.balancer.counts.items()}
    objective.after_optimizer_step()
    return {"loss": {k: float(v) for k, v in logged.items()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "counts": counts, "distilled": objective.teacher.tokens_distilled,
            "bias": {n: b.clone() for n, b in model.named_buffers() if n.endswith("selection_bias")},
            "teacher": {n: p.clone() for layer in objective.teacher.teachers.values()
                        for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("kind, loss_fn, experts", [("llama", _causal_lm, "full"), ("clip", _clip, "full"),
                                                    ("bert", _pairs, "full"), ("llama", _causal_lm, "delta")])
def test_checkpointing_changes_nothing_but_memory(kind, loss_fn, experts):
    """Without early stopping, the recomputation runs each checkpointed part to its end, forward hooks included
    (torch stops it early by default, once the tensors the backward needs are made again, which can leave a hook
    unrun): both ways nothing is counted twice."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    base = _upcycled(kind, experts)
    batch = _batch(kind)
    plain = _step(base, "none", loss_fn, batch)
    assert set(plain["loss"]) == {"task", "load_balance", "z_loss", "limoe_local", "dpsl", "eesd", "total"}
    assert plain["distilled"] > 0 and all(c.sum() > 0 for c in plain["counts"].values())
    for mode, early in (("full", True), ("full", False), ("moe", True), ("moe", False)):
        with set_checkpoint_early_stop(early):
            other = _step(base, mode, loss_fn, batch)
        # the recomputed forward is the same arithmetic on the same inputs: equal, not merely close
        assert other["loss"] == plain["loss"], (mode, early)
        assert other["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(other["grads"][name], grad, rtol=0, atol=0, msg=f"{mode} {name}")
        for key in ("counts", "bias", "teacher"):
            for name, value in plain[key].items():
                assert torch.equal(other[key][name], value), (mode, key, name)
        assert other["distilled"] == plain["distilled"], mode
    assert not ROUTING.recomputing and ROUTING.mask is None


def test_what_each_mode_switches_on():
    model = _upcycled("llama")
    apply_activation_checkpointing(model, "moe")
    layers = [m for m in model.modules() if hasattr(m, "recompute")]
    assert layers and all(m.recompute for m in layers)
    apply_activation_checkpointing(model, "full")
    assert not any(m.recompute for m in layers) and model.model.layers[0].gradient_checkpointing
    apply_activation_checkpointing(model, "none")
    assert not model.model.layers[0].gradient_checkpointing
    with pytest.raises(UpcycleError, match=r"holds none \(it has no MoE layer\); use full"):
        apply_activation_checkpointing(make_tiny("llama"), "moe")
    with pytest.raises(UpcycleError, match="must be one of"):
        apply_activation_checkpointing(model, "some")


def test_checkpointing_keeps_less_for_the_backward():
    """What the forward keeps, counted by saved-tensor hooks on the real model: full keeps the least, moe less
    than none (a test that the modes do recompute, not only that they compute the same)."""
    base = _upcycled("llama")
    batch = _batch("llama")
    kept = {}
    for mode in ("none", "full", "moe"):
        model = copy.deepcopy(base)
        model.train()
        apply_activation_checkpointing(model, mode)
        saved = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _causal_lm(model, batch)
        kept[mode] = sum(saved.values())
    assert kept["full"] < kept["moe"] < kept["none"]
