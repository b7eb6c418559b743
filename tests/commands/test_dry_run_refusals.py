"""Every refusal a convert, prune or grow makes before reading a weight, its dry run makes too: one table of bad
requests, each run as a dry run and as a real run, both refused with the same one-line message, OUT never made
(or left as it was) and every input unchanged. A dry run that plans what its run refuses tells a user a command
will work when it will not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import digest
from upcycle.cli import main


@pytest.fixture(scope="module")
def inputs(tiny_lm, tmp_path_factory) -> dict[str, Path]:
    """The tiny dense model and its copy-upcycled MoE, and the bad inputs the table points at: a dense folder
    with integer weights, an MoE folder whose spec writes a count as a string, a calibration file that is no
    JSONL, a stock Mixtral export and an existing folder that is not upcycle's."""
    dense, moe, train, _ = tiny_lm
    root = tmp_path_factory.mktemp("refusals")
    ints = root / "int-weights"
    shutil.copytree(dense, ints)
    tensors = load_file(ints / "model.safetensors")
    name = next(k for k in tensors if k.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, ints / "model.safetensors", metadata={"format": "pt"})
    stringly = root / "string-count"
    shutil.copytree(moe, stringly)
    spec = json.loads((stringly / "upcycle_config.json").read_text())
    spec["layers"][0]["num_experts"] = "4"
    (stringly / "upcycle_config.json").write_text(json.dumps(spec))
    bad_jsonl = root / "bad.jsonl"
    bad_jsonl.write_text("{not json\n")
    stock = root / "mixtral"
    assert main(["export", str(moe), str(stock), "--export-class", "mixtral"]) == 0
    user = root / "user-folder"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    return {"DENSE": dense, "MOE": moe, "TRAIN": train, "INTS": ints, "STRINGLY": stringly, "BADJSONL": bad_jsonl,
            "STOCK": stock, "USER": user}


# (argv with names from `inputs` and OUT, the message both runs print)
CASES = [
    (["convert", "DENSE", "OUT", "--method", "granular", "--num-experts", "4"], "must be multiples of granularity 4"),
    (["convert", "DENSE", "OUT", "--method", "cluster", "--calibration", "NOPE"], "nope.txt: no such file"),
    (["convert", "DENSE", "OUT", "--method", "cluster", "--calibration", "BADJSONL"], "calibration data"),
    (["convert", "INTS", "OUT"], "as integers where the model has floating-point weights"),
    (["convert", "DENSE", "DENSE"], "would destroy an input"),
    (["convert", "DENSE", "USER"], "already exists (pass --overwrite"),
    (["convert", "DENSE", "USER", "--overwrite"], "upcycle did not write"),
    (["convert", "DENSE", "OUT", "--set", "method_args.bogus=1"], "has no argument(s) ['bogus']"),
    (["convert", "DENSE", "OUT", "--num-experts", "70000"], "moe.num_experts"),
    (["prune", "MOE", "OUT", "--num-experts", "1"], "keeps at least 2 experts"),
    (["prune", "MOE", "MOE", "--num-experts", "3"], "would destroy an input"),
    (["prune", "MOE", "USER", "--num-experts", "3"], "already exists (pass --overwrite"),
    (["prune", "DENSE", "OUT", "--num-experts", "2"], "is not an MoE folder"),
    (["prune", "STRINGLY", "OUT", "--num-experts", "3"], "does not build from its config"),
    (["prune", "STRINGLY", "OUT", "--num-experts", "3", "--streaming"], "does not build from its config"),
    (["prune", "MOE", "OUT", "--num-experts", "3", "--calibration", "BADJSONL"], "--calibration"),
    (["prune", "MOE", "OUT", "--num-experts", "3", "--calibration", "NOPE"], "nope.txt: no such file"),
    (["grow", "MOE", "OUT", "--num-experts", "1000000000000"], "between 1 and 65,536"),
    (["grow", "MOE", "OUT", "--num-experts", "3"], "use prune"),
    (["grow", "STOCK", "OUT", "--num-experts", "6"], "grow the upcycle folder the stock one was exported from"),
    (["grow", "MOE", "USER", "--num-experts", "6"], "already exists (pass --overwrite"),
    (["grow", "MOE", "OUT", "--num-experts", "6", "--perturb", "drop", "--by", "nope"], "invalid choice"),
]


def _argv(template: list[str], inputs: dict[str, Path], out: Path) -> list[str]:
    names = {**{k: str(v) for k, v in inputs.items()}, "OUT": str(out), "NOPE": str(out.parent / "nope.txt")}
    argv = [names.get(word, word) for word in template]
    if template[0] != "convert" and "--calibration" not in template and "DENSE" not in template:
        argv += ["--calibration", names["TRAIN"], "--calibration-tokens", "256"]
    return [*argv, "--quiet"]


