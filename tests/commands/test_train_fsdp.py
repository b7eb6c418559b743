"""`upcycle train` under FSDP2: 2 gloo CPU processes (`accelerate launch --use_fsdp --fsdp_version 2`) compute
what 1 process computes, through a checkpoint and a resume, and their checkpoint resumes on 1 process too; the
refusals of what FSDP here does not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from upcycle.errors import UpcycleError
from upcycle.training.parallel import sharding

BIN = Path(sys.executable).parent
TIMING = ("tokens_per_s", "seconds", "layers")   # layers: routing stats of the main process's rows only
# z_loss, EESD and the aux-free bias are sums over tokens, so 2 processes x 4 rows and 1 process x 8 rows
# compute the same step; load_balance and DPSL are not (test_train's DDP test covers them on equal micro-batches)
ARGS = ["--steps", "3", "--batch-size", "8", "--sequence-length", "32", "--lr", "3e-3", "--quiet",
        "--set", "regularizers.z_loss=0.001", "--set", "regularizers.eesd=0.1", "--set", "regularizers.eesd_beta=0.9",
        "--set", "regularizers.aux_free_rate=0.001", "--set", "eval_tokens=256", "--set", "checkpoint_every=2",
        "--set", "keep_checkpoints=2", "--set", "freeze=[{params: [experts_gate], until: 0.5}]"]
FSDP = ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no"]
# 1 process and 2 differ only in float rounding (the order of sums); measured here: equal losses and at most 6e-8
# on any weight or AdamW moment for 2 FSDP processes against 1 process on the same micro-batches, 3e-7 for the
# resume on 1 process (its step 3 is one micro-batch of 8 rows). Rounding differences grow as AdamW divides tiny
# gradients by their root mean square (5e-6 after 3 steps of 1 x 8 rows against 2 x 4), so 1e-5, the bound the
# issue asks for, holds with a margin of 30 here and needs no one CPU's rounding.
ATOL = 1e-5


@pytest.fixture(scope="module")
def tied_moe(tiny_lm, tmp_path_factory):
    """tiny_lm's model with tied input and output embeddings (as SmolLM2, the default model), 4 copied experts."""
    import transformers

    from upcycle import ConvertConfig, MoEConfig, convert

    dense, _, _, _ = tiny_lm
    root = tmp_path_factory.mktemp("tied")
    model = transformers.AutoModelForCausalLM.from_pretrained(dense)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(root / "dense")
    transformers.AutoTokenizer.from_pretrained(dense).save_pretrained(root / "dense")
    convert(ConvertConfig(model=str(root / "dense"), method="copy", moe=MoEConfig(num_experts=4, top_k=2)),
            root / "moe", progress=False)
    from upcycle import load

    tied = load(root / "moe")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    return root / "moe"


def _launch(args: list[str]) -> None:
    """`upcycle` on 2 FSDP2 processes (one thread each, as `_alone`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([str(BIN / "accelerate"), "launch", *FSDP, "-m", "upcycle.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _alone(args: list[str]) -> None:
    """`upcycle` in this process, on one thread, so 1 and 2 processes round their matmuls alike."""
    from upcycle.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)


def _steps(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows if "loss" in row]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=0, atol=ATOL), (k, float((a[k] - b[k]).abs().max()))


def _same_steps(a: list[dict], b: list[dict]) -> None:
    assert [row["step"] for row in a] == [row["step"] for row in b]
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"] == 256 and x["lr"] == y["lr"] and x["frozen_rules"] == y["frozen_rules"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=ATOL)
        assert x["loss"].keys() == y["loss"].keys()
        for k in x["loss"]:
            assert x["loss"][k] == pytest.approx(y["loss"][k], rel=ATOL, abs=1e-9), (x["step"], k)


def _unfinished(run: Path, copy: Path) -> Path:
    """A copy of `run` as it was at its step-2 checkpoint (resuming drops the log lines after it)."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-0000003")
    shutil.rmtree(copy / "model")
    return copy


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_fsdp_two_processes_match_one_process_with_checkpoint_and_resume(tied_moe, tiny_lm, tmp_path):
    """1 process (2 micro-batches of 4 rows) == 2 FSDP processes x 4 rows, 3 steps with a checkpoint at step 2:
    losses, gradient norms, the checkpoint (model, AdamW state, EMA teacher) and the final model, to 1e-5.
    The FSDP run's step-2 checkpoint resumes under FSDP and on 1 process and both finish as the straight run.
    Covers a tied embedding, a row-range freezing rule that ends mid-run, EESD and the aux-free bias."""
    _, _, train_txt, held = tiny_lm
    data = [str(tied_moe), "--data", str(train_txt), "--eval-data", str(held), *ARGS]
    _alone(["train", data[0], str(tmp_path / "one"), *data[1:], "--grad-accum", "2"])
    _launch(["train", data[0], str(tmp_path / "two"), *data[1:]])
    one, two = tmp_path / "one", tmp_path / "two"
    _same_steps(_steps(one), _steps(two))
    assert {"task", "z_loss", "eesd", "total"} == set(_steps(two)[0]["loss"])
    assert [row["frozen_rules"] for row in _steps(two)] == [[0], [0], []]
    for name in ("model", "teacher"):
        _close(load_file(str(one / "checkpoints/step-0000002" / f"{name}.safetensors")),
               load_file(str(two / "checkpoints/step-0000002" / f"{name}.safetensors")))
    adam1, adam2 = (torch.load(r / "checkpoints/step-0000002/optimizer.pt", weights_only=True) for r in (one, two))
    assert adam1["param_groups"] == adam2["param_groups"] and adam1["state"].keys() == adam2["state"].keys()
    for i in adam1["state"]:
        _close(adam1["state"][i], adam2["state"][i])
    final = load_file(str(one / "model" / "model.safetensors"))
    _close(final, load_file(str(two / "model" / "model.safetensors")))
    assert ("lm_head.weight" in final) != ("model.embed_tokens.weight" in final)   # tied: saved once (keys as 1)
    assert any(k.endswith("selection_bias") and final[k].abs().sum() > 0 for k in final)   # the bias moved
    for name in ("config.json", "upcycle_config.json"):
        assert (one / "model" / name).read_text() == (two / "model" / name).read_text()

    # the step-2 checkpoint, resumed under FSDP and on 1 process: step 3 and the final model as the straight run
    again = _unfinished(two, tmp_path / "again")
    _launch(["train", data[0], str(again), "--resume", "--quiet"])
    alone = _unfinished(two, tmp_path / "alone")
    _alone(["train", data[0], str(alone), "--resume", "--quiet"])
    for resumed in (again, alone):
        _same_steps(_steps(one), _steps(resumed))
        _close(final, load_file(str(resumed / "model" / "model.safetensors")))


