"""A full disk or a file-size limit while a command writes: one line that says so and what was kept, exit 2, and
nothing left behind (no lock file, no temporary folder, no half-written checkpoint); an earlier output stays as it
was. Each command runs in a process under `ulimit -f` (RLIMIT_FSIZE), which fails a write past the limit with
EFBIG, as a full disk fails it with ENOSPC."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import pytest

from conftest import upcycle_command, write_tiny_lm
from upcycle.files import no_room

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 48 * 1024          # bytes: the lock's line and a run's small files fit; a model's weights do not


def limited(args: list[str], cwd: Path, limit: int = LIMIT) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([*upcycle_command(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=cap)


def left_behind(folder: Path) -> list[str]:
    """Locks and temporaries anywhere below `folder`."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.name.endswith((".lock", ".tmp")) or ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return write_tiny_lm(tmp_path_factory.mktemp("no-room"))


def check_refused(done: subprocess.CompletedProcess, work: Path, out: Path) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("upcycle: error: a file-size limit (ulimit -f) was reached"), \
        done.stderr[-3000:]
    assert "nothing of this one was kept" in lines[0] and "Traceback" not in done.stderr
    assert not out.exists() and left_behind(work) == []


def test_convert_under_a_file_size_limit(lm, tmp_path):
    dense, _, _ = lm
    out = tmp_path / "out"
    done = limited(["convert", str(dense), str(out), "--method", "copy", "--num-experts", "4", "--top-k", "2",
                    "--quiet"], tmp_path)
    check_refused(done, tmp_path, out)


def test_export_under_a_file_size_limit_keeps_the_earlier_output(lm, tmp_path):
    from upcycle.cli import main

    dense, _, _ = lm
    assert main(["convert", str(dense), str(tmp_path / "moe"), "--method", "copy", "--num-experts", "4",
                 "--top-k", "2", "--quiet"]) == 0
    assert main(["export", str(tmp_path / "moe"), str(tmp_path / "out")]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    done = limited(["export", str(tmp_path / "moe"), str(tmp_path / "out"), "--overwrite"], tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "file-size limit" in lines[0], done.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == before
    assert left_behind(tmp_path) == []


def test_train_under_a_file_size_limit_leaves_no_half_checkpoint(lm, tmp_path):
    dense, train_txt, held = lm
    out = tmp_path / "run"
    done = limited(["train", str(dense), str(out), "--data", str(train_txt), "--eval-data", str(held),
                    "--steps", "2", "--batch-size", "2", "--sequence-length", "16", "--quiet"], tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len([line for line in lines if line.startswith("upcycle: error:")]) == 1
    assert "file-size limit" in lines[-1] and "Traceback" not in done.stderr
    assert left_behind(tmp_path) == []
    assert not list(out.glob("checkpoints/.step-*"))


def test_train_whose_optimizer_state_finds_no_room_says_so(lm, tmp_path):
    """The model's weights fit under the limit and the optimizer's state (Adam: two float32 moments per weight)
    does not: torch.save's own writer called that "unexpected pos" in a traceback; through a Python file it is the
    one-line refusal, and no half-written checkpoint stays."""
    dense, train_txt, held = lm
    out = tmp_path / "run"
    weights = (dense / "model.safetensors").stat().st_size
    done = limited(["train", str(dense), str(out), "--data", str(train_txt), "--eval-data", str(held),
                    "--steps", "2", "--batch-size", "2", "--sequence-length", "16", "--quiet"], tmp_path,
                   limit=weights * 3 // 2)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("upcycle: error: a file-size limit (ulimit -f) was reached"), done.stderr[-3000:]
    assert left_behind(tmp_path) == [] and not out.exists(), sorted(str(p) for p in out.rglob("*"))


def test_no_room_reads_the_error_and_what_wrapped_it():
    assert no_room(OSError(28, "No space left on device", "/x/model.safetensors")) == \
        "no space left on the device writing /x/model.safetensors"
    try:
        try:
            raise OSError(27, "File too large")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from inner
    except RuntimeError as wrapped:
        assert no_room(wrapped) == "a file-size limit (ulimit -f) was reached"
    assert no_room(Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                             "\"No space left on device\" })")) == "no space left on the device"
    assert no_room(OSError(2, "No such file or directory")) is None and no_room(ValueError("x")) is None