@pytest.mark.parametrize(("template", "message"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_dry_run_refuses_what_its_run_refuses(inputs, tmp_path, capsys, template, message):
    out = tmp_path / "out"
    argv = _argv(template, inputs, out)
    before = digest(*inputs.values())
    said = []
    for dry in (True, False):
        try:
            code = main([*argv, "--dry-run"] if dry else argv)
        except SystemExit as e:                 # argparse's own refusal
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, (dry, argv, err[-2000:])
        assert message in err and "Traceback" not in err, (dry, argv, err[-2000:])
        said.append([line for line in err.splitlines() if line.startswith("upcycle")][-1:])
        assert not out.exists()
        assert digest(*inputs.values()) == before
    assert said[0] == said[1]          # the same words, dry or not


def test_the_dry_run_of_a_stock_mixtral_prune_plans_the_layers_its_run_changes(inputs, tmp_path, capsys):
    """transformers 5 saves Mixtral's experts one tensor each (`block_sparse_moe.experts.0.w1.weight`): the plan
    maps them to their layers and counts what the prune then writes."""
    from upcycle.checkpoint.reader import CheckpointReader

    stock, out = inputs["STOCK"], tmp_path / "pruned"
    argv = ["prune", str(stock), str(out), "--num-experts", "2", "--calibration", str(inputs["TRAIN"]),
            "--calibration-tokens", "256", "--quiet"]
    capsys.readouterr()
    assert main([*argv, "--dry-run"]) == 0
    said = capsys.readouterr().out
    layers = json.loads((inputs["MOE"] / "upcycle_config.json").read_text())["layers"]
    assert f"MoE layers           {len(layers)}, experts 4 -> 2" in said
    assert main(argv) == 0
    report = json.loads((out / "resize_report.json").read_text())
    assert len(report["layers"]) == len(layers)
    reader = CheckpointReader(out, check_values=False)
    written = sum(torch.Size(reader.shape(n)).numel() for n in reader.names())
    plan = next(line for line in said.splitlines() if line.strip().startswith("parameters")).split()
    assert plan[-2] == f"{written / 1e9:.3f}"


@pytest.mark.parametrize(("template", "message"), [
    (["grow", "MOE", "OUT", "--num-experts", "4096"], "grow to 4096 experts needs an estimated"),
    (["grow", "MOE", "OUT", "--num-experts", "65536", "--streaming"], "grow to 65536 experts needs an estimated"),
    (["convert", "DENSE", "OUT", "--num-experts", "4096", "--top-k", "1"], "converting to 4096 experts needs an"),
])
def test_a_run_that_cannot_fit_the_machine_is_refused_before_it_builds_and_so_is_its_dry_run(
        inputs, tmp_path, capsys, monkeypatch, template, message):
    """On a machine of 0.7 GB (the process alone is counted as 0.6 GB), a grow to 4,096 experts and a conversion
    whose report's E x E similarity matrices take 0.4 GB do not fit: both ways refused, nothing allocated or
    written (a grow to 65,536 experts used to allocate until memory ran out, and a conversion to try one 32 GiB
    matrix); a grow to 6 still plans and fits."""
    import upcycle.conversion.dry_run as convert_plan
    import upcycle.resize.plan as resize_plan

    for module in (convert_plan, resize_plan):
        monkeypatch.setattr(module, "CPU_MEMORY", int(0.7e9))
    out = tmp_path / "out"
    argv = _argv(template, inputs, out)
    for dry in (True, False):
        assert main([*argv, "--dry-run"] if dry else argv) == 2
        err = capsys.readouterr().err
        assert message in err and "more than this machine's 0.7 GB of memory" in err, err
        assert not out.exists()
    assert main(_argv(["grow", "MOE", "OUT", "--num-experts", "6"], inputs, out) + ["--dry-run"]) == 0
    assert "estimated peak" in capsys.readouterr().out


def test_the_conversion_estimate_counts_the_reports_expert_similarity_matrices(inputs, capsys):
    assert main(["convert", str(inputs["DENSE"]), "--num-experts", "512", "--top-k", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[out.index("\n{") + 1:])
    assert plan["estimate_parts_bytes"]["similarity"] == 3 * 512 * 512 * 8
    assert plan["estimated_peak_bytes"] >= plan["estimate_parts_bytes"]["overhead"] + 3 * 512 * 512 * 8
