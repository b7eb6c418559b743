"""The benchmark scripts follow the command line's rules for outputs: a script that deletes what it wrote takes
its folder from `upcycle.scripts.claim_work`, which refuses a folder holding anything it did not make, a link, or
a file, before any work, and removes only what it made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from upcycle.outputs.ownership import MARKER
from upcycle.scripts import claim_work, clear, note

ROOT = Path(__file__).resolve().parents[2]
WRITE_COST = str(ROOT / "benchmarks" / "speed" / "write_cost.py")


def run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_write_cost_refuses_a_users_folder_and_deletes_nothing_of_it(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    done = run_script([WRITE_COST, "--rounds", "1", "--pause", "0", "--work", str(users)], tmp_path)
    assert done.returncode != 0 and "holds files a benchmark did not make" in done.stderr
    assert (users / "thesis.tex").read_text() == "years of work"
    done = run_script([WRITE_COST, "--rounds", "0", "--work", str(tmp_path / "w")], tmp_path)
    assert done.returncode == 2 and "--rounds must be >= 1" in done.stderr and not (tmp_path / "w").exists()


def test_a_work_folder_is_claimed_only_when_new_empty_or_a_benchmarks(tmp_path):
    work = claim_work(tmp_path / "a" / "work")
    assert (work / MARKER).is_file()
    (work / "x").mkdir()
    note(work / "x")                                         # what the benchmark wrote, recorded
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
    ("speed/moe_layer.py", ["--tokens", "0"], "--tokens must be >= 1, got 0"),
    ("speed/moe_layer.py", ["--out", "{tmp}"], "is a folder; give the JSON file to write"),
    ("speed/train_step.py", ["--steps", "0", "--device", "cpu"], "--steps must be >= 1, got 0"),
    ("speed/moe_layer.py", ["--device", "cuda:7"], "torch sees no such GPU here"),
    ("interop/runtimes_check.py", ["--only", "bogus"], "--only takes parts of"),
    ("interop/verify_reports.py", ["{tmp}"], "is not a folder `upcycle convert` wrote"),
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


def test_an_empty_folder_given_as_work_is_kept_and_only_what_was_written_goes(tmp_path):
    """A user's empty folder given as --work stays when the benchmark clears it; a folder marked by an older
    benchmark (its marker file, no record) that a user put files into, and a record that is a link, are refused
    before any work, and nothing of the user's is touched."""
    given = tmp_path / "given"
    given.mkdir()
    work = claim_work(given)
    (work / "scratch.txt").write_text("benchmark's")
    note(work / "scratch.txt")
    clear(work, work)
    assert given.is_dir() and list(given.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / ".upcycle-benchmark-work").touch()           # what an interrupted run of the older benchmark left
    (old / "mine.txt").write_text("mine")
    with pytest.raises(SystemExit, match="did not make"):
        claim_work(old)
    assert (old / "mine.txt").read_text() == "mine"
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "thesis.txt").write_text("years of work")
    (linked / MARKER).symlink_to(tmp_path / "thesis.txt")
    with pytest.raises(SystemExit, match="did not make"):
        claim_work(linked)
    assert (tmp_path / "thesis.txt").read_text() == "years of work" and (linked / MARKER).is_symlink()
