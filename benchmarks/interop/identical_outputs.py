"""Fingerprints of what upcycle writes, to show that a change of structure leaves every output byte-identical.

Runs four jobs on the embedded SmolLM2-135M with fixed seeds, each with the installed `upcycle` command:
  demo     upcycle convert default OUT --method copy --num-experts 8 --top-k 2 --every 2   (make demo's command)
  cluster  upcycle convert default OUT --method cluster --num-experts 4 --top-k 2 --layers 3,9 (4,096 tokens)
  merge    three sources (the base with seeded perturbations of its FFNs, written here), router `data`, every
           block MoE, each source's own text; and the same merge written as stock Mixtral (--export hf)
  export   upcycle export demo OUT (the stock class `auto` picks); the merge as GGUF (--format gguf, mixtral)
and writes, per job, the SHA-256 of every file it wrote. JSON files are hashed after the measured wall times
(`timings_s`) are taken out, the only field that differs between two runs of the same job, and the work folder's
path is written as <work>.

    .venv/bin/python benchmarks/interop/identical_outputs.py OUT/fingerprints.json [--work out/identical]
    .venv/bin/python benchmarks/interop/identical_outputs.py OUT/after.json \
        --compare benchmarks/results/identical_outputs/reference.json

With --compare it exits 1 and names every file whose fingerprint differs (or that one side lacks); with
--before-work (the work folder BEFORE came from) it writes --summary: how many files are identical, and for each
JSON file that differs, the keys and both values. benchmarks/results/identical_outputs/ holds the reference (the
fingerprints of the current code, on a 2-core x86-64 CPU: float rounding differs between CPUs) and the summaries
of the comparisons made against earlier references.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

from upcycle.machine import machine as machine_facts
from upcycle.scripts import output_folder, perturbed_copy

ROOT = Path(__file__).resolve().parents[2]
UPCYCLE = [sys.executable, "-m", "upcycle.cli"]
OWNERSHIP_RECORD = ".upcycle-output.json"
VOLATILE_KEYS = {"timings_s"}   # measured seconds: the one thing two runs of one job do not share
SOURCES = ("prose", "code", "sums")


def _drop_volatile(value):
    if isinstance(value, dict):
        return {k: _drop_volatile(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_drop_volatile(v) for v in value]
    return value


def _own_files_unhashed(record: dict) -> dict:
    """An output's ownership record without the size and hash of its JSON and YAML files (they hold the measured
    seconds and paths fingerprinted above without them, so their bytes differ between two runs of one job) and
    without any file's modification time (a large file is recorded by size, time and a sampled hash)."""
    def kept(name: str, entry):
        if not isinstance(entry, dict):
            return entry
        dropped = {"mtime_ns", *(("size", "sha256") if name.endswith((".json", ".yaml")) else ())}
        return {k: v for k, v in entry.items() if k not in dropped}
    files = {name: kept(name, entry) for name, entry in record.get("files", {}).items()}
    return {**record, "files": files}


def fingerprint(path: Path, work: Path) -> str:
    """SHA-256 of the file's bytes; of JSON without `timings_s` (and an output's ownership record without the hashes
    of its JSON and YAML files); with the work folder's path written as <work> in JSON and YAML (a merge records its
    sources' paths), so two work folders can be compared."""
    if path.suffix in (".json", ".yaml"):
        text = path.read_text().replace(str(work), "<work>")
        if path.suffix == ".json":
            value = _drop_volatile(json.loads(text))
            if path.name == OWNERSHIP_RECORD:
                value = _own_files_unhashed(value)
            text = json.dumps(value, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprints(folder: Path, work: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): fingerprint(p, work) for p in sorted(folder.rglob("*")) if p.is_file()}


def run(*args) -> None:
    quiet = ["--quiet"] if args[0] == "convert" else []
    subprocess.run([*UPCYCLE, *map(str, args), *quiet, "--overwrite"], check=True, cwd=ROOT)


