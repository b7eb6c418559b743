"""Watching a run: `--report-to tensorboard` writes the log's scalars as event files, the trackers wait for a
staged run to become OUT, `upcycle analyze RUN` draws the log's curves, evaluations show progress, and
`upcycle eval` reads the held-out budget training's evaluations read."""

from __future__ import annotations

import inspect
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from upcycle.cli import main
from upcycle.config import EVAL_TOKENS, TrainConfig
from upcycle.config_reader import build
from upcycle.errors import UpcycleError

RUN = ["--steps", "4", "--batch-size", "4", "--sequence-length", "32", "--lr", "3e-3", "--eval-every", "2",
       "--checkpoint-every", "2", "--quiet", "--set", "eval_tokens=64", "--set", "regularizers.load_balance=0.01",
       "--set", "regularizers.z_loss=0.001"]


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _event_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the TensorBoard event files directly in `folder`."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                             reason="reading event files needs tensorboard (the dev extra)")
    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def run(tiny_lm, tmp_path_factory) -> Path:
    """A 4-step run of the tiny MoE with two router losses, evaluations at steps 0, 2 and 4, reported to
    TensorBoard."""
    pytest.importorskip("tensorboard", reason="--report-to tensorboard needs tensorboard (the dev extra)")
    _, moe, train_txt, held = tiny_lm
    out = tmp_path_factory.mktemp("watch") / "run"
    assert main(["train", str(moe), str(out), "--data", str(train_txt), "--eval-data", str(held),
                 "--report-to", "tensorboard", *RUN]) == 0
    return out


def test_tensorboard_event_files_hold_every_logged_scalar(run):
    found = _event_scalars(run / "tensorboard")
    rows = _log(run)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    expected: dict[str, dict[int, float]] = {}
    for r in steps:
        tags = {f"loss/{term}": value for term, value in r["loss"].items()}
        tags |= {"lr": r["lr"], "tokens_per_s": r["tokens_per_s"], "grad_norm": r["grad_norm"]}
        for layer, stats in r["layers"].items():
            tags |= {f"routing/{layer}/entropy": stats["entropy"], f"routing/{layer}/load_cov": stats["load_cov"]}
        for tag, value in tags.items():
            expected.setdefault(tag, {})[r["step"]] = value
    for r in evals:
        for metric in ("perplexity", "nll"):
            expected.setdefault(f"eval/{metric}", {})[r["step"]] = r["eval"][metric]
    # the listed scalars: loss and each regularizer, lr, tokens/s, per-layer routing entropy and load
    assert {"loss/task", "loss/load_balance", "loss/z_loss", "loss/total"} <= set(expected)
    assert sum(tag.startswith("routing/") for tag in expected) == 2 * len(steps[0]["layers"]) > 0
    for tag, by_step in expected.items():
        assert tag in found, tag
        # TensorBoard stores float32: the logged number, rounded once
        assert found[tag] == {s: float(np.float32(v)) for s, v in by_step.items()}, tag


def test_eval_of_a_run_reads_the_runs_own_held_out_budget(run, capsys):
    capsys.readouterr()
    assert main(["eval", str(run), "--quiet"]) == 0        # no --data, --tokens, --sequence-length
    result = json.loads(capsys.readouterr().out)
    last = [r for r in _log(run) if "eval" in r][-1]["eval"]
    assert result["sequence_length"] == 32
    assert result["tokens"] == last["tokens"] == 2 * 31                # eval_tokens 64 = 2 rows of 32
    assert result["perplexity"] == last["perplexity"]                  # the same rows, the same number


def test_one_default_budget_for_eval_and_training():
    from upcycle.tasks.evaluate import evaluate_model, held_out_rows

    assert TrainConfig().eval_tokens == EVAL_TOKENS
    assert inspect.signature(evaluate_model).parameters["tokens"].default == EVAL_TOKENS
    # the recipes' 16,384 tokens in rows of 256: 64 rows predicting 255 tokens each, 16,320
    assert held_out_rows(EVAL_TOKENS, 256) == 64
    assert held_out_rows(65, 32) == 3 and held_out_rows(1, 32) == 1


