"""`report_to`: a training run's log lines, also sent to TensorBoard or Weights & Biases through Accelerate's
trackers (docs/training.md, "Watching a run").

Every record the trainer writes to log.jsonl goes to the tracker as scalars, with the same values (so a curve in
TensorBoard is the log's numbers, at float32), under these tags:

    loss/<term>                        task, each regularizer (unweighted), eesd, total
    lr  tokens  tokens_per_s  seconds  grad_norm
    routing/<layer>/entropy|load_cov|dropped      per MoE layer (`upcycle.metrics.routing.record_stats`)
    eval/<metric>                      perplexity, nll, tokens; CLIP: zero_shot/accuracy, image_to_text/R@1 ...
    skipped                            1 at a step that did not update the weights

Only the main process reports. The trackers write inside the run folder (OUT/tensorboard/, OUT/wandb/). A run
that replaces an existing OUT (--overwrite) is written to a temporary sibling until its first checkpoint: its
records are kept in memory until then and sent once the run is OUT, so no tracker file is written to a folder
that is about to be renamed (wandb writes some of its files by path at the end of a run).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import UpcycleError
from ...runs.log import flatten_numbers

TENSORBOARD = "tensorboard"          # OUT/tensorboard/: the event files
WANDB_PROJECT = "upcycle"


def check_available(report_to: str | None) -> None:
    """Refuse a tracker whose package is not installed, before the run writes anything."""
    if report_to is None:
        return
    import importlib.util

    if importlib.util.find_spec(report_to) is None:       # each tracker's package has its name
        raise UpcycleError(f"report_to {report_to} needs the {report_to} package, which is not installed "
                           f"(pip install {report_to})")


def scalars(record: dict) -> dict[str, float]:
    """The scalars of one log record, by tag (the module docstring lists them); `step` is the x axis, not a tag."""
    body = {k: v for k, v in record.items() if k != "step"}
    if "layers" in body:
        body["routing"] = body.pop("layers")
    out: dict[str, float] = {}
    flatten_numbers(body, "", out)
    if isinstance(record.get("skipped"), str):
        out["skipped"] = 1
    return out


def flat_config(config: dict) -> dict[str, object]:
    """The run config as the trackers' hyperparameters: dotted keys, scalars kept, anything else as its text."""
    out: dict[str, object] = {}

    def walk(value, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    walk(config, "")
    return out


class Trackers:
    """The run's tracker (none when `report_to` is None): `log` each record, `start` once the run folder is where
    it stays (records logged before are kept and sent then), `close` at the end or on failure."""

    def __init__(self, report_to: str | None, config: dict, *, enabled: bool, resumed_at: int = 0) -> None:
        self.report_to = report_to if enabled else None
        self.config = flat_config(config)
        self.resumed_at = resumed_at
        self.tracker = None
        self.pending: list[dict] = []

    def start(self, folder: Path) -> None:
        """Start the tracker writing into `folder` (the run folder), and send what was logged so far."""
        if self.report_to is None or self.tracker is not None:
            return
        from accelerate import PartialState
        from accelerate.tracking import TensorBoardTracker, WandBTracker

        PartialState()      # the trackers log through Accelerate's logger, which needs its state (the trainer's)
        if self.report_to == "tensorboard":
            # purge_step: a resumed run hides the events its crashed predecessor logged after the checkpoint
            # (TensorBoard drops them when it reads the new file), as the run drops those log.jsonl lines
            kwargs = {"purge_step": self.resumed_at + 1} if self.resumed_at else {}
            tracker = TensorBoardTracker(TENSORBOARD, folder, **kwargs)
        else:
            # offline (WANDB_MODE=offline) it writes OUT/wandb/offline-run-*/, for `wandb sync` later
            tracker = WandBTracker(WANDB_PROJECT, dir=str(folder), name=folder.name)
        tracker.start()
        self.tracker = tracker
        tracker.store_init_configuration(self.config)
        pending, self.pending = self.pending, []
        for record in pending:
            self.log(record)

    def log(self, record: dict) -> None:
        if self.report_to is None:
            return
        if self.tracker is None:
            self.pending.append(record)
            return
        values = scalars(record)
        if values:
            self.tracker.log(values, step=int(record["step"]))

    def close(self) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.finish()
        self.report_to = None
