"""Merge the per-worker duration lines `make durations` wrote (tests/conftest.py) into tests/durations.json: every
test's wall seconds on this machine, slowest first, with the machine described. tests/rules/test_test_budget.py
holds the fast tier to its budget from this file.

    .venv/bin/python tests/durations.py FOLDER [--out tests/durations.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def merged(folder: Path) -> list[dict]:
    rows = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["test"]] = row
    return sorted(rows.values(), key=lambda row: (-row["seconds"], row["test"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=HERE / "durations.json")
    args = parser.parse_args()
    rows = merged(args.folder)
    if not rows:
        print(f"no durations in {args.folder}", file=sys.stderr)
        return 1
    import os

    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": platform.python_version()}
    fast = [row for row in rows if not row["slow"]]
    args.out.write_text(json.dumps({"machine": machine, "tests": len(rows), "fast_tests": len(fast),
                                    "fast_seconds": round(sum(r["seconds"] for r in fast), 1),
                                    "durations": rows}, indent=1) + "\n")
    print(f"wrote {args.out}: {len(rows)} tests ({len(fast)} fast, {sum(r['seconds'] for r in fast):.0f} s of them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
