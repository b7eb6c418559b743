"""The tools that bring results back from a lent GPU machine (docs/gpu.md, "Running it"): a test suite stopped at a
time limit still says what failed (tests/live_report.py, benchmarks/gpu/gpu_summary.py's fallbacks), and docs/gpu.md's
table of GPU runs is what `gpu_summary.py --docs` writes from benchmarks/results/gpu/, not edited by hand."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def summary_module():
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    return importlib.import_module("gpu_summary")


def test_live_report_writes_every_outcome_as_the_test_finishes(tmp_path):
    (tmp_path / "test_demo.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'wrong value'\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_error(broken): pass\n"
        "def test_skip(): pytest.skip('no asset')\n")
    report = tmp_path / "tests.jsonl"
    env = os.environ | {"UPCYCLE_TEST_REPORT": str(report), "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "live_report", "-p", "no:cacheprovider",
                           "test_demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, report.read_text().splitlines())}
    assert set(rows) == {"test_ok", "test_bad", "test_error", "test_skip"}
    assert rows["test_ok"]["outcome"] == "passed"
    assert rows["test_bad"]["outcome"] == "failed" and "wrong value" in rows["test_bad"]["text"]
    assert rows["test_error"]["when"] == "setup" and "fixture broke" in rows["test_error"]["text"]
    assert rows["test_skip"]["outcome"] == "skipped" and "no asset" in rows["test_skip"]["reason"]


def test_a_suite_stopped_at_its_limit_is_summarized_from_what_it_wrote(summary_module, tmp_path):
    lines = [{"test": "t.py::a", "when": "call", "outcome": "passed"},
             {"test": "t.py::b", "when": "call", "outcome": "failed", "text": "E   assert 1 == 2\nAssertionError"},
             {"test": "t.py::c", "when": "setup", "outcome": "failed", "text": "RuntimeError: no GPU memory"},
             {"test": "t.py::d", "when": "setup", "outcome": "skipped", "reason": "needs a GPU"}]
    (tmp_path / "tests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tests = summary_module.tests_of(tmp_path)
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 2, 1)
    assert [(f["test"], f["kind"]) for f in tests["failures"]] == [("t.py::b", "failure"), ("t.py::c", "error")]
    assert tests["failures"][1]["message"] == "RuntimeError: no GPU memory"
    # without tests.jsonl, the progress characters of pytest -q are counted
    (tmp_path / "tests.jsonl").unlink()
    (tmp_path / "pytest.log").write_text("bringing up nodes...\n..EF.s [ 50%]\n.E..\n")
    tests = summary_module.tests_of(tmp_path)
    assert (tests["passed"], tests["failed"], tests["errors"], tests["skipped"]) == (6, 1, 2, 1)


def test_printed_layer_rows_stand_in_for_a_json_the_run_did_not_write(summary_module, tmp_path):
    row = {"shape": "smollm2", "tokens": 8192, "fwd_bwd_upcycle_vs_best_hf": 0.92}
    later = {**row, "fwd_bwd_upcycle_vs_best_hf": 0.93}
    (tmp_path / "moe_layer_cuda_bfloat16_printed.json").write_text(json.dumps(
        {"runs": [{"rows": [row]}, {"rows": [later, {**row, "tokens": 32768, "fwd_bwd_upcycle_vs_best_hf": 0.77}]}]}))
    rows = summary_module.layer_rows(tmp_path / "moe_layer_cuda_bfloat16.json")
    assert [(r["tokens"], r["fwd_bwd_upcycle_vs_best_hf"]) for r in rows] == [(8192, 0.93), (32768, 0.77)]


def test_the_docs_table_of_gpu_runs_is_the_one_the_results_give(summary_module, tmp_path, monkeypatch):
    """docs/gpu.md's table is regenerated from benchmarks/results/gpu/*/summary.json; a hand edit or a run added
    without `python benchmarks/gpu/gpu_summary.py --docs` fails here."""
    docs = tmp_path / "gpu.md"
    text = (ROOT / "docs" / "gpu.md").read_text()
    docs.write_text(text)
    monkeypatch.setattr(summary_module, "DOCS", docs)
    summary_module.write_docs()
    assert docs.read_text() == text
    for folder in summary_module.RUNS.iterdir():
        if (folder / "summary.json").is_file():
            assert f"`{folder.name}`" in text
            # each summary.json is what gpu_summary.py makes of its folder's files
            recorded = json.loads((folder / "summary.json").read_text())
            assert summary_module.summarize(folder, recorded["seconds"]) == recorded


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the GPU machine's python3: logs each call; a GPU is there when FAKE_GPU is 1
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *torch.cuda.is_available*) echo "$FAKE_GPU" ;;
  *total_memory*) echo smollm2-1.7b ;;
  *"import xdist"*|*pytest_timeout*) exit 1 ;;
  -) cat > /dev/null; echo '{}' ;;
esac
exit 0
"""


def run_check(tmp_path: Path, gpu: str, seconds: int) -> tuple[list[str], str]:
    tmp_path = tmp_path / f"gpu-{gpu}"
    tmp_path.mkdir()
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = os.environ | {"PYTHON": str(fake), "FAKE_LOG": str(log), "FAKE_GPU": gpu,
                        "GPU_CHECK_SECONDS": str(seconds)}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [line for line in log.read_text().splitlines() if "benchmarks/" in line or "pytest tests" in line]
    return calls, done.stdout


def test_the_gpu_check_measures_speed_before_the_suite_and_skips_what_its_time_cannot_hold(tmp_path):
    """Speed first, the real-size training benchmark before all (a call stopped at its limit still brings it, the
    layer rows and the training step back), then the suite, then the rest while the budget has room: at 100 s the
    60-s layer rows run and the 150-s compiled step is skipped with its reason."""
    calls, stdout = run_check(tmp_path, "1", 100)
    kinds = [c.split()[0].rsplit("/", 1)[-1] if c.startswith("benchmarks/") else "suite" for c in calls]
    assert kinds == ["train_mfu.py", "moe_layer.py", "train_step.py", "suite", "moe_layer.py", "moe_layer.py",
                     "gpu_summary.py"]
    assert "--preset smollm2-1.7b" in calls[0] and "train_mfu.json" in calls[0]
    calls = calls[1:]
    assert "bfloat16" in calls[0] and "olmoe" in calls[0] and "float32" in calls[3] and "tf32" in calls[4]
    assert not any("--compile" in c for c in calls)
    assert "skipped (compiled training step)" in stdout
    calls, stdout = run_check(tmp_path, "0", 100)              # no GPU: the suite alone
    assert [c.split()[0] for c in calls] == ["-m", "benchmarks/gpu/gpu_summary.py"] and "pytest tests" in calls[0]
    assert "no CUDA GPU here" in stdout