def test_analyze_run_draws_the_logs_curves(run, tiny_lm, tmp_path):
    from upcycle.analyze.run import AnalyzeOptions, analyze

    _, _, _, held = tiny_lm
    result = analyze(str(run), str(tmp_path / "a"), AnalyzeOptions(data=(str(held),), tokens=64,
                                                                   sequence_length=32, checkpoints="last"),
                     progress=False)
    assert (tmp_path / "a" / "training.png").stat().st_size > 10_000
    assert "training.png" in (tmp_path / "a" / "report.html").read_text()
    saved = json.loads((tmp_path / "a" / "analysis.json").read_text())["training"]
    assert saved == json.loads(json.dumps(result["training"]))
    rows = _log(run)
    steps = [r for r in rows if "loss" in r]
    assert saved["steps"] == [1, 2, 3, 4] and saved["skipped"] == []
    assert saved["lr"] == [r["lr"] for r in steps]
    assert saved["tokens_per_s"] == [r["tokens_per_s"] for r in steps]
    assert saved["loss"] == {term: [r["loss"][term] for r in steps] for term in steps[0]["loss"]}
    assert saved["routing"] == {layer: {stat: [r["layers"][layer][stat] for r in steps]
                                        for stat in ("entropy", "load_cov", "dropped")}
                                for layer in steps[0]["layers"]}
    evals = [r for r in rows if "eval" in r]
    assert saved["eval"]["steps"] == [0, 2, 4]
    assert saved["eval"]["metrics"]["perplexity"] == [r["eval"]["perplexity"] for r in evals]


def test_a_staged_runs_records_reach_the_tracker_once_it_is_out(tmp_path):
    """Records logged before `start` (a run staged beside the OUT it replaces) are sent, in order, at start."""
    pytest.importorskip("tensorboard", reason="the tensorboard tracker needs tensorboard (the dev extra)")
    from upcycle.training.run.trackers import Trackers

    trackers = Trackers("tensorboard", {"lr": 0.1, "train": ["all"], "regularizers": {"z_loss": 0.0}}, enabled=True)
    records = [{"step": 0, "eval": {"perplexity": 9.5, "tokens": 62}},
               {"step": 1, "lr": 0.25, "loss": {"task": 2.5, "total": 2.75}, "frozen_rules": [0],
                "layers": {"model.layers.1.mlp": {"entropy": 1.25, "load_cov": 0.5, "dropped": 0.0}}},
               {"step": 2, "lr": 0.125, "skipped": "task loss nan"}]
    trackers.log(records[0])
    trackers.log(records[1])
    assert not (tmp_path / "tensorboard").exists()          # nothing written before the run is where it stays
    trackers.start(tmp_path)
    trackers.log(records[2])
    trackers.close()
    found = _event_scalars(tmp_path / "tensorboard")
    assert found == {"eval/perplexity": {0: 9.5}, "eval/tokens": {0: 62.0}, "lr": {1: 0.25, 2: 0.125},
                     "loss/task": {1: 2.5}, "loss/total": {1: 2.75}, "skipped": {2: 1.0},
                     "routing/model.layers.1.mlp/entropy": {1: 1.25}, "routing/model.layers.1.mlp/load_cov": {1: 0.5},
                     "routing/model.layers.1.mlp/dropped": {1: 0.0}}


def test_report_to_is_checked_before_anything_is_written(tiny_lm, tmp_path, monkeypatch):
    import importlib.util

    with pytest.raises(UpcycleError, match="report_to must be one of tensorboard, wandb"):
        build(TrainConfig, {"report_to": "mlflow"})
    _, moe, train_txt, _ = tiny_lm
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    from upcycle.training.trainer import train

    with pytest.raises(UpcycleError, match="needs the wandb package"):
        train(TrainConfig(model=str(moe), data=str(train_txt), steps=1, report_to="wandb"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_evaluations_show_a_progress_bar_on_a_terminal(monkeypatch):
    import torch

    from conftest import make_tiny
    from upcycle.tasks.evaluate import perplexity, progress_bars

    model = make_tiny("llama")
    ids = torch.randint(3, 128, (5, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for label, shown in ((None, False), ("eval at step 0", True)):
        terminal = _Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        with progress_bars(label):
            result = perplexity(model, ids, mask, batch_size=2)
        text = terminal.getvalue()
        assert result["tokens"] == 55
        # the bar names the evaluation and its budget, the predicted tokens (it is cleared when done: leave=False)
        assert ("eval at step 0" in text and "0/55 [" in text) if shown else text == ""


def test_wandb_offline_run_is_written_inside_the_run_folder(tmp_path, monkeypatch):
    """report_to wandb with WANDB_MODE=offline: no network, the run lands in OUT/wandb/ holding the scalars."""
    pytest.importorskip("wandb", reason="report_to wandb needs wandb (optional, not in the dev extra)")
    from upcycle.training.run.trackers import Trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = Trackers("wandb", {"lr": 0.25}, enabled=True)
    trackers.start(tmp_path)
    trackers.log({"step": 1, "lr": 0.25, "loss": {"task": 2.5, "z_loss": 0.125}})
    trackers.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wanted = (b"loss/task", b"loss/z_loss", b"lr", b"0.125")   # wandb's record format holds tags and values as text
    deadline = time.monotonic() + 20
    # wandb's service process may still be writing the file when finish() returns (seen once in a few runs)
    while not all(tag in run.read_bytes() for tag in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(tag in run.read_bytes() for tag in wanted)
