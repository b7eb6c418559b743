"""A pytest plugin for runs that may be stopped at a time limit (benchmarks/gpu/gpu_check.sh loads it with
`-p live_report`): each test's outcome is appended to the file named by $UPCYCLE_TEST_REPORT as one JSON line the
moment it is known, with a failure's text and a skip's reason, so that a run killed before its end still says
what passed, what failed and why. Under pytest-xdist the controller writes (it receives every worker's reports)."""

from __future__ import annotations

import json
import os

_writer = {"on": False}


def pytest_configure(config) -> None:
    _writer["on"] = bool(os.environ.get("UPCYCLE_TEST_REPORT")) and not hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    # one line per test: its call, or the setup/teardown phase that did not pass
    if not _writer["on"] or (report.when != "call" and report.passed):
        return
    record = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
              "seconds": round(report.duration, 3)}
    if report.failed:
        record["text"] = report.longreprtext[-6000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[-1])
    with open(os.environ["UPCYCLE_TEST_REPORT"], "a") as f:
        f.write(json.dumps(record) + "\n")
