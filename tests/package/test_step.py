"""One training step: `upcycle train`'s loop runs `upcycle.training.step.train_step`, the function
a script calls, and both compute the same update; a non-finite step changes nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch

import upcycle
import upcycle.training.trainer as trainer
from upcycle.checkpoint.loading import load_tokenizer
from upcycle.config import RegularizerConfig, TrainConfig
from upcycle.tasks.causal_lm import causal_lm_loss
from upcycle.tasks.make import make_task
from upcycle.training.loss.objective import Objective
from upcycle.training.step import StepSetup, train_step

REGULARIZERS = RegularizerConfig(load_balance=0.01, z_loss=0.001, eesd=0.1, eesd_beta=0.9, aux_free_rate=1e-3)


def test_a_script_step_is_the_step_upcycle_train_runs(tiny_lm, tmp_path, monkeypatch):
    """The same batches through `upcycle train` (Accelerate, grad_accum 2) and through `train_step` on plain torch
    (docs/training.md's example) give bit-identical loss terms, token counts and weights: one code path."""
    _, moe, train_txt, _ = tiny_lm
    cfg = TrainConfig(model=str(moe), data=str(train_txt), steps=3, batch_size=4, grad_accum=2, sequence_length=16,
                      lr=3e-3, warmup=0.0, schedule="constant", clip_grad=None, mixed_precision="no",
                      regularizers=REGULARIZERS)
    calls = []
    monkeypatch.setattr(trainer, "train_step", lambda *a, **kw: calls.append(kw["step"]) or train_step(*a, **kw))
    trainer.train(cfg, tmp_path / "run", progress=False)
    assert calls == [0, 1, 2]
    logged = [row for row in map(json.loads, (tmp_path / "run" / "log.jsonl").read_text().splitlines())
              if "loss" in row]
    assert len(logged) == 3

    model = upcycle.load(moe)
    task = make_task(cfg, model, load_tokenizer(moe))
    reg = Objective(model, REGULARIZERS)
    # weight_decay 0 as the run's (AdamW's own default is 0.01); one group or two changes nothing per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=0.0)
    for step, row in enumerate(logged):
        batch = task.train.batch(step)
        micro = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
        result = train_step(model, micro, optimizer, reg)
        assert result.skipped is None
        assert result.loss == row["loss"] and result.tokens == row["tokens"] and result.lr == row["lr"]
        assert result.grad_norm == row["grad_norm"]
    ours, theirs = model.state_dict(), upcycle.load(tmp_path / "run" / "model").state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_nonfinite_step_updates_nothing(tiny_lm):
    """A NaN loss: no weight, EMA teacher or aux-free bias moves, no gradient is left, and the result says why."""
    _, moe, _, _ = tiny_lm
    model = upcycle.load(moe)
    reg = Objective(model, REGULARIZERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    teacher = [p.clone() for p in reg.teacher._teacher_params]

    result = train_step(model, batch, optimizer, reg,
                        StepSetup(task_loss=lambda m, b: causal_lm_loss(m, b) * math.nan))
    assert result.skipped is not None and result.skipped.startswith("task loss nan")
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())   # selection biases included
    assert all(torch.equal(a, b) for a, b in zip(teacher, reg.teacher._teacher_params, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert all(counts.sum() == 0 for counts in reg.balancer.counts.values())

    fine = train_step(model, batch, optimizer, reg)          # the next finite step trains as usual
    assert fine.skipped is None and math.isfinite(fine.loss["total"]) and fine.tokens == 32
    assert any(not torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_the_step_reports_the_norm_before_clipping(tiny_lm, clip):
    """`grad_norm` is the norm before clipping; with clip_grad the update uses gradients scaled to that norm."""
    _, moe, _, _ = tiny_lm
    model = upcycle.load(moe)
    reg = Objective(model, RegularizerConfig())
    seen = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = lambda: [p.grad.norm() for p in model.parameters() if p.grad is not None]  # noqa: E731
    optimizer.register_step_pre_hook(lambda *_: seen.append(float(torch.linalg.vector_norm(torch.stack(grads())))))
    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(1))
    result = train_step(model, {"input_ids": ids}, optimizer, reg, StepSetup(clip_grad=clip))
    assert result.grad_norm > 1e-2 and result.tokens == 32        # no mask: every id counts
    # float32 norms of the same gradients: equal to a few ulps
    assert seen[0] == pytest.approx(result.grad_norm if clip is None else clip, rel=1e-5)