def make_sources(base: Path, work: Path) -> list[tuple[Path, Path]]:
    """Three 'fine-tunes' (`perturbed_copy`), and a text file each."""
    tensors = load_file(str(base / "model.safetensors"))
    texts = {
        "prose": "The history of the town dates back to the twelfth century, when a small market grew by the river.",
        "code": "def area(radius):\n    import math\n    return math.pi * radius ** 2\n\nprint(area(2.0))",
        "sums": "Question: What is 37 + 48? Answer: 85. Question: What is 12 + 9? Answer: 21.",
    }
    made = []
    for seed, name in enumerate(SOURCES):
        folder = work / "sources" / name
        perturbed_copy(base, folder, seed, tensors)
        data = work / "sources" / f"{name}.txt"
        data.write_text("\n".join(f"{texts[name]} ({i})" for i in range(40)) + "\n")
        made.append((folder, data))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=output_folder, default=ROOT / "out" / "identical")
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--rehash", action="store_true", help="hash the work folder's outputs again, run nothing")
    parser.add_argument("--before-work", type=Path, help="with --compare: the work folder of BEFORE, to name the "
                                                           "keys of the JSON files that differ")
    parser.add_argument("--commits", nargs=2, metavar=("BEFORE", "AFTER"), help="the commits the two ran at")
    parser.add_argument("--summary", type=Path,
                        default=ROOT / "benchmarks" / "results" / "identical_outputs" / "summary.json")
    args = parser.parse_args()
    from upcycle.data.assets import default_model_path  # the embedded model's plain folder (from its wheel)

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = default_model_path()
    jobs = {
        "demo": ["convert", "default", work / "demo", "--method", "copy", "--num-experts", 8, "--top-k", 2,
                 "--every", 2],
        "cluster": ["convert", "default", work / "cluster", "--method", "cluster", "--num-experts", 4, "--top-k", 2,
                    "--layers", "3,9", "--calibration-tokens", 4096],
        "export-hf": ["export", work / "demo", work / "export-hf"],
    }
    experts = [f"--expert={folder}={data}" for folder, data in make_sources(base, work)]
    merge = ["convert", "default", None, *experts, "--router", "data", "--every", 1, "--top-k", 2,
             "--calibration-tokens", 1024]
    jobs["merge"] = [*merge[:2], work / "merge", *merge[3:]]
    jobs["merge-mixtral"] = [*merge[:2], work / "merge-mixtral", *merge[3:], "--export", "hf", "--export-class",
                             "mixtral"]
    jobs["export-gguf"] = ["export", work / "merge", work / "export-gguf", "--format", "gguf", "--export-class",
                           "mixtral"]
    result = {}
    for name, job in jobs.items():
        print(f"{name}: upcycle {' '.join(map(str, job))}", flush=True)
        if not args.rehash:
            run(*job)
        result[name] = fingerprints(job[2], work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = [f"{job}/{file}" for job in sorted(set(before) | set(result))
                  for file in sorted(set(before.get(job, {})) | set(result.get(job, {})))
                  if before.get(job, {}).get(file) != result.get(job, {}).get(file)]
        print("identical" if not differ else "differ: " + ", ".join(differ))
        if args.before_work:
            commits = dict(zip(("before", "after"), args.commits, strict=True)) if args.commits else {}
            summary = {"machine": machine_facts(), "commits": commits,
                       "files": sum(len(files) for files in result.values()),
                       "identical": sum(len(files) for files in result.values()) - len(differ),
                       "differ": {name: json_differences(args.before_work / name, work / name, args.before_work, work)
                                  for name in differ}}
            args.summary.write_text(json.dumps(summary, indent=1) + "\n")
        sys.exit(1 if differ else 0)


def json_differences(a: Path, b: Path, work_a: Path, work_b: Path) -> list[dict] | str:
    """The keys whose values differ between two JSON files (timings and the work folder's path aside)."""
    if a.suffix != ".json" or not a.is_file() or not b.is_file():
        return "not JSON, or one side lacks it"
    x = _drop_volatile(json.loads(a.read_text().replace(str(work_a), "<work>")))
    y = _drop_volatile(json.loads(b.read_text().replace(str(work_b), "<work>")))
    found = []

    def walk(u, v, path: str) -> None:
        if isinstance(u, dict) and isinstance(v, dict):
            for key in sorted(set(u) | set(v)):
                walk(u.get(key), v.get(key), f"{path}/{key}")
        elif isinstance(u, list) and isinstance(v, list) and len(u) == len(v):
            for i, (p, q) in enumerate(zip(u, v, strict=True)):
                walk(p, q, f"{path}[{i}]")
        elif u != v:
            found.append({"key": path, "before": u, "after": v})

    walk(x, y, "")
    return found


if __name__ == "__main__":
    main()
