"""The GPU check's results in one JSON file: the test run's totals, every failure with its first message line,
every skip with its reason, and the benchmarks' headline numbers (benchmarks/gpu_check.sh calls this last).

    python benchmarks/gpu_summary.py OUT [SECONDS]   -> OUT/summary.json
"""

from __future__ import annotations

import json
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


def layer_rows(path: Path) -> list[dict] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [{"shape": r.get("shape"), "tokens": r["tokens"],
             "fwd_bwd_upcycle_vs_best_hf": r["forward_backward"]["upcycle_vs_best_hf"],
             "fwd_upcycle_vs_best_hf": r["forward"]["upcycle_vs_best_hf"],
             "peak_bytes": r["forward_backward"].get("peak_bytes")} for r in data["results"]]


def main() -> None:
    out = Path(sys.argv[1])
    summary = {"environment": json.loads((out / "environment.json").read_text())
               if (out / "environment.json").is_file() else None,
               "seconds": int(sys.argv[2]) if len(sys.argv) > 2 else None,
               "tests": junit(out / "junit.xml"),
               "moe_layer": {dtype: layer_rows(out / f"moe_layer_cuda_{dtype}.json")
                             for dtype in ("bfloat16", "float32", "tf32")}}
    for key, name in (("train_step", "train_step_cuda.json"), ("train_step_compile", "train_step_cuda_compile.json")):
        if (out / name).is_file():
            summary[key] = {model: {k: v for k, v in r.items() if k in (
                "tokens_per_s", "share_of_flop_ideal", "speedup_vs_mixtral_grouped_mm", "peak_bytes", "error")}
                for model, r in json.loads((out / name).read_text())["results"].items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    t = summary["tests"]
    print(f"tests: {t.get('passed')} passed, {t.get('failed')} failed, {t.get('skipped')} skipped"
          f" -> {out / 'summary.json'}")


if __name__ == "__main__":
    main()
