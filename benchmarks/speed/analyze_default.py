"""`upcycle analyze` on the embedded SmolLM2-135M: converted with copy, drop and cluster, and the two training runs
of benchmarks/studies/smollm2_train.py, each analyzed with the default three sources (held-out Wikipedia, the Python
standard library, license texts). Times the default analysis of the copy-upcycled model (the `make demo`
model) and screenshots its report in headless Chromium.

    .venv/bin/python benchmarks/speed/analyze_default.py --convert   # convert copy/drop/cluster into out/ first
    .venv/bin/python benchmarks/speed/analyze_default.py             # analyze what is in out/ (runs when present)
    .venv/bin/python benchmarks/speed/analyze_default.py --redraw    # redraw the kept figures from the kept JSON

Conversions (8 experts, top-2, every other block, as `make demo`):
    upcycle convert default out/smollm2-moe     --method copy    --num-experts 8 --top-k 2 --every 2
    upcycle convert default out/smollm2-drop    --method drop    --num-experts 8 --top-k 2 --every 2
    upcycle convert default out/smollm2-cluster --method cluster --num-experts 8 --top-k 2 --every 2
Analyses:
    upcycle analyze out/smollm2-moe out/analysis-copy          (and drop, cluster)
    upcycle analyze out/train-copy  out/analysis-train-copy --checkpoints every:5    (and spri)
Writes benchmarks/results/analysis_default.json (timings, machine, layer means per target),
benchmarks/results/analysis_<target>/ (analysis.json and the figures) and analysis_default_report.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "out"
CONVERSIONS = {"copy": "smollm2-moe", "drop": "smollm2-drop", "cluster": "smollm2-cluster"}
RUNS = {"train-copy": "train-copy", "train-spri": "train-spri"}
RUN_FLAGS = ("--checkpoints", "every:5")
KEPT_FIGURES = ("layers.png", "specialization.png", "similarity.png", "router_probs.png", "steps.png")


def upcycle(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "upcycle.cli", *args], cwd=ROOT, env=env, check=True)


def timed_analyze(target: Path, out: Path, *flags: str) -> dict:
    """Wall and CPU seconds (user + system of the child) of one `upcycle analyze`, and the load around it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    upcycle("analyze", str(target.relative_to(ROOT)), str(out.relative_to(ROOT)), "--overwrite", *flags)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0]}


def screenshot(report: Path, png: Path) -> str | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return "chromium not installed (apt-get install chromium)"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png}", "--window-size=1100,2600", report.as_uri()], capture_output=True,
                   timeout=120, check=True)
    return None


def summary(analysis: dict) -> dict:
    from upcycle.figures.plots import layer_means

    return {s["label"]: {**{k: (round(v, 5) if isinstance(v, float) else v) for k, v in layer_means(s).items()},
                         "nll_per_source": s["nll"]["per_source"],
                         "kl_per_source": (s.get("kl_to_dense") or {}).get("per_source")}
            for s in analysis["snapshots"]}


def keep(out: Path, name: str) -> None:
    """analysis.json (compact) and the main figures into benchmarks/results/analysis_<name>/."""
    target = RESULTS / f"analysis_{name}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    analysis = json.loads((out / "analysis.json").read_text())
    (target / "analysis.json").write_text(json.dumps(analysis, separators=(",", ":")) + "\n")
    for figure in KEPT_FIGURES:
        if (out / figure).is_file():
            shutil.copy(out / figure, target / figure)


def redraw() -> None:
    import tempfile

    from upcycle.figures.plots import write_figures

    for folder in sorted(RESULTS.glob("analysis_*/")):
        with tempfile.TemporaryDirectory() as tmp:
            write_figures(json.loads((folder / "analysis.json").read_text()), Path(tmp))
            for figure in KEPT_FIGURES:
                if (Path(tmp) / figure).is_file():
                    shutil.copy(Path(tmp) / figure, folder / figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--convert", action="store_true", help="convert copy, drop and cluster into out/ first")
    parser.add_argument("--only", nargs="*", help="analyze only these targets (copy drop cluster train-copy ...)")
    parser.add_argument("--redraw", action="store_true",
                        help="only redraw the kept figures from the kept analysis.json files (figures read only them)")
    args = parser.parse_args()
    if args.redraw:
        redraw()
        return
    if args.convert:
        for method, folder in CONVERSIONS.items():
            upcycle("convert", "default", f"out/{folder}", "--method", method, "--num-experts", "8", "--top-k", "2",
                    "--every", "2", "--overwrite", "--quiet")
    path = RESULTS / "analysis_default.json"
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()}
    targets = {**{m: OUT / f for m, f in CONVERSIONS.items()}, **{r: OUT / f for r, f in RUNS.items()}}
    for name, folder in targets.items():
        if (args.only and name not in args.only) or not folder.is_dir():
            continue
        out = OUT / f"analysis-{name}"
        flags = RUN_FLAGS if name in RUNS else ()
        timing = timed_analyze(folder, out, *flags)
        analysis = json.loads((out / "analysis.json").read_text())
        entry = {"command": " ".join(["upcycle analyze", f"out/{folder.name}", f"out/analysis-{name}", *flags]),
                 "timing": timing, "seconds": analysis["seconds"], "sources": analysis["inputs"]["sources"],
                 "summary": summary(analysis)}
        keep(out, name)
        # read again just before writing: another invocation may have added its targets meanwhile
        result = json.loads(path.read_text()) if path.exists() else {"targets": {}}
        result["machine"], result["targets"][name] = machine, entry
        if name == "copy":
            why = screenshot(out / "report.html", RESULTS / "analysis_default_report.png")
            result["screenshot"] = why or "benchmarks/results/analysis_default_report.png"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{name}: {timing['wall_s']} s wall, {timing['cpu_s']} s CPU (load average "
              f"{timing['load_average_before']:.1f})")


if __name__ == "__main__":
    main()