def test_fsdp_refusals(monkeypatch):
    """FSDP1 is refused by name; a model whose trained weights mix dtypes needs mixed precision under FSDP."""
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(UpcycleError, match="FSDP2 only"):
        sharding.check_version()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    with pytest.raises(UpcycleError, match="mixed_precision: bf16"):
        sharding.check_dtypes(model, "no")
    sharding.check_dtypes(model, "bf16")
    model[1].requires_grad_(False)                         # frozen weights are not reduced: any dtype
    sharding.check_dtypes(model, "no")


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
@pytest.mark.parametrize("launch, mode", [("fsdp2", "full"), ("ddp", "moe")])
def test_activation_checkpointing_under_two_processes(tied_moe, tiny_lm, tmp_path, launch, mode):
    """2 processes (FSDP2 with every block recomputed; DDP with the MoE layers recomputed) compute what 1 process
    without checkpointing computes: losses (EESD and the z-loss among them), gradient norms, the final model, to
    ATOL. A recomputation counted twice would move the aux-free bias or EESD's teacher apart."""
    _, _, train_txt, held = tiny_lm
    data = [str(tied_moe), "--data", str(train_txt), "--eval-data", str(held), *ARGS]
    _alone(["train", data[0], str(tmp_path / "one"), *data[1:], "--grad-accum", "2"])
    args = ["train", data[0], str(tmp_path / "two"), *data[1:], "--activation-checkpointing", mode]
    if launch == "fsdp2":
        _launch(args)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        done = subprocess.run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                               "-m", "upcycle.cli", *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = tmp_path / "one", tmp_path / "two"
    _same_steps(_steps(one), _steps(two))
    _close(load_file(str(one / "model" / "model.safetensors")), load_file(str(two / "model" / "model.safetensors")))


@pytest.mark.slow      # over 15 s on 2 cores: the slow tier
@pytest.mark.parametrize("train_base", [True, False])
def test_delta_experts_under_fsdp2_compute_what_one_process_does(tiny_lm, tmp_path, train_base):
    """Delta experts (`moe.experts: delta`, rank 4) trained on 2 FSDP2 processes: the losses, gradient norms and
    final model of 1 process, to ATOL (the delta factors shard along their expert dim, the base along its rows);
    with the base frozen it comes out bit-identical."""
    from upcycle import ConvertConfig, MoEConfig, convert

    dense, _, train_txt, held = tiny_lm
    moe = tmp_path / "moe"
    convert(ConvertConfig(model=str(dense), method="drop", moe=MoEConfig(num_experts=4, top_k=2, experts="delta",
                                                                         delta_rank=4, train_base=train_base)),
            moe, progress=False)
    data = [str(moe), "--data", str(train_txt), "--eval-data", str(held), *ARGS]
    _alone(["train", data[0], str(tmp_path / "one"), *data[1:], "--grad-accum", "2"])
    _launch(["train", data[0], str(tmp_path / "two"), *data[1:]])
    one, two = tmp_path / "one", tmp_path / "two"
    _same_steps(_steps(one), _steps(two))
    final = load_file(str(two / "model" / "model.safetensors"))
    _close(load_file(str(one / "model" / "model.safetensors")), final)
    start = load_file(str(moe / "model.safetensors"))
    bases = [k for k in start if ".experts.base_" in k]
    assert bases and all(torch.equal(start[k], final[k]) != train_base for k in bases)
