"""The checkpoint manager of a run: writes a checkpoint of the whole state (`upcycle.training.run.state`'s files)
into a staging folder (`upcycle.outputs.staging.Staging`, shared by every process) put in place when complete,
keeps the newest `keep_checkpoints`, resumes from one, and writes the final model. Under FSDP every process helps
gather the whole tensors and the main process writes them, so a checkpoint reads the same whatever wrote it."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path

import torch
from torch import nn

from ...checkpoint.upcycle_format import save_folder_files, save_tokenizer
from ...outputs.ownership import read_record, remove_listed, remove_owned, write_marker
from ...outputs.staging import Staging, atomic_directory, replace_directory, temporary_owner
from ...runs.checkpoint_format import write_manifest
from ...runs.layout import CHECKPOINTS, checkpoints
from ..parallel import sharding
from ..parallel.accelerator import Prepared
from ..step import any_process
from . import state as run_state
from .folder import RunFolder


class Checkpointer:
    def __init__(self, folder: RunFolder, accelerator, parts: Prepared, *, keep: int) -> None:
        self.folder, self.acc, self.parts, self.keep = folder, accelerator, parts, keep
        self.is_main, self.rank = accelerator.is_main_process, accelerator.process_index
        # the main process names the staging folder every process writes a checkpoint into
        owner = [(socket.gethostname(), os.getpid())]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            owner = broadcast_object_list(owner)
        self.owner = tuple(owner[0])

    def load(self, checkpoint: Path) -> dict:
        """Restore a checkpoint into the prepared parts; the run's counters (step, tokens)."""
        parts = self.parts
        return run_state.load(checkpoint, model=parts.inner, optimizer=parts.optimizer, scheduler=parts.scheduler,
                              rank=self.rank, device=self.acc.device, teacher=parts.objective.teacher,
                              sharded=self.parts.sharded)

    def drop_partial(self) -> None:
        """Remove checkpoint writes a crash cut off (main process, when a run resumes)."""
        folder = self.folder.path / CHECKPOINTS
        for stale in folder.glob(".step-*") if folder.is_dir() else ():
            if temporary_owner(stale.name) == "gone" and stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)

    def save(self, step: int, tokens: int) -> None:
        """Every process's RNG, then the main process's state, into a temporary folder renamed when complete;
        then the oldest checkpoints beyond `keep` go."""
        folder = self.folder.path / CHECKPOINTS
        if self.is_main and not folder.exists():       # made and recorded first: a run undone removes it again
            folder.mkdir()
            self.folder.remember([CHECKPOINTS])
        # every process writes its RNG state into the one staging folder, which the main process makes
        staging = Staging(folder / f"step-{step:07d}", shared=self.owner, make=self.is_main)
        tmp = staging.path
        self.acc.wait_for_everyone()
        try:
            run_state.save_rng(tmp, self.rank)
            model_state, optimizer_state, teacher_state = self._whole_state()
            if self.is_main:
                with self._whole_model(model_state) as model:
                    run_state.save_main(tmp, model=model, optimizer_state=optimizer_state,
                                        scheduler=self.parts.scheduler, step=step, tokens=tokens,
                                        teacher_state=teacher_state)
            self.acc.wait_for_everyone()
            if self.is_main:
                write_manifest(tmp, step=step, processes=self.acc.num_processes)
        except BaseException:            # a full disk, a kill: no half-written checkpoint left beside the others
            if self.is_main:
                staging.discard()
            raise
        if self.is_main:
            # a checkpoint of this step saved before (a resumed run passing it again) is the run's: its files are
            # judged by the run's record, which lists them, so only a file changed since is kept aside
            prefix = f"{CHECKPOINTS}/{staging.out.name}/"
            listed = {rel[len(prefix):]: entry for rel, entry in
                      ((read_record(self.folder.path) or {}).get("files") or {}).items() if rel.startswith(prefix)}
            replace_directory(tmp, staging.out, lambda previous: remove_listed(previous, listed))
        self.folder.committed()
        if self.is_main:       # the run's record gets the checkpoint (and the log and trackers so far) ...
            run = self.folder.path
            written = sorted(p.relative_to(run).as_posix() for p in (run / CHECKPOINTS / staging.out.name).iterdir())
            self.folder.remember(written)
            for old in checkpoints(run)[:-self.keep]:    # ... then only what it records goes with an old one
                prefix = f"{CHECKPOINTS}/{old.name}"
                remove_owned(run, [prefix, *(f"{prefix}/{p.name}" for p in old.iterdir())])

    def save_model(self, tokenizer, *, moe: bool) -> None:
        """OUT/model (written by the main process; under FSDP every process first helps gather the weights,
        written in the dtypes the model was loaded in): an upcycle folder for a model with upcycle's MoE layers,
        else a plain transformers folder."""
        state = sharding.full_model_state(self.parts.inner, self.is_main) if self.parts.sharded else None
        if not self.is_main:
            return
        with self._whole_model(state, self.parts.dtypes) as model, \
                atomic_directory(self.folder.path / "model", overwrite=True, remove=remove_owned) as tmp:
            if moe:
                save_folder_files(model, tmp, tokenizer=tokenizer)
            else:
                model.save_pretrained(tmp)
                if tokenizer is not None:
                    save_tokenizer(tokenizer, tmp)
            # its own marker lists every file (sentence-transformers' module folders have any name): the run's
            # folder, which grows by patterns, judges model/ by it
            write_marker(tmp, "model")

    def _whole_state(self) -> tuple[dict | None, dict | None, dict | None]:
        """(model, optimizer, teacher) state for the main process to write: the optimizer's and teacher's own
        state dicts (the model is written from itself), or under FSDP all three gathered whole, every process
        taking part; None on the other processes."""
        teacher, optimizer = self.parts.objective.teacher, self.parts.optimizer
        if not self.parts.sharded:
            if not self.is_main:
                return None, None, None
            return None, optimizer.state_dict(), None if teacher is None else teacher.state_dict()
        keep = self.is_main
        model = sharding.full_model_state(self.parts.inner, keep)
        optimizer_state = sharding.full_optimizer_state(optimizer, keep)
        teachers = None if teacher is None else {
            layer: {k: sharding.gather(v, keep) for k, v in state.items()}
            for layer, state in teacher.state_dict()["teachers"].items()}
        if not keep:
            return None, None, None
        return model, optimizer_state, None if teachers is None else {"teachers": teachers}

    def _whole_model(self, state: dict | None, dtypes: dict | None = None):
        """The model to write: itself, or under FSDP itself with the gathered whole tensors in place."""
        if state is None:
            return contextlib.nullcontext(self.parts.inner)
        return sharding.full_parameters(self.parts.inner, state, dtypes)


def finite_parameters(model: nn.Module, accelerator) -> bool:
    """Every weight finite on every process (each checks its own shard under FSDP): a state worth keeping."""
    finite = all(bool(torch.isfinite(sharding.local(p)).all()) for p in model.parameters())
    return not any_process(accelerator, not finite)
