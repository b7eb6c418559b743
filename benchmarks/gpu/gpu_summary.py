"""The GPU check's results in one JSON file: the test run's totals, every failure with its first message line,
every skip with its reason, and the benchmarks' headline numbers (benchmarks/gpu/gpu_check.sh calls this last).

    python benchmarks/gpu/gpu_summary.py OUT [SECONDS]   -> OUT/summary.json
    python benchmarks/gpu/gpu_summary.py --docs            -> docs/gpu.md's table of every run in results/gpu/
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit(path: Path) -> dict:
    """Totals, failures and skips of a pytest junit XML file."""
    if not path.is_file():
        return {"missing": str(path)}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failures, skipped, passed = [], [], 0
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append({"test": name, "kind": bad.tag, "message": message[0][:300] if message else ""})
        elif skip is not None:
            skipped.append({"test": name, "reason": (skip.get("message") or "").strip()[:300]})
        else:
            passed += 1
    return {"passed": passed, "failed": len(failures), "skipped": len(skipped), "failures": failures,
            "skips": skipped}


def live_report(path: Path) -> dict:
    """Totals, failures and skips from tests/live_report.py's lines: a suite stopped at its time limit writes no
    junit XML, but every test that finished wrote its line."""
    if not path.is_file():
        return {"missing": str(path)}
    failures, skipped, passed = [], [], 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["outcome"] == "failed":
            text = r.get("text", "").strip().splitlines()
            failures.append({"test": r["test"], "kind": "failure" if r["when"] == "call" else "error",
                             "message": text[-1][:300] if text else ""})
        elif r["outcome"] == "skipped":
            skipped.append({"test": r["test"], "reason": r.get("reason", "")[:300]})
        else:
            passed += 1
    return {"passed": passed, "failed": len(failures), "skipped": len(skipped), "failures": failures,
            "skips": skipped, "from": "tests.jsonl (the suite did not finish: no junit.xml)"}


def progress_counts(path: Path) -> dict:
    """The last fallback, for a suite stopped before tests.jsonl existed: pytest -q's progress characters
    (. passed, F failed, E error, s skipped), counted without the tests' names."""
    if not path.is_file():
        return {"missing": str(path)}
    marks = "".join(line.split(" [")[0] for line in path.read_text().splitlines()
                    if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", line.strip()) or
                    re.match(r"^[.FEsxX]+\[session\]", line))
    marks = re.sub(r"\[session\].*", "", marks)
    return {"passed": marks.count("."), "failed": marks.count("F"), "errors": marks.count("E"),
            "skipped": marks.count("s"), "from": "pytest.log's progress characters (the suite did not finish, and "
                                                 "wrote neither junit.xml nor tests.jsonl)"}


def tests_of(out: Path) -> dict:
    if (out / "junit.xml").is_file():
        return junit(out / "junit.xml")
    if (out / "tests.jsonl").is_file():
        return live_report(out / "tests.jsonl")
    return progress_counts(out / "pytest.log")


def layer_rows(path: Path) -> list[dict] | None:
    if not path.is_file():
        printed = path.with_name(path.stem + "_printed.json")
        if not printed.is_file():
            return None
        rows = {}                      # the rows the runs printed, a later run's replacing an earlier one's
        for run in json.loads(printed.read_text())["runs"]:
            rows |= {(r["shape"], r["tokens"]): {"shape": r["shape"], "tokens": r["tokens"], "from": "printed",
                                                 "fwd_bwd_upcycle_vs_best_hf": r["fwd_bwd_upcycle_vs_best_hf"]}
                     for r in run["rows"]}
        return list(rows.values())
    data = json.loads(path.read_text())
    return [{"shape": r.get("shape"), "tokens": r["tokens"],
             "fwd_bwd_upcycle_vs_best_hf": r["forward_backward"]["upcycle_vs_best_hf"],
             "fwd_upcycle_vs_best_hf": r["forward"]["upcycle_vs_best_hf"],
             "peak_bytes": r["forward_backward"].get("peak_bytes")} for r in data["results"]]


