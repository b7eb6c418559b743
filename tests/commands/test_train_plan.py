"""`training.run_plan.make_train_plan`: a run's decisions made once, before any weight loads; `--dry-run` prints the
value the loop then consumes."""

from __future__ import annotations

import pytest

from upcycle.cli import main
from upcycle.training import trainer
from upcycle.training.run_plan import make_train_plan

FLAGS = ["--steps", "2", "--batch-size", "4", "--grad-accum", "2", "--sequence-length", "32", "--quiet"]


def test_the_printed_plan_is_the_plan_the_run_consumes(tiny_lm, tmp_path, capsys, monkeypatch):
    _, moe, train, held = tiny_lm
    out = tmp_path / "run"
    argv = ["train", str(moe), str(out), "--data", str(train), "--eval-data", str(held), *FLAGS]
    assert main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert main([*argv, "--plan"]) == 0 and capsys.readouterr().out == printed      # the older name, the same
    assert not out.exists()
    planned, micro = [], []
    real_plan, real_init = trainer.make_train_plan, trainer._Training.__init__

    def recorded(*args, **kwargs):
        planned.append(real_plan(*args, **kwargs))
        return planned[-1]

    def training(self, plan, *args):
        real_init(self, plan, *args)
        micro.append(self.micro)

    monkeypatch.setattr(trainer, "make_train_plan", recorded)
    monkeypatch.setattr(trainer._Training, "__init__", training)
    assert main(argv) == 0
    plan = planned[0]
    assert plan.describe() in printed           # the same value (--dry-run also printed each checkpointing mode)
    assert plan.task == "causal_lm" and plan.micro_batch == 2 and micro == [2]     # 4 rows, 1 process, 2 micro
    assert f"into {out}: a new run folder" in printed


def test_plan_says_an_existing_out_would_be_refused_and_leaves_it(tiny_lm, tmp_path, capsys):
    _, moe, train, _ = tiny_lm
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    assert main(["train", str(moe), str(out), "--data", str(train), *FLAGS, "--plan"]) == 0
    printed = capsys.readouterr().out
    assert "refused: output" in printed and "already exists" in printed
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    plan = make_train_plan(trainer_cfg(moe, train), out, printing=True)
    assert plan.out_refused is not None and "already exists" in plan.out_refused


def test_the_run_itself_is_refused_by_its_plan(tiny_lm, tmp_path):
    from upcycle.errors import UpcycleError

    _, moe, train, _ = tiny_lm
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    with pytest.raises(UpcycleError, match="already exists"):
        make_train_plan(trainer_cfg(moe, train), out)
    with pytest.raises(UpcycleError, match="divisible by processes x grad_accum"):
        make_train_plan(trainer_cfg(moe, train, batch_size=3, grad_accum=2), tmp_path / "new")


def trainer_cfg(model, data, **keys):
    from upcycle.config import TrainConfig

    return TrainConfig(**{"model": str(model), "data": str(data), "steps": 2, "batch_size": 4, "sequence_length": 32,
                          **keys})
