"""The memory plan (`upcycle.training.memory.plan`): made from the model's config alone, within 15 % of the peak a
run measures (one process, DDP and FSDP2 on gloo CPU processes, with and without activation checkpointing), printed
by `upcycle train --dry-run` without writing anything, and a run it says cannot fit refused before a weight is read."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from conftest import TOY_WORDS, digest, fails
from upcycle.config import RegularizerConfig, TrainConfig
from upcycle.training.memory.plan import Layout, plan_memory

BIN = Path(sys.executable).parent
WORKER = Path(__file__).parents[1] / "memory_worker.py"
# The plan's bound against what the run measures. The plan runs the step's own code on fake tensors, so on the CPU
# it matches to the byte but for what no tensor shows (measured here: within 2 % for every row below); 15 % is
# the bound the plan promises for any machine.
WITHIN = 0.15


@pytest.fixture(scope="module")
def planned_lm(tmp_path_factory):
    """A Llama of width 128 (4 blocks, FFN 256, 4 heads, 2 KV heads), copy-upcycled to 4 experts top-2 in every
    block, and text of documents longer than its rows: big enough that activations, not fixed costs, dominate."""
    from upcycle import ConvertConfig, MoEConfig, convert
    from upcycle.config import CheckConfig
    from upcycle.data.clip_pairs import caption_tokenizer

    root = tmp_path_factory.mktemp("planned")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(300)]
    (root / "train.txt").write_text("\n\n".join(docs))
    tokenizer = caption_tokenizer(docs, max_length=256)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "dense")
    tokenizer.save_pretrained(root / "dense")
    convert(ConvertConfig(model=str(root / "dense"), method="copy", moe=MoEConfig(num_experts=4, top_k=2),
                          check=CheckConfig(text=str(root / "train.txt"))), root / "moe", progress=False)
    return root / "moe", root / "train.txt"


def _config(model: Path, data: Path, **overrides) -> dict:
    return {"model": str(model), "data": str(data), "steps": 3, "batch_size": 8, "sequence_length": 128,
            "mixed_precision": "no", **overrides}


def _measure(configs: list[dict], tmp_path: Path, launch: list[str] | None = None) -> list[list[dict]]:
    """Plan and measure each config in `memory_worker.py`: in a child process, or in 2 processes `launch`ed; the
    rows of every process."""
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable] if launch is None else [str(BIN / "accelerate"), "launch", *launch]
    done = subprocess.run([*command, str(WORKER), str(tmp_path / "configs.json"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("out.*.json"))]


def _within(rows: list[dict]) -> None:
    for row in rows:
        ratio = row["plan"] / row["measured"]
        assert abs(ratio - 1) <= WITHIN, (row["sharding"], row["checkpointing"], row["plan"], row["measured"])


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_the_plan_is_the_peak_one_process_measures(planned_lm, tmp_path):
    """Each activation checkpointing mode, and with the load-balance loss, EESD's teacher and the aux-free bias;
    the modes order as they should (full keeps the least, none the most)."""
    moe, text = planned_lm
    regs = {"load_balance": 0.01, "eesd": 0.1, "aux_free_rate": 0.001}
    configs = [_config(moe, text, activation_checkpointing=mode) for mode in ("none", "full", "moe")] + \
        [_config(moe, text, activation_checkpointing="full", regularizers=regs)]
    (rows,) = _measure(configs, tmp_path)
    _within(rows)
    none, full, moe_only, eesd = (row["measured"] for row in rows)
    assert full < moe_only < none and eesd > full
    assert rows[3]["parts"]["teacher"] > 0


@pytest.mark.slow      # over 15 s on 2 cores: the slow tier
def test_the_plan_of_delta_experts_is_the_peak_one_process_measures(planned_lm, tmp_path):
    """Delta experts (rank 8), the base trained and frozen, planned from the config (the trace stands in equal
    shares of the slots for the counts it cannot read) and measured: within the bound; a frozen base holds less."""
    from upcycle import ConvertConfig, MoEConfig, convert
    from upcycle.config import CheckConfig

    moe, text = planned_lm
    configs = []
    for train_base in (True, False):
        out = tmp_path / f"delta-{train_base}"
        convert(ConvertConfig(model=str(moe.parent / "dense"), method="copy", check=CheckConfig(text=str(text)),
                              moe=MoEConfig(num_experts=4, top_k=2, experts="delta", delta_rank=8,
                                            train_base=train_base)), out, progress=False)
        configs.append(_config(out, text))
    (rows,) = _measure(configs, tmp_path)
    _within(rows)
    assert rows[1]["measured"] < rows[0]["measured"]


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
@pytest.mark.parametrize("launch", ["ddp", "fsdp2"])
def test_the_plan_is_the_peak_each_of_two_processes_measures(planned_lm, tmp_path, launch):
    """2 gloo CPU processes, DDP (gradient buckets on top) or FSDP2 (shards, plus the gathered blocks), with and
    without checkpointing: each process's plan within the bound of its own measured peak."""
    moe, text = planned_lm
    args = ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            *(["--use_fsdp", "--fsdp_version", "2"] if launch == "fsdp2" else ["--multi_gpu"])]
    configs = [_config(moe, text, batch_size=16, activation_checkpointing=mode) for mode in ("none", "full")]
    per_rank = _measure(configs, tmp_path, args)
    assert len(per_rank) == 2
    for rows in per_rank:
        assert [row["sharding"] for row in rows] == [launch] * 2
        _within(rows)
    one = plan_memory(TrainConfig(**_config(moe, text, batch_size=8)), detail=False)
    if launch == "fsdp2":            # half the weights and optimizer state of one process running half the batch
        assert per_rank[0][0]["parts"]["parameters"] < 0.6 * one.parts["parameters"]


