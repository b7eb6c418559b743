"""A training run's folder as others read it (`upcycle analyze RUN`, `upcycle eval RUN`, `upcycle compare`), without
the trainer's package: the names of what a run writes, and its checkpoints in order. What a run may write there is
`upcycle.training.run.folder`'s.

  OUT/run_config.yaml   the run's config, as it ran
  OUT/inputs.json       the model and data as absolute paths, and the data's size and SHA-256
  OUT/log.jsonl         one JSON line per step and evaluation (`upcycle.runs.log`)
  OUT/checkpoints/step-NNNNNNN/   whole checkpoints (`upcycle.runs.checkpoint_format`)
  OUT/model/            the trained model
"""

from __future__ import annotations

from pathlib import Path

RUN_CONFIG = "run_config.yaml"
INPUTS = "inputs.json"           # the run's model and data as absolute paths (the run config keeps them as typed)
LOG = "log.jsonl"
CHECKPOINTS = "checkpoints"
# Where the libraries a run reports through write (TensorBoard, W&B): recorded as the run's when it checkpoints
# and when it ends, as they are then.
TRACKER_FOLDERS = ("tensorboard", "wandb")


def checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders of a run, oldest first (complete or not: see `upcycle.runs.checkpoint_format.problem`)."""
    folder = out / CHECKPOINTS
    return sorted(p for p in folder.glob("step-*") if p.is_dir()) if folder.exists() else []
