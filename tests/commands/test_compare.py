"""`upcycle compare`: on a tiny Llama, two methods x two seeds + the dense baseline, a few steps. The
table has every cell; a rerun skips finished cells; a cell stopped after a checkpoint resumes to the same result
as an uninterrupted one; bad input is refused before anything is written."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import write_tiny_lm
from upcycle.cli import main
from upcycle.compare import study
from upcycle.compare.plan import make_plan
from upcycle.compare.request import CompareRequest
from upcycle.errors import UpcycleError
from upcycle.training.trainer import train

compare = functools.partial(study.compare, train=train)   # as `upcycle compare` runs it


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    dense, train, held = write_tiny_lm(root / "lm")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"data": str(train), "eval_data": str(held), "steps": 4, "batch_size": 4,
                                      "sequence_length": 32, "lr": 1e-3, "eval_every": 2, "checkpoint_every": 2,
                                      "eval_tokens": 256, "regularizers": {"load_balance": 0.01}}))
    return root, dense, recipe


def _request(dense: Path, recipe: Path, **changes) -> CompareRequest:
    args = dict(model=str(dense), methods=("copy", "drop"), train_recipe=str(recipe), seeds=(0, 1),
                convert_sets=("moe.num_experts=4", "moe.top_k=2", "placement.every=2"))
    return CompareRequest(**{**args, **changes})


def _steps(run: Path) -> list[dict]:
    """What a run computed, step by step (losses, gradient norms, routing, evaluations), without the timings."""
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "seconds")} for r in rows]


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_compare_every_cell_skip_and_exact_resume(setup, capsys):
    root, dense, recipe = setup
    a, b = root / "a", root / "b"
    # A: the first cell stops after its step-2 checkpoint, as an interrupted run would
    first = compare(_request(dense, recipe), a, progress=False, stop_after=2)
    assert first["interrupted"] == "copy-eesd-none-seed-0" and first["ran"] == 0
    stopped = a / "cells" / "copy-eesd-none-seed-0"
    assert (stopped / "run" / "checkpoints" / "step-0000002").is_dir() and not (stopped / "cell.json").exists()
    log_before = (stopped / "run" / "log.jsonl").read_text()      # steps 1-2 with the times they took
    # the outputs of a stopped comparison say they are partial, and which cells are missing
    partial = json.loads((a / "comparison.json").read_text())
    assert partial["complete"] is False and partial["interrupted"] == "copy-eesd-none-seed-0"
    assert len(partial["unfinished"]) == 6 and "copy-eesd-none-seed-0" in partial["unfinished"]
    assert (a / "comparison.md").read_text().splitlines()[2].startswith("**Partial**: 0 of 6 cells finished")
    resumed = compare(_request(dense, recipe), a, progress=False)
    assert resumed == {"cells": 6, "skipped": 0, "ran": 6, "interrupted": None, "out": str(a)}
    done = json.loads((a / "comparison.json").read_text())
    assert done["complete"] is True and done["unfinished"] == [] and "Partial" not in (a / "comparison.md").read_text()
    assert not [p.name for p in a.iterdir() if ".tmp" in p.name or p.name.endswith(".lock")]
    # resumed, not redone: the log's first steps are the lines written before the stop, timings and all
    assert (stopped / "run" / "log.jsonl").read_text().startswith(log_before)
    # B: the interrupted cell's (method, seed) uninterrupted, through the command line
    assert main(["compare", str(dense), str(b), "--methods", "copy", "--seeds", "0", "--config", str(recipe),
                 "--num-experts", "4", "--top-k", "2", "--every", "2", "--quiet"]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["ran"] == 2
    last = [line for line in said.err.splitlines() if "wrote" in line][-1]      # what it wrote, no empty entry
    assert "comparison.json, comparison.md" in last and ",  (" not in last and ", (" not in last

    # the interrupted cell computed what the uninterrupted one did: every step, evaluation and final weight
    cell_a, cell_b = (json.loads((x / "cells" / "copy-eesd-none-seed-0" / "cell.json").read_text()) for x in (a, b))
    assert _steps(stopped / "run") == _steps(b / "cells" / "copy-eesd-none-seed-0" / "run")
    assert cell_a["evals"] == cell_b["evals"] and cell_a["diagnostics"] == cell_b["diagnostics"]
    weights_a = load_file(stopped / "run" / "model" / "model.safetensors")
    weights_b = load_file(b / "cells" / "copy-eesd-none-seed-0" / "run" / "model" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys() and all(weights_a[k].equal(weights_b[k]) for k in weights_a)
    assert [e["step"] for e in cell_a["evals"]] == [0, 2, 4]

    # the table: one row per method (dense first), each over both seeds, in JSON and Markdown
    result = json.loads((a / "comparison.json").read_text())
    assert [(r["method"], r["eesd"], r["seeds"]) for r in result["table"]] == [
        ("dense", "–", [0, 1]), ("copy", "none", [0, 1]), ("drop", "none", [0, 1])]
    assert len(result["cells"]) == 6 and result["task"] == "causal_lm" and result["machine"]["cpus"]
    assert [i["command"] for i in result["invocations"]] == [None, None]      # the stopped and the resuming one
    copy_row = result["table"][1]
    ppl = copy_row["metrics"]["perplexity"]
    assert len(ppl["after_conversion"]["values"]) == len(ppl["after_training"]["values"]) == 2
    # copy preserves the dense function: right after conversion it scores what the dense model scores
    dense_row = result["table"][0]["metrics"]["perplexity"]["after_conversion"]
    assert ppl["after_conversion"]["mean"] == pytest.approx(dense_row["mean"], rel=1e-4)
    assert copy_row["init"]["expert_similarity"]["mean"] == pytest.approx(1.0, abs=1e-6)    # identical copies
    assert result["table"][2]["init"]["expert_similarity"]["mean"] < 0.9    # drop re-draws half of each expert
    p = copy_row["parameters"]
    assert p["total"] > p["active_per_token"] > result["table"][0]["parameters"]["total"]
    table = (a / "comparison.md").read_text()
    for name in ("| dense | – | 0,1 |", "| copy | none | 0,1 |", "| drop | none | 0,1 |"):
        assert name in table
    assert (a / "metric_over_steps.png").stat().st_size > 1000 and (a / "init_diagnostics.png").is_file()
    # --keep models (the default): the run's checkpoints are gone, the models stay
    assert not (stopped / "run" / "checkpoints").exists() and (a / "conversions" / "copy-seed-0" / "moe").is_dir()

    # a rerun skips every finished cell and rewrites nothing of them
    before = {p: p.stat().st_mtime_ns for p in (a / "cells").glob("*/cell.json")}
    again = compare(_request(dense, recipe), a, progress=False)
    assert again["skipped"] == 6 and again["ran"] == 0
    assert {p: p.stat().st_mtime_ns for p in (a / "cells").glob("*/cell.json")} == before
    # a wider grid into the same OUT adds its cells and shares the conversion of each (method, seed)
    wider = compare(_request(dense, recipe, methods=("copy",), seeds=(0,), eesd=("none", "0.5")), a, progress=False)
    assert wider["skipped"] == 2 and wider["ran"] == 1
    rows = json.loads((a / "comparison.json").read_text())["table"]
    assert [(r["method"], r["eesd"]) for r in rows] == [("dense", "–"), ("copy", "none"), ("copy", "0.5"),
                                                         ("drop", "none")]
    eesd_run = yaml.safe_load((a / "cells" / "copy-eesd-0.5-seed-0" / "run" / "run_config.yaml").read_text())
    assert eesd_run["regularizers"]["eesd"] == 0.5 and eesd_run["model"].endswith("conversions/copy-seed-0/moe")


@pytest.mark.parametrize("flags, message", [
    (["--methods", "copy,nosuch"], "unknown method 'nosuch'"),
    (["--methods", "copy,dense"], "dense-continued baseline is always run"),
    (["--methods", "copy,copy"], "lists a method twice"),
    (["--methods", "copy", "--eesd", "none,-1"], "--eesd values are none or a finite coefficient"),
    (["--methods", "copy", "--eesd", "high"], "--eesd value must be float"),
    (["--methods", "copy", "--eesd", "nan"], "--eesd values are none or a finite coefficient"),
    (["--methods", "copy", "--eesd", "none,0"], "--eesd lists none twice"),
    (["--methods", "copy", "--seeds", "0,0"], "lists a seed twice"),
    (["--methods", "copy", "--seeds", "-1"], "--seeds must be whole numbers >= 0"),
    (["--methods", "copy", "--set", "lr=-1"], "lr must be a finite number"),
    (["--methods", "drop", "--method-set", "drop.method_args.ratio=2"], "ratio"),
    (["--methods", "copy", "--method-set", "drop.method_args.ratio=0.1"], "is not one of --methods"),
    (["--methods", "copy", "--num-experts", "2", "--top-k", "3"], "top_k must be between 1 and num_experts"),
])
def test_bad_input_is_refused_before_any_output(setup, tmp_path, capsys, flags, message):
    _, dense, recipe = setup
    out = tmp_path / "study"
    assert main(["compare", str(dense), str(out), "--config", str(recipe), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_cell_planned_otherwise_is_refused_not_resumed(setup, tmp_path):
    _, dense, recipe = setup
    out = tmp_path / "study"
    compare(_request(dense, recipe, methods=("copy",), seeds=(0,)), out, progress=False, stop_after=1)
    with pytest.raises(UpcycleError, match=r"planned with other settings \(train.lr differ\)"):
        make_plan(_request(dense, recipe, methods=("copy",), seeds=(0,), train_sets=("lr=1e-4",)), out)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file.txt").write_text("mine")
    with pytest.raises(UpcycleError, match="is not an `upcycle compare` folder"):
        make_plan(_request(dense, recipe), tmp_path / "other")


def test_plan_shares_everything_but_the_method_and_its_own_keys(setup, tmp_path):
    """Every cell gets the same conversion and training settings; --method-set and --method-config reach only
    their method; without --eesd the recipe's coefficient is kept; the seed is the conversion's and the run's."""
    root, dense, recipe = setup
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "train": ["routed"]}))
    plan = make_plan(_request(dense, recipe, methods=("copy", "drop", "spri"), seeds=(3,),
                              train_sets=("regularizers.eesd=0.25",),
                              method_sets=("drop.method_args.ratio=0.25",),
                              method_recipes=(f"spri={own}",)), tmp_path / "study")
    cells = {c.name: c for c in plan.cells}
    assert sorted(cells) == ["copy-eesd-0.25-seed-3", "dense-seed-3", "drop-eesd-0.25-seed-3",
                             "spri-eesd-0.25-seed-3"]
    copy, drop, spri = (cells[f"{m}-eesd-0.25-seed-3"] for m in ("copy", "drop", "spri"))
    base = cells["dense-seed-3"]
    assert drop.convert.method_args == {"ratio": 0.25} and copy.convert.method_args == {} == spri.convert.method_args
    for cell in (copy, drop, spri):
        assert cell.convert.moe == copy.convert.moe and cell.convert.placement == copy.convert.placement
        assert cell.convert.seed == cell.train.seed == 3 and cell.train.regularizers.eesd == 0.25
        assert (cell.train.steps, cell.train.batch_size, cell.train.sequence_length) == (4, 4, 32)
    assert spri.train.train == ("routed",) and copy.train.train == drop.train.train == ("all",)
    assert base.convert is None and base.train.model == str(dense) and base.train.regularizers.eesd == 0.0
    assert not (tmp_path / "study").exists()          # planning writes nothing


