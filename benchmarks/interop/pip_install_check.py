"""The pip path, end to end: a wheel of this checkout in a fresh virtual environment, then the documented asset
step, then a conversion and a short training run from an empty directory, with nothing of the repository in
reach (no Makefile, no recipe folder, no editable install) and a fresh upcycle cache (so the embedded model's
first-use build runs too).

    .venv/bin/python benchmarks/interop/pip_install_check.py              # about 10 minutes on 2 CPU cores
    .venv/bin/python benchmarks/interop/pip_install_check.py --work DIR   # keep the venv and outputs in DIR

Steps, each a command whose exit status and wall time are recorded:
    pip wheel --no-deps SRC -w DIST                    (SRC: a copy of pyproject.toml, README.md, LICENSE, src/)
    python -m venv VENV
    VENV/bin/python -m pip install torch==2.13.0       (the CPU build this machine has; any torch >= 2.6 works)
    VENV/bin/python -m pip install DIST/upcycle-*.whl
    upcycle assets install                             (the documented asset step)
    upcycle --version; upcycle assets list
    upcycle convert default moe --num-experts 8 --top-k 2 --every 2     (the README's Quickstart conversion)
    upcycle train moe run --config smollm2-copy --steps 2
    upcycle eval run --tokens 4096
Writes benchmarks/results/pip_install_check.json: the machine and versions (as the fresh environment reports
them), each step, the probe's source (held-out text, not random ids) and the run's perplexities. Exits 1 when
a step fails, after writing the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from upcycle.scripts import output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TORCH = "torch==2.13.0"           # the CPU build on disk here (the Makefile's pin); pyproject takes any >= 2.6
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE")


def copy_source(target: Path) -> Path:
    """The files a wheel is built from, copied away from the checkout (its build/ and egg-info stay untouched)."""
    for name in SOURCE_FILES:
        shutil.copy2(ROOT / name, target / name)
    shutil.copytree(ROOT / "src" / "upcycle", target / "src" / "upcycle",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def step(steps: list[dict], work: Path, name: str, command: list, cwd: Path,
         env: dict) -> subprocess.CompletedProcess:
    """Run one step, record it (the command with the work folder written as $WORK), and keep its output in a log."""
    t = time.perf_counter()
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    (work / "logs").mkdir(exist_ok=True)
    (work / "logs" / f"{name}.log").write_text(f"$ {' '.join(map(str, command))}\n{done.stdout}\n{done.stderr}")
    shown = " ".join(str(c).replace(str(work), "$WORK") for c in command)
    steps.append({"step": name, "command": shown, "cwd": str(cwd).replace(str(work), "$WORK"),
                  "exit_status": done.returncode, "wall_s": round(wall, 1)})
    if done.returncode != 0:
        steps[-1]["stderr_tail"] = done.stderr[-3000:]
    print(f"{name}: exit {done.returncode}, {wall:.1f} s", flush=True)
    return done


def last_json(text: str) -> dict:
    """The JSON object a command printed last (its summary), or {}."""
    start = text.rfind("\n{")
    try:
        return json.loads(text[start + 1 if start >= 0 else text.find("{"):].split("\nwrote ")[0])
    except ValueError:
        return {}


def run(work: Path) -> dict:
    steps: list[dict] = []
    result: dict = {"steps": steps}
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["UPCYCLE_CACHE"] = str(work / "cache")          # a fresh cache: the first-use build of the model runs
    venv, empty = work / "venv", work / "empty"
    bin_ = venv / "bin"
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    src, dist = copy_source(Path(tempfile.mkdtemp(dir=work, prefix="src-"))), work / "dist"
    empty.mkdir()

    def ok(name: str, command: list, cwd: Path = work) -> subprocess.CompletedProcess | None:
        done = step(steps, work, name, command, cwd, env)
        return done if done.returncode == 0 else None

    if not ok("build wheel", [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", src, "-w", dist]):
        return result
    wheel = next(dist.glob("upcycle-*.whl"))
    result["wheel"] = wheel.name
    if not (ok("venv", [sys.executable, "-m", "venv", venv])
            and ok("install torch", [bin_ / "python", "-m", "pip", "install", "-q", TORCH])
            and ok("install wheel", [bin_ / "python", "-m", "pip", "install", "-q", wheel])
            and ok("assets install", [bin_ / "upcycle", "assets", "install"])):
        return result
    version = ok("version", [bin_ / "upcycle", "--version"])
    assets = ok("assets list", [bin_ / "upcycle", "assets", "list"])
    result["upcycle_version"] = version.stdout.strip() if version else None
    result["assets"] = assets.stdout.strip().splitlines() if assets else None
    machine = ok("machine", [bin_ / "python", "-c", "import json; from upcycle.machine import machine; "
                                                   "print(json.dumps(machine()))"])
    result["machine"] = json.loads(machine.stdout) if machine else None
    converted = ok("convert", [bin_ / "upcycle", "convert", "default", "moe", "--num-experts", "8", "--top-k", "2",
                               "--every", "2", "--quiet"], empty)
    if not converted:
        return result
    report = json.loads((empty / "moe" / "upcycle_report.json").read_text())
    result["conversion"] = {k: report.get(k) for k in ("num_moe_layers", "max_abs_logit_diff")}
    result["conversion"].update({k: report["preservation"].get(k) for k in ("probe_source", "passed")})
    result["conversion"]["random_ids_warning"] = "random token ids" in converted.stderr
    train = ok("train", [bin_ / "upcycle", "train", "moe", "run", "--config", "smollm2-copy", "--steps", "2",
                         "--quiet"], empty)
    if not train:
        return result
    summary = last_json(train.stdout)
    result["train"] = {k: summary.get(k) for k in ("step", "eval_before", "eval_after")}
    evaluated = ok("eval", [bin_ / "upcycle", "eval", "run", "--tokens", "4096"], empty)
    result["eval"] = last_json(evaluated.stdout) if evaluated else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=output_folder,
                        help="folder for the venv and outputs (default: a temporary one, removed)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="upcycle-pip-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        result = run(work.resolve())
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["passed"] = bool(result["steps"]) and all(s["exit_status"] == 0 for s in result["steps"]) \
        and result.get("eval") is not None
    result["total_s"] = round(time.perf_counter() - t, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pip_install_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"passed: {result['passed']} -> {RESULTS / 'pip_install_check.json'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
