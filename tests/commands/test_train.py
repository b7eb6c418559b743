"""`upcycle train`: exact resume, freezing schedules, LR schedule, clean Ctrl-C, errors, and a 2-process
`accelerate launch` (gloo) that computes what one process with the same global batch computes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import upcycle_command
from upcycle.config import FreezeRule, RegularizerConfig, TrainConfig
from upcycle.config_reader import RECIPES
from upcycle.errors import UpcycleError
from upcycle.runs.layout import checkpoints
from upcycle.training.freezing import Freezer
from upcycle.training.schedule import lr_factor
from upcycle.training.trainer import train

BIN = Path(sys.executable).parent
TIMING = ("tokens_per_s", "seconds")


def _cfg(moe: Path, train_txt: Path, held: Path, **overrides) -> TrainConfig:
    base = dict(model=str(moe), data=str(train_txt), eval_data=str(held), steps=6, batch_size=8,
                sequence_length=32, lr=3e-3, warmup=0.2, eval_tokens=256,
                regularizers=RegularizerConfig(load_balance=0.01, z_loss=0.001, eesd=0.1, eesd_beta=0.9,
                                               aux_free_rate=1e-3, dpsl=0.01))
    base.update(overrides)
    return TrainConfig(**base)


def _log(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_resume_continues_the_same_run(tiny_lm, tmp_path):
    """N steps straight == N/2, stop, resume, N/2: same losses every step, same final weights, same EMA teacher
    and aux-free biases (they are in the loss and in the weights), across a freezing rule that ends mid-run."""
    _, moe, train_txt, held = tiny_lm
    cfg = _cfg(moe, train_txt, held, freeze=(FreezeRule(params=("experts_in",), until=0.5),))
    straight = train(cfg, tmp_path / "a", progress=False)
    first = train(cfg, tmp_path / "b", stop_after=3, progress=False)
    assert first["step"] == 3 and "model" not in first and checkpoints(tmp_path / "b")[-1].name == "step-0000003"
    resumed = train(cfg, tmp_path / "b", resume=True, progress=False)
    assert resumed["step"] == straight["step"] == 6
    log_a, log_b = _log(tmp_path / "a"), _log(tmp_path / "b")
    assert log_a == log_b                                  # every loss term, lr, grad norm and routing stat
    assert {"load_balance", "z_loss", "eesd", "dpsl", "task", "total"} <= set(log_a[1]["loss"])
    assert log_a[1]["frozen_rules"] == [0] and log_a[-2]["frozen_rules"] == []
    wa, wb = _weights(tmp_path / "a" / "model"), _weights(tmp_path / "b" / "model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(k.endswith("selection_bias") and wa[k].abs().sum() > 0 for k in wa)   # aux-free biases moved
    assert straight["eval_after"]["perplexity"] < straight["eval_before"]["perplexity"]
    # resuming a finished run: nothing to do and nothing written (no second evaluation line, no new checkpoint)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")}
    again = train(cfg, tmp_path / "b", resume=True, progress=False)
    assert again["finished_before"] is True and again["step"] == 6
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")} == before


def test_spri_two_stage_freezing(tiny_lm, tmp_path):
    """train: [routed] + experts_in frozen for the first half: stage 1 moves only the down projections and the
    router; stage 2 moves gate/up too; the dense rest never moves."""
    _, moe, train_txt, held = tiny_lm
    cfg = _cfg(moe, train_txt, held, steps=4, train=("routed",), regularizers=RegularizerConfig(load_balance=0.01),
               freeze=(FreezeRule(params=("experts_in",), until=0.5),))
    start = _weights(moe)
    train(cfg, tmp_path / "run", stop_after=2, progress=False)
    mid = _weights(checkpoints(tmp_path / "run")[-1])
    train(cfg, tmp_path / "run", resume=True, progress=False)
    end = _weights(tmp_path / "run" / "model")
    moved = {k for k in start if not torch.equal(start[k], mid[k])}
    assert moved and all(k.endswith(("experts.w_down", "router.weight")) for k in moved)
    assert any(k.endswith("experts.w_down") for k in moved) and any(k.endswith("router.weight") for k in moved)
    moved_end = {k for k in start if not torch.equal(start[k], end[k])}
    assert any(k.endswith("experts.w_gate_up") for k in moved_end)
    assert all(".mlp." in k for k in moved_end)            # attention, norms, embeddings: untouched


def test_row_groups_stay_frozen_under_weight_decay(tiny_lm):
    """experts_gate freezes the gate rows of the fused [gate; up] tensor, weight decay included."""
    from upcycle import load

    _, moe, _, _ = tiny_lm
    model = load(moe).train()
    freezer = Freezer(model, ("all",), (FreezeRule(params=("experts_gate",), until=1.0),), total_steps=5)
    w = next(p for n, p in model.named_parameters() if n.endswith("experts.w_gate_up"))
    F_ = w.shape[1] // 2
    before = w.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for step in range(2):
        model(input_ids=torch.randint(4, 25, (2, 16))).logits.square().mean().backward()
        freezer.before_step(step)
        opt.step()
        freezer.after_step()
        opt.zero_grad()
    assert torch.equal(w[:, :F_], before[:, :F_]) and not torch.equal(w[:, F_:], before[:, F_:])


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup=0.1, lr=1.0, schedule="linear", min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    cos = TrainConfig(steps=100, warmup=0.0, schedule="cosine")
    assert lr_factor(50, cos) == pytest.approx(0.5) and lr_factor(0, cos) == pytest.approx(1.0)


def test_refusals(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    cfg = _cfg(moe, train_txt, held, steps=2)
    (tmp_path / "none").mkdir()
    with pytest.raises(UpcycleError, match="no run_config"):
        train(cfg, tmp_path / "none", resume=True, progress=False)
    train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(UpcycleError, match="already exists"):
        train(cfg, tmp_path / "run", progress=False)
    with pytest.raises(UpcycleError, match="lr differ"):
        train(_cfg(moe, train_txt, held, steps=2, lr=1.0), tmp_path / "run", resume=True, progress=False)
    with pytest.raises(UpcycleError, match="neither a group"):
        train(_cfg(moe, train_txt, held, train=("experst",)), tmp_path / "x", progress=False)
    with pytest.raises(UpcycleError, match="divisible"):
        train(_cfg(moe, train_txt, held, grad_accum=3), tmp_path / "y", progress=False)
    with pytest.raises(UpcycleError, match="no MoE layers"):
        train(_cfg(tiny_lm[0], train_txt, held, train=("router",)), tmp_path / "z", progress=False)


def _env() -> dict:
    # one thread per process in both runs, so the two runs' matmuls round the same way
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


ARGS = ["--steps", "6", "--batch-size", "8", "--sequence-length", "32", "--lr", "3e-3", "--quiet",
        "--set", "regularizers.load_balance=0.01", "--set", "regularizers.aux_free_rate=0.001",
        "--set", "eval_tokens=256"]


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_two_process_accelerate_launch_matches_one_process(tiny_lm, tmp_path):
    """2 gloo processes x 4 rows == 1 process x 2 micro-batches of 4 rows: the same global batch, micro-batches
    and gradient average, so the same losses, router losses and aux-free updates at every step."""
    _, moe, train_txt, held = tiny_lm
    data = ["--data", str(train_txt), "--eval-data", str(held)]
    one = subprocess.run([*upcycle_command(), "train", str(moe), str(tmp_path / "one"), *data, *ARGS,
                          "--grad-accum", "2"], env=_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "-m", "upcycle.cli", "train", str(moe), str(tmp_path / "two"), *data, *ARGS],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    log1, log2 = _log(tmp_path / "one"), _log(tmp_path / "two")
    assert len(log1) == len(log2) == 8                      # eval, 6 steps, eval: one writer
    for a, b in zip(log1, log2, strict=True):
        if "loss" in a:
            assert a["tokens"] == b["tokens"] == 256
            for k in a["loss"]:
                assert a["loss"][k] == pytest.approx(b["loss"][k], rel=1e-6, abs=1e-7), (a["step"], k)
    w1, w2 = _weights(tmp_path / "one" / "model"), _weights(tmp_path / "two" / "model")
    assert all(torch.allclose(w1[k], w2[k], atol=1e-6) for k in w1)


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_ctrl_c_checkpoints_and_resume_finishes(tiny_lm, tmp_path):
    _, moe, train_txt, held = tiny_lm
    run = tmp_path / "run"
    cmd = [*upcycle_command(), "train", str(moe), str(run), "--data", str(train_txt), "--eval-data", str(held),
           "--steps", "400", "--batch-size", "8", "--sequence-length", "32", "--quiet", "--set", "eval_tokens=256"]
    # Ctrl-C at its default, as a shell starts a command (a pytest worker may have it ignored: inherited)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = run / "log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not log.exists() or log.read_text().count("\n") < 4):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    step = len(_log(run)) - 1                               # minus the step-0 evaluation
    assert 3 <= step < 400 and checkpoints(run)[-1].name == f"step-{step:07d}"
    assert "interrupted at step" in err and not (run / "model").exists()
    done = subprocess.run([*upcycle_command(), "train", str(moe), str(run), "--resume", "--quiet"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [row["step"] for row in _log(run) if "loss" in row]
    assert steps == list(range(1, 401)) and (run / "model" / "model.safetensors").exists()


def test_eval_command_matches_the_runs_final_evaluation(tiny_lm, tmp_path, capsys):
    from upcycle.cli import main

    _, moe, train_txt, held = tiny_lm
    summary = train(_cfg(moe, train_txt, held, steps=2), tmp_path / "run", progress=False)
    assert main(["eval", str(tmp_path / "run"), "--data", str(held), "--tokens", "256",
                 "--sequence-length", "32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "causal_lm" and result["model"].endswith("model")
    assert result["perplexity"] == pytest.approx(summary["eval_after"]["perplexity"], rel=1e-6)
    assert result["tokens"] == summary["eval_after"]["tokens"]


def test_a_mixed_precision_runs_evaluations_compute_in_float32_as_eval_does(tiny_lm, tmp_path, capsys):
    """Accelerate wraps the prepared model's forward in autocast, and the run evaluates that model: its
    evaluations switch autocast off, so that `upcycle eval` of the saved model (float32) gives the same number.
    bfloat16 autocast on the CPU stands in for a GPU's mixed precision: evaluated under it, the run's perplexity
    was 113.6827 against eval's 113.6838 here (9e-6 relative, nine times the bound); without it the two compute
    the same float32 operations on the same weights."""
    from upcycle.cli import main

    _, moe, train_txt, held = tiny_lm
    summary = train(_cfg(moe, train_txt, held, steps=2, mixed_precision="bf16"), tmp_path / "run", progress=False)
    assert main(["eval", str(tmp_path / "run"), "--data", str(held), "--tokens", "256", "--sequence-length", "32",
                 "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"] == pytest.approx(summary["eval_after"]["perplexity"], rel=1e-6)


def test_eval_refuses_a_device_that_is_not_there_before_claiming_its_output(tmp_path, capsys):
    from upcycle.cli import main

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    assert main(["eval", "default", "--device", "cuda", "--out", str(tmp_path / "r.json")]) != 0
    assert "cuda" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("groups, expected", [(("router",), ("router.weight",)),
                                              (("experts",), ("experts.w_gate_up", "experts.w_down")),
                                              (("*.self_attn.q_proj.weight",), ("q_proj.weight",))])
def test_train_selects_only_the_named_parameters(tiny_lm, groups, expected):
    from upcycle import load

    _, moe, _, _ = tiny_lm
    model = load(moe)
    freezer = Freezer(model, groups, (), total_steps=10)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(freezer.trainable) and trainable
    assert all(n.endswith(expected) for n in trainable)
    assert all(any(n.endswith(suffix) for n in trainable) for suffix in expected)


@pytest.mark.parametrize("recipe", sorted((RECIPES / "train").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_train_recipes_are_valid(recipe):
    from upcycle.config_reader import build, load_recipe

    cfg = build(TrainConfig, load_recipe(recipe))      # raises for a key out of its range or choices
    assert cfg.steps >= 1 and cfg.model


def test_router_losses_only_in_the_warmup_phase(tiny_lm, tmp_path):
    """regularizers.router_until = 0.5: router losses in the first half of the steps only; EESD throughout."""
    _, moe, train_txt, held = tiny_lm
    regs = RegularizerConfig(load_balance=0.01, dpsl=0.01, eesd=0.1, eesd_beta=0.9, router_until=0.5)
    train(_cfg(moe, train_txt, held, steps=4, regularizers=regs), tmp_path / "run", progress=False)
    terms = [set(row["loss"]) for row in _log(tmp_path / "run") if "loss" in row]
    assert terms[:2] == [{"task", "load_balance", "dpsl", "eesd", "total"}] * 2
    assert terms[2:] == [{"task", "eesd", "total"}] * 2


def test_resuming_a_run_folder_that_does_not_exist_says_so(tiny_lm, tmp_path):
    from upcycle.errors import UpcycleError

    _, moe, train_txt, held = tiny_lm
    with pytest.raises(UpcycleError, match=r"cannot resume: .*missing does not exist \(--resume continues a run "
                                           r"folder"):
        train(_cfg(moe, train_txt, held, steps=2), tmp_path / "missing", resume=True, progress=False)
    assert not (tmp_path / "missing").exists()
