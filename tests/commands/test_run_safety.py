"""What `--resume` and a run that fails may and may not do: a run folder from someone else is data and never code,
a failed or diverged run leaves OUT as it was or at its last good checkpoint, and torn checkpoints and logs fall
back to what is complete. (What `--overwrite` may replace: tests/commands/test_overwrite.py.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import train_config
from upcycle.cli import main
from upcycle.errors import UpcycleError
from upcycle.runs import checkpoint_format
from upcycle.runs.layout import checkpoints
from upcycle.training.run import state as run_state
from upcycle.training.stopping import TrainingStopped
from upcycle.training.trainer import train

RUN = ["--steps", "2", "--batch-size", "4", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=64"]


class _Payload:
    """Unpickling this runs os.mkdir(marker): proof that a file was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_resume_never_runs_code_from_the_run_folder(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    cfg = train_config(moe, train_txt, held)
    run = tmp_path / "run"
    train(cfg, run, stop_after=2, progress=False)
    marker = tmp_path / "pwned"
    # 1. a crafted optimizer.pt, with the manifest rewritten to match it: torch.load(weights_only=True) refuses it
    ckpt = checkpoints(run)[-1]
    torch.save({"state": _Payload(marker), "param_groups": []}, ckpt / "optimizer.pt")
    checkpoint_format.write_manifest(ckpt, step=2, processes=1)
    with pytest.raises(UpcycleError, match="not plain tensor data"):
        train(cfg, run, resume=True, progress=False)
    assert not marker.exists()
    # 2. an Accelerate-style checkpoint (custom_checkpoint_0.pkl and friends) is never loaded
    shutil.rmtree(ckpt)
    ckpt.mkdir()
    torch.save(_Payload(marker), ckpt / "custom_checkpoint_0.pkl")
    torch.save(_Payload(marker), ckpt / "random_states_0.pkl")
    with pytest.raises(UpcycleError, match="never unpickled"):
        train(cfg, run, resume=True, progress=False)
    assert not marker.exists()


def test_resume_falls_back_past_a_torn_checkpoint_and_log_line(tiny_lm, tmp_path, capsys):
    """Truncate the newest checkpoint and tear the log's last line: resume continues from the previous complete
    checkpoint and ends with exactly the log and weights of an uninterrupted run."""
    _, moe, train_txt, held = tiny_lm
    cfg = train_config(moe, train_txt, held, checkpoint_every=1, keep_checkpoints=2)
    train(cfg, tmp_path / "straight", progress=False)
    run = tmp_path / "run"
    train(cfg, run, stop_after=3, progress=False)
    assert [c.name for c in checkpoints(run)] == ["step-0000002", "step-0000003"]
    weights = checkpoints(run)[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with (run / "log.jsonl").open("a") as log:
        log.write('{"step": 4, "lo')
    capsys.readouterr()
    train(cfg, run, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "skipped checkpoint step-0000003" in err and "resuming from step-0000002" in err
    # the torn checkpoint, passed again, is replaced: the run's record proves its other files upcycle's (they go);
    # only the file changed since it was written is kept aside, as the user's may be
    (kept,) = (run / "checkpoints").glob("step-0000003.kept-*")
    assert sorted(p.name for p in kept.iterdir()) == ["model.safetensors"]
    assert "is kept in" in err

    def log(folder):
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "seconds")}
                for line in (folder / "log.jsonl").read_text().splitlines()]

    assert log(run) == log(tmp_path / "straight")
    from safetensors.torch import load_file
    a, b = load_file(run / "model" / "model.safetensors"), load_file(tmp_path / "straight" / "model" /
                                                                      "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_verification_names_what_is_wrong(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    run = tmp_path / "run"
    train(train_config(moe, train_txt, held), run, stop_after=1, progress=False)
    ckpt = checkpoints(run)[-1]
    assert checkpoint_format.problem(ckpt, processes=1) is None
    assert "this run has 2 process" in checkpoint_format.problem(ckpt, processes=2)
    data = bytearray((ckpt / "trainer.json").read_bytes())
    data[-2] ^= 1                                           # same size, one bit flipped
    (ckpt / "trainer.json").write_bytes(bytes(data))
    assert "hash" in checkpoint_format.problem(ckpt, processes=1)
    (ckpt / "manifest.json").unlink()
    assert "no manifest" in checkpoint_format.problem(ckpt, processes=1)
    with pytest.raises(UpcycleError, match="no complete checkpoint"):
        train(train_config(moe, train_txt, held), run, resume=True, progress=False)


def _failing_loss(monkeypatch, at_call: int, failure):
    """Make the causal-LM loss return NaN (or raise) on its `at_call`-th call (1-based)."""
    import upcycle.tasks.causal_lm as causal_lm

    real, calls = causal_lm.causal_lm_loss, {"n": 0}

    def loss(model, batch):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(batch["input_ids"], FakeTensor):      # the memory plan's steps, on fake tensors
            return real(model, batch)
        calls["n"] += 1
        value = real(model, batch)
        if calls["n"] == at_call:
            if isinstance(failure, type) and issubclass(failure, BaseException):
                raise failure
            return value * failure
        return value

    monkeypatch.setattr(causal_lm, "causal_lm_loss", loss)


def test_diverged_run_stops_and_keeps_the_last_good_checkpoint(tiny_lm, tmp_path, monkeypatch):
    _, moe, train_txt, held = tiny_lm
    _failing_loss(monkeypatch, 3, float("nan"))
    run = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"step 3: task loss nan.*keeps checkpoint step-0000002"):
        train(train_config(moe, train_txt, held, checkpoint_every=1), run, progress=False)
    assert checkpoints(run)[-1].name == "step-0000002" and not (run / "model").exists()
    assert checkpoint_format.problem(checkpoints(run)[-1], processes=1) is None
    weights = run_state.load_file(str(checkpoints(run)[-1] / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_diverged_run_before_any_checkpoint_writes_nothing(tiny_lm, tmp_path, monkeypatch):
    _, moe, train_txt, held = tiny_lm
    _failing_loss(monkeypatch, 2, float("inf"))
    with pytest.raises(TrainingStopped, match="nothing was written"):
        train(train_config(moe, train_txt, held), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_nonfinite_steps_are_skipped_when_asked(tiny_lm, tmp_path, monkeypatch):
    _, moe, train_txt, held = tiny_lm
    _failing_loss(monkeypatch, 2, float("nan"))
    summary = train(train_config(moe, train_txt, held, on_nonfinite="skip"), tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    skipped = [row for row in rows if "skipped" in row]
    assert summary["skipped_steps"] == 1 and [row["step"] for row in skipped] == [2]
    assert "task loss nan" in skipped[0]["skipped"]
    assert [row["step"] for row in rows if "loss" in row] == [1, 3, 4]
    assert summary["eval_after"]["perplexity"] < float("inf")


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--lr", "-1"), ("--warmup", "1.5"),
                                         ("--set", "regularizers.load_balance=-0.1"), ("--set", "betas=[0.9, 1.0]"),
                                         ("--set", "regularizers.eesd_beta=.nan")])
def test_settings_out_of_range_are_refused(tiny_lm, tmp_path, capsys, flag, value):
    assert main(["train", str(tiny_lm[1]), str(tmp_path / "run"), "--data", str(tiny_lm[2]), *RUN, flag, value]) == 2
    assert "must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_failed_start_leaves_no_run_folder(tiny_lm, tmp_path, monkeypatch, capsys):
    _, moe, train_txt, held = tiny_lm
    run = tmp_path / "run"
    assert main(["train", str(moe), str(run), "--data", str(train_txt), "--train", "experst", *RUN]) == 2
    assert not run.exists()
    # Ctrl-C before the first checkpoint: nothing was written, and it says so
    _failing_loss(monkeypatch, 1, KeyboardInterrupt)
    assert main(["train", str(moe), str(run), "--data", str(train_txt), *RUN]) == 130
    assert "nothing was written" in capsys.readouterr().err and not run.exists()
    monkeypatch.undo()
    assert main(["train", str(moe), str(run), "--data", str(train_txt), *RUN]) == 0   # no --resume needed


def test_an_abort_after_a_checkpoint_says_what_was_kept(tiny_lm, tmp_path, monkeypatch, capsys):
    _, moe, train_txt, _ = tiny_lm
    _failing_loss(monkeypatch, 3, KeyboardInterrupt)          # a second Ctrl-C in step 3
    run = tmp_path / "run"
    assert main(["train", str(moe), str(run), "--data", str(train_txt), *RUN, "--steps", "4",
                 "--checkpoint-every", "1"]) == 130
    err = capsys.readouterr().err
    assert "keeps checkpoint step-0000002" in err and "nothing was written" not in err
    assert checkpoints(run)[-1].name == "step-0000002"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path, capsys):
    from conftest import make_tiny

    model = tmp_path / "m"
    make_tiny("gpt2").save_pretrained(model)
    host = socket.gethostname()
    stale = tmp_path / f".out.tmp-{host}-{_dead_pid()}-abc123"      # what SIGKILL during the final write leaves
    live = tmp_path / f".out.tmp-{host}-{os.getpid()}-def456"       # another run of ours still writing
    foreign = tmp_path / ".out.tmp-zz9plural-1-xyz"                 # another host's
    for folder in (stale, live, foreign):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    assert main(["convert", str(model), str(tmp_path / "out"), "--num-experts", "2", "--top-k", "1",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert not stale.exists() and f"removed {stale}" in err
    assert live.exists() and foreign.exists() and f"left {foreign} in place" in err
