"""One bounded JSON reader (`upcycle.files.parse_json` and `read_json_file`) for every JSON upcycle reads: no other
`json.load(s)` call in src/, and JSON nested 5,000 deep (a RecursionError in Python's parser) is one line naming
the file in each reader a user's folder reaches: a conversion report, an output's record, a safetensors index,
`eval --out` under `--overwrite`, a checkpoint's manifest, a run's log and its record of inputs."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from conftest import fails
from upcycle.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEEP = "[" * 5000 + "]" * 5000


def test_no_json_is_parsed_outside_the_one_reader():
    """Any call of json.load / json.loads (or of either imported by name) in src/ outside files.py is found."""
    found = []
    for path in sorted((ROOT / "src" / "upcycle").rglob("*.py")):
        if path.name == "files.py" and path.parent.name == "upcycle":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "json" and \
                    {a.name for a in node.names} & {"load", "loads"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports json.load(s)")
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id == "json":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} json.{node.attr}")
    assert found == []


def test_parse_json_refuses_deep_and_bad_json_in_one_line():
    from upcycle.errors import UpcycleError
    from upcycle.files import parse_json

    assert parse_json('{"a": [1, 2]}', "x") == {"a": [1, 2]}
    with pytest.raises(UpcycleError, match=r"^where: invalid JSON \(nested too deeply to read\)$"):
        parse_json(DEEP, "where")
    with pytest.raises(UpcycleError, match=r"^where: invalid JSON \(Expecting value: line 1 column 1"):
        parse_json("nope", "where")
    with pytest.raises(UpcycleError, match="where: invalid JSON"):
        parse_json("9" * 5000, "where")         # past Python's digit limit for int conversion


@pytest.fixture
def run(stopped_run, tmp_path):
    shutil.copytree(stopped_run, tmp_path / "run")
    return tmp_path / "run"


def resume(tiny_lm, run: Path) -> list[str]:
    return ["train", str(tiny_lm[1]), str(run), "--resume", "--quiet"]


def test_a_deep_conversion_report_is_one_line_on_export(lm, tmp_path, capsys):
    _, moe, _, _ = lm
    (moe / "upcycle_report.json").write_text(DEEP)
    line = fails(capsys, ["export", str(moe), str(tmp_path / "out")], "nested too deeply")
    assert "upcycle_report.json" in line and not (tmp_path / "out").exists()


def test_a_deep_output_record_is_one_line_under_overwrite(lm, tmp_path, capsys):
    dense, _, _, _ = lm
    out = tmp_path / "out"
    out.mkdir()
    (out / ".upcycle-output.json").write_text(DEEP)
    (out / "config.json").write_text("{}")
    fails(capsys, ["convert", str(dense), str(out), "--num-experts", "2", "--overwrite", "--quiet"], str(out))
    assert (out / "config.json").read_text() == "{}"


def test_a_deep_safetensors_index_is_one_line(lm, tmp_path, capsys):
    dense, _, _, _ = lm
    (dense / "model.safetensors.index.json").write_text(DEEP)
    (dense / "model.safetensors").rename(dense / "model-00001-of-00001.safetensors")
    line = fails(capsys, ["convert", str(dense), str(tmp_path / "out"), "--num-experts", "2", "--quiet"],
                 "nested too deeply")
    assert "model.safetensors.index.json" in line


def test_a_deep_eval_out_file_is_one_line_under_overwrite(lm, tmp_path, capsys):
    _, moe, _, held = lm
    out = tmp_path / "eval.json"
    out.write_text(DEEP)
    fails(capsys, ["eval", str(moe), "--data", str(held), "--tokens", "64", "--out", str(out), "--overwrite",
                   "--quiet"], str(out))
    assert out.read_text() == DEEP


def test_a_deep_checkpoint_manifest_is_one_line_on_resume(tiny_lm, run, capsys):
    (run / "checkpoints" / "step-0000002" / "manifest.json").write_text(DEEP)
    fails(capsys, resume(tiny_lm, run), "manifest")


def test_a_deep_record_of_inputs_is_one_line(tiny_lm, run, capsys):
    (run / "inputs.json").write_text(DEEP)
    line = fails(capsys, resume(tiny_lm, run), "nested too deeply")
    assert "inputs.json" in line
    # analysis of the run reads it too (for the run's model): the run is analysed without it
    assert main(["analyze", str(run), str(run.parent / "analysis"), "--tokens", "64"]) in (0, 2)
    assert "Traceback" not in capsys.readouterr().err


def test_a_deep_log_line_is_dropped_with_a_note_on_resume(tiny_lm, run, capsys):
    with open(run / "log.jsonl", "a") as f:
        f.write(DEEP + "\n")
    assert main(resume(tiny_lm, run)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "dropped unreadable line" in err
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps[-1] == 4 and DEEP not in (run / "log.jsonl").read_text()