def test_plan_prints_and_writes_nothing(planned_lm, tmp_path, capsys):
    from upcycle.cli import main

    moe, text = planned_lm
    before = digest(moe, text)
    out = tmp_path / "run"
    assert main(["train", str(moe), str(out), "--data", str(text), "--batch-size", "8", "--sequence-length", "128",
                 "--plan"]) == 0
    printed = capsys.readouterr().out
    assert "memory plan" in printed and "total" in printed and "fits" in printed
    for mode in ("none", "full", "moe"):
        assert f"{mode} " in printed.split("checkpointing mode:")[1]
    assert not out.exists() and digest(moe, text) == before
    out.mkdir()                          # an existing OUT is left as it is too
    (out / "mine.txt").write_text("mine")
    assert main(["train", str(moe), str(out), "--data", str(text), "--plan"]) == 0
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_run_that_cannot_fit_is_refused_before_its_weights_are_read(planned_lm, tmp_path, capsys, monkeypatch):
    import upcycle.training.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the plan refused the run")
    monkeypatch.setattr(trainer, "load_model", refuse)
    moe, text = planned_lm
    out = tmp_path / "run"
    line = fails(capsys, ["train", str(moe), str(out), "--data", str(text), "--batch-size", "16",
                          "--sequence-length", "128", "--memory-budget", "70MB"], "this run needs")
    assert "70MB" in line and "What would fit" in line and "grad_accum" in line and "activation_checkpointing" in line
    assert not out.exists()
    # the alternative it names fits: the plan of that run is within the budget
    plan = plan_memory(TrainConfig(**_config(moe, text, batch_size=16, activation_checkpointing="full",
                                             memory_budget="70MB")), detail=False)
    assert plan.fits
    fails(capsys, ["train", str(moe), str(out), "--data", str(text), "--memory-budget", "lots"],
          "memory_budget 'lots'")


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_every_family_and_task_plans(tmp_path, family):
    """A plan for a tiny model of every supported family, on its own task (causal LM, the contrastive pair task
    for BERT, CLIP's), larger with more rows and smaller with checkpointing."""
    from conftest import make_tiny

    make_tiny(family).save_pretrained(tmp_path / family)
    seq = 16
    plans = {(mode, rows): plan_memory(TrainConfig(model=str(tmp_path / family), batch_size=rows,
                                                   sequence_length=seq, activation_checkpointing=mode),
                                       Layout(1, "single", "cpu", "cpu", 2**34, "no"))
             for mode in ("none", "full") for rows in (2, 8)}
    assert plans[("none", 8)].peak_bytes > plans[("none", 2)].peak_bytes
    assert plans[("full", 8)].activations_by_mode["full"] < plans[("none", 8)].activations_by_mode["none"]
    assert plans[("none", 2)].task == {"bert": "contrastive", "clip": "clip"}.get(family, "causal_lm")


def test_layouts_scale_as_they_should(planned_lm):
    """FSDP2 shards the weights and AdamW state N ways; DDP adds a gradient-sized bucket; mixed precision keeps
    float32 masters under FSDP2."""
    moe, text = planned_lm
    cfg = TrainConfig(**_config(moe, text, batch_size=8))
    one = plan_memory(cfg, Layout(1, "single", "cuda", "gpu", 10**11, "no"), detail=False)
    ddp = plan_memory(cfg, Layout(2, "ddp", "cuda", "gpu", 10**11, "no"), detail=False)
    fsdp = plan_memory(cfg, Layout(2, "fsdp2", "cuda", "gpu", 10**11, "no"), detail=False)
    assert ddp.parts["ddp_buckets"] > 0 and fsdp.parts["ddp_buckets"] == 0
    assert ddp.parts["parameters"] == one.parts["parameters"]
    assert abs(fsdp.parts["parameters"] - one.parts["parameters"] / 2) < 0.01 * one.parts["parameters"]
    assert fsdp.parts["gathered"] > 0
    with pytest.raises(Exception, match="do not go together"):
        Layout(2, "single")
    rc = RegularizerConfig(eesd=0.1)
    eesd = plan_memory(TrainConfig(**{**_config(moe, text, batch_size=8), "regularizers": rc}),
                       Layout(1, "single", "cuda", "gpu", 10**11, "no"), detail=False)
    assert eesd.parts["teacher"] > 0
