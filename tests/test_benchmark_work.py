"""The benchmark scripts follow the command line's rules for outputs: a script that deletes what it wrote takes
its folder from `benchmarks/work_folder.py`, which refuses a folder holding anything it did not make, a link, or
a file, before any work, and removes only what it made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from work_folder import MARKER, claim_work, clear  # noqa: E402


def run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_write_cost_refuses_a_users_folder_and_deletes_nothing_of_it(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    done = run_script([str(ROOT / "benchmarks" / "write_cost.py"), "--rounds", "1", "--pause", "0", "--work",
                       str(users)], tmp_path)
    assert done.returncode != 0 and "holds files a benchmark did not make" in done.stderr
    assert (users / "thesis.tex").read_text() == "years of work"
    done = run_script([str(ROOT / "benchmarks" / "write_cost.py"), "--rounds", "0", "--work", str(tmp_path / "w")],
                      tmp_path)
    assert done.returncode == 2 and "--rounds must be >= 1" in done.stderr and not (tmp_path / "w").exists()


def test_a_work_folder_is_claimed_only_when_new_empty_or_a_benchmarks(tmp_path):
    work = claim_work(tmp_path / "a" / "work")
    assert (work / MARKER).is_file()
    (work / "x").mkdir()
    assert claim_work(work) == work                          # a benchmark's own folder, taken again
    clear(work / "x", work)
    assert not (work / "x").exists()
    (tmp_path / "file").write_text("")
    os.symlink(work, tmp_path / "link")
    for bad, why in ((tmp_path / "file", "is not a folder"), (tmp_path / "link", "symbolic link")):
        with pytest.raises(SystemExit, match=why):
            claim_work(bad)
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(RuntimeError, match="outside the benchmark's folder"):
        clear(outside, work)
    assert outside.is_dir()
    clear(work, work)
    assert not work.exists()


@pytest.mark.parametrize(("script", "args", "message"), [
    ("moe_layer.py", ["--tokens", "0"], "--tokens must be >= 1, got 0"),
    ("moe_layer.py", ["--out", "{tmp}"], "is a folder; give the JSON file to write"),
    ("train_step.py", ["--steps", "0", "--device", "cpu"], "--steps must be >= 1, got 0"),
    ("moe_layer.py", ["--device", "cuda:7"], "torch sees no such GPU here"),
    ("runtimes_check.py", ["--only", "bogus"], "--only takes parts of"),
    ("verify_reports.py", ["{tmp}"], "is not a folder `upcycle convert` wrote"),
])
def test_benchmark_scripts_refuse_bad_arguments_in_one_line_before_any_work(tmp_path, script, args, message):
    """The command line's rule for the scripts a user runs from the repository: a bad argument is argparse's
    one-line error (exit 2), not a traceback or exit 0 with meaningless numbers, and nothing is written."""
    import torch

    if "cuda:7" in args and torch.cuda.device_count() > 7:
        pytest.skip("this machine has an eighth GPU")
    before = sorted(tmp_path.rglob("*"))
    done = run_script([str(ROOT / "benchmarks" / script), *(a.format(tmp=tmp_path) for a in args)], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    assert sorted(tmp_path.rglob("*")) == before