@pytest.mark.slow      # over 15 s on 2 cores (tests/durations.json): the slow tier
def test_a_second_invocation_on_cells_a_running_one_holds_is_refused_at_its_start(setup, tmp_path):
    """Invocations into one OUT on disjoint cells run side by side (one per seed); one whose cells or conversions a
    running invocation holds is refused when it starts, under a lock on OUT itself, not when it reaches the first
    conversion the other holds. A record left by a process that is gone holds nothing."""
    import os
    import socket
    import subprocess

    _, dense, recipe = setup
    out = tmp_path / "study"
    request = _request(dense, recipe, methods=("copy",), seeds=(0,))
    compare(request, out, progress=False, stop_after=1)
    held = subprocess.Popen(["sleep", "60"])           # a running process standing in for another invocation
    try:
        record = {"command": "upcycle compare ...", "started": 0.0, "upcycle": "x", "seconds": 0.0,
                  "process": {"pid": held.pid, "host": socket.gethostname()},
                  "cells": ["copy-eesd-none-seed-0"], "conversions": ["copy-seed-0"], "ended": None}
        (out / "invocations" / "1-1.json").write_text(json.dumps(record))
        cell = out / "cells" / "copy-eesd-none-seed-0" / "run" / "log.jsonl"
        before = cell.read_text()
        with pytest.raises(UpcycleError, match=rf"another `upcycle compare` \(process {held.pid} on .*\) is running "
                                               r"cell copy-eesd-none-seed-0, conversion copy-seed-0 of this one"):
            compare(request, out, progress=False)
        assert cell.read_text() == before and len(list((out / "invocations").glob("*.json"))) == 2
        # another seed's cells are not held: that invocation runs beside it
        other = compare(_request(dense, recipe, methods=("copy",), seeds=(1,)), out, progress=False, stop_after=1)
        assert other["interrupted"] is not None
    finally:
        held.kill()
        held.wait()
    mine = [json.loads(p.read_text()) for p in (out / "invocations").glob("*.json") if p.name != "1-1.json"]
    assert all(r["process"]["pid"] == os.getpid() and r["ended"] is not None for r in mine)
    assert compare(request, out, progress=False)["ran"] >= 1          # the holder is gone: its record holds nothing