def summarize(out: Path, seconds: int | None = None) -> dict:
    summary = {"environment": json.loads((out / "environment.json").read_text())
               if (out / "environment.json").is_file() else None,
               "seconds": seconds, "tests": tests_of(out),
               "moe_layer": {dtype: layer_rows(out / f"moe_layer_cuda_{dtype}.json")
                             for dtype in ("bfloat16", "float32", "tf32")}}
    for key, name in (("train_step", "train_step_cuda.json"), ("train_step_compile", "train_step_cuda_compile.json")):
        if (out / name).is_file():
            summary[key] = {model: {k: v for k, v in r.items() if k in (
                "tokens_per_s", "share_of_flop_ideal", "speedup_vs_mixtral_grouped_mm", "peak_bytes", "error")}
                for model, r in json.loads((out / name).read_text())["results"].items()}
    if (out / "NOTES.md").is_file():
        summary["notes"] = "NOTES.md"
    return summary


# ---------------------------------------------------------------- docs/gpu.md's table of GPU runs
DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
RUNS = Path(__file__).resolve().parents[1] / "results" / "gpu"
START, END = "<!-- gpu-runs: written by benchmarks/gpu/gpu_summary.py --docs -->", "<!-- gpu-runs: end -->"
TARGETS = "targets: tests 0 failed / 0 errors; layer ≤ 0.90× transformers' best; step ≥ 0.90 of the FLOP ideal " \
          "and ≥ 2.5× Mixtral"


def run_row(folder: Path) -> str:
    s = json.loads((folder / "summary.json").read_text())
    env = s.get("environment") or {}
    t = s["tests"]
    if "missing" in t:
        tests = "not run"
    else:
        bad = t.get("failed", 0) + t.get("errors", 0)
        tests = f"{t.get('passed')} passed, {bad} failed or errors, {t.get('skipped')} skipped"
        if "from" in t:
            tests += " (did not finish)"
    layer = s["moe_layer"].get("bfloat16") or []
    layer_text = ", ".join(f"{r['shape']} {r['tokens'] // 1024}k {r['fwd_bwd_upcycle_vs_best_hf']:.2f}"
                           for r in layer) + (f" ({6 - len(layer)} of 6 not measured)" if len(layer) < 6 else "") \
        if layer else "not measured"
    step = (s.get("train_step") or {}).get("upcycle_every_1") or {}
    step_text = (f"{step['share_of_flop_ideal']:.3f} of ideal, {step['speedup_vs_mixtral_grouped_mm']:.2f}× Mixtral"
                 if "share_of_flop_ideal" in step else "not measured")
    compiled = (s.get("train_step_compile") or {}).get("upcycle_every_1") or {}
    compile_text = f"{compiled['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in compiled else "not measured"
    notes = f" [notes](../benchmarks/results/gpu/{folder.name}/NOTES.md)" if (folder / "NOTES.md").is_file() else ""
    return (f"| `{folder.name}`{notes} | {env.get('gpu')}, torch {env.get('torch')}, transformers "
            f"{env.get('transformers')} | {tests} | {layer_text} | {step_text} | {compile_text} |")


def write_docs() -> None:
    rows = [run_row(f) for f in sorted(RUNS.iterdir()) if (f / "summary.json").is_file()]
    table = "\n".join([START, "", f"Every GPU run in `benchmarks/results/gpu/` ({TARGETS}):", "",
                       "| run | machine | non-slow suite | MoE layer fwd+bwd, bf16: upcycle / transformers' best | "
                       "whole-model step, every-block MoE | compiled step |", "|---|---|---|---|---|---|", *rows, "",
                       END])
    text = DOCS.read_text()
    if START in text:
        text = text[:text.index(START)] + table + text[text.index(END) + len(END):]
    else:
        raise SystemExit(f"{DOCS} has no {START!r} line to write the table after")
    DOCS.write_text(text)
    print(f"wrote the table of {len(rows)} GPU run(s) into {DOCS}")


def main() -> None:
    if sys.argv[1] == "--docs":
        write_docs()
        return
    out = Path(sys.argv[1])
    summary = summarize(out, int(sys.argv[2]) if len(sys.argv) > 2 else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    t = summary["tests"]
    print(f"tests: {t.get('passed')} passed, {t.get('failed')} failed, {t.get('errors', 0)} errors, "
          f"{t.get('skipped')} skipped -> {out / 'summary.json'}")


if __name__ == "__main__":
    main()
