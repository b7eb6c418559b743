"""The public `upcycle.save` and `upcycle.load`, and `save_pretrained` on an upcycled model.

A model with upcycle's MoE layers is still an instance of its transformers class (LlamaForCausalLM, BertModel, ...),
whose `save_pretrained` would write a plain transformers folder: config.json of the dense model with the experts'
tensors beside it, which transformers reads back as the dense model with random MLPs. `mark_upcycled` gives the model
a subclass of its own class, with the same name, whose `save_pretrained` writes the upcycle format instead, so code
that saves any transformers model (a notebook, transformers' Trainer, Accelerate) writes a folder `load` reads back.

`save(model, folder)` follows the rules of every upcycle output (docs/design.md principle 4): the folder is written
whole or not at all, never over a folder upcycle did not write, and over its own only with `overwrite=True`.
`save_pretrained(folder)` keeps transformers' meaning instead: it writes its files into the folder, which may exist
and hold other files (a Trainer checkpoint's), replacing only the model files of an earlier upcycle save.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import UpcycleError
from ..files import no_room
from ..outputs.claims import claim_output
from ..outputs.ownership import indexed_shards
from ..outputs.staging import staged_directory
from .reader import INDEX_FILE, SINGLE_FILE, check_finite
from .upcycle_format import MOE_CONFIG, save_folder_files
from .upcycle_format import load as load_folder
from .writer import DEFAULT_MAX_SHARD_BYTES, parse_size

SAVE_KIND = "convert"       # a saved model is the same kind of output as a conversion's


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild the upcycled model of an upcycle folder (`upcycle_format.load`), ready to `save_pretrained` again."""
    return mark_upcycled(load_folder(path, dtype=dtype))


def save(model: nn.Module, folder: str | os.PathLike, *, tokenizer=None, overwrite: bool = False,
         max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `model` (upcycled in memory, loaded, or trained) as an upcycle folder that `load` reads back exactly.

    The folder must not exist, or be empty, or (with `overwrite=True`) be one upcycle wrote; it appears whole
    when the weights are written, and a failure leaves what was there before."""
    _check_upcycled(model)
    _check_finite(model.state_dict())
    folder = Path(folder).expanduser()
    try:
        with claim_output(folder, kind=SAVE_KIND, overwrite=overwrite) as claim, claim.directory() as tmp:
            save_folder_files(model, tmp, tokenizer=tokenizer, max_shard_bytes=parse_size(max_shard_size))
    except OSError as e:
        _refuse_no_room(e, "save", folder)
        raise
    return folder


def _refuse_no_room(error: OSError, who: str, folder: Path) -> None:
    """A write that found no room (a full disk, a file-size limit, a quota) as one UpcycleError; other errors are
    left to the caller."""
    why = no_room(error)
    if why is not None:
        raise UpcycleError(f"{who}: {why}; nothing was saved ({folder} is as it was)") from None


def _check_upcycled(model: nn.Module) -> None:
    from ..core.moe import moe_layers

    if not moe_layers(model):
        raise UpcycleError(f"{type(model).__name__} has no upcycle MoE layers; save a dense model with its own "
                           f"save_pretrained")


def _check_finite(state: dict) -> None:
    """Refuse weights with NaN or infinity (the check `load` makes, `reader.check_finite`), before anything is
    written: a save would write a folder that cannot be read back."""
    for name, tensor in state.items():
        if torch.is_tensor(tensor):
            check_finite(tensor, name, "the model (nothing was saved: upcycle.load refuses such a folder)")


# Model files of an upcycle folder; what an in-place save may replace (shards: model-00001-of-00003.safetensors)
def _model_files(folder: Path) -> tuple[list[str], list[str]]:
    """(the model files of an earlier upcycle save in `folder`, weight shards there that no index names): a shard
    the folder's index does not name was not written with it, and is never replaced or removed."""
    fixed = ("config.json", MOE_CONFIG, "generation_config.json", SINGLE_FILE, INDEX_FILE)
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    named = indexed_shards(folder)
    return ([name for name in fixed if (folder / name).exists()] + [n for n in shards if n in named],
            [n for n in shards if n not in named])


def save_in_place(model: nn.Module, folder: str | os.PathLike, *, state_dict: dict | None = None,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES) -> None:
    """transformers' `save_pretrained` semantics for the upcycle format: the folder may exist and hold other
    files; the model files of an earlier upcycle save there are replaced (stale shards removed), and model files
    upcycle did not write are refused rather than overwritten."""
    _check_upcycled(model)
    _check_finite(state_dict if state_dict is not None else model.state_dict())
    folder = Path(folder).expanduser()
    if folder.is_symlink():
        raise UpcycleError(f"save_pretrained: {folder} is a symbolic link; give the real folder (upcycle never "
                           f"writes through a link)")
    if folder.exists() and not folder.is_dir():
        raise UpcycleError(f"save_pretrained: {folder} is a file")
    blocking = next((p for p in folder.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UpcycleError(f"save_pretrained: {folder} cannot be made: {blocking} is a file; nothing was written")
    made = [p for p in (folder, *folder.parents) if not p.exists()]      # the folders this save makes
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UpcycleError(f"save_pretrained: {folder} cannot be made ({e.strerror or e}); nothing was "
                           f"written") from None
    try:
        _save_into(model, folder, state_dict, max_shard_size)
    except BaseException as e:
        for path in made:               # a failed save leaves no folder it made (an empty one, innermost first)
            try:
                path.rmdir()
            except OSError:
                break
        if isinstance(e, OSError):
            _refuse_no_room(e, "save_pretrained", folder)
        raise


def _save_into(model: nn.Module, folder: Path, state_dict: dict | None, max_shard_size: int | str) -> None:
    existing, unnamed = _model_files(folder)
    if existing and not (folder / MOE_CONFIG).is_file() or unnamed:
        found = unnamed or existing
        raise UpcycleError(f"save_pretrained: {folder} holds model files upcycle did not write "
                           f"({', '.join(found[:3])}); save into a new folder, or remove them yourself")
    linked = [name for name in existing if (folder / name).is_symlink()]
    if linked:
        raise UpcycleError(f"save_pretrained: {', '.join(linked[:3])} in {folder} is a symbolic link; upcycle "
                           f"never writes through a link")
    # weights first, config.json last: a folder caught half-way still fails to load rather than mixing
    with staged_directory(folder, into=True, last=(MOE_CONFIG, "config.json")) as tmp:
        save_folder_files(model, tmp, state_dict=state_dict, max_shard_bytes=parse_size(max_shard_size))
        written = sorted(p.name for p in tmp.iterdir())
        # every name about to be replaced must be a plain file: a folder or link there (config.json as a folder)
        # would fail half-way, after the weights had moved in
        odd = [n for n in written
               if (folder / n).is_symlink() or ((folder / n).exists() and not (folder / n).is_file())]
        if odd:
            raise UpcycleError(f"save_pretrained: {', '.join(odd[:3])} in {folder} is not a plain file (a folder or "
                               f"a link); upcycle writes its model files there: move it away. Nothing was written")
        foreign = _other_models_tensors(folder, existing, tmp)
        if foreign:
            raise UpcycleError(f"save_pretrained: the weights in {folder} are another model's (they hold "
                               f"{', '.join(foreign[:3])}, which this model does not have); replacing them would "
                               f"delete them: save into a new folder, or remove them yourself. Nothing was written")
    for name in existing:
        if name not in written:
            (folder / name).unlink()


def _other_models_tensors(folder: Path, existing: list[str], new: Path) -> list[str]:
    """Tensor names of the weights a save would replace in `folder` that the new save does not write: a re-save
    of the same model (or of the same model trained) replaces its own weights, another model's are not deleted."""
    from .reader import CheckpointReader

    if not any(name in (SINGLE_FILE, INDEX_FILE) for name in existing):
        return []
    try:
        old = set(CheckpointReader(folder).names())     # every shard's header is read: one unreadable is not ours
    except (UpcycleError, OSError) as e:
        raise UpcycleError(f"save_pretrained: the weights in {folder} cannot be read ({str(e)[:200]}), so whose "
                           f"they are cannot be told; replacing them would delete them: save into a new folder, or "
                           f"remove them yourself. Nothing was written") from None
    return sorted(old - set(CheckpointReader(new).names()))


class UpcycledModel:
    """Mixed in before an upcycled model's transformers class: `save_pretrained` writes the upcycle format."""

    _upcycle_marked = True

    def save_pretrained(self, save_directory: str | os.PathLike, *, is_main_process: bool = True,
                        state_dict: dict | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
                        push_to_hub: bool = False, **kwargs) -> None:
        if push_to_hub:
            raise UpcycleError("save_pretrained(push_to_hub=True) is not supported for upcycle folders: save, "
                               "then upload the folder with huggingface_hub's upload_folder")
        if is_main_process:
            save_in_place(self, save_directory, state_dict=state_dict, max_shard_size=max_shard_size)


_CLASSES: dict[type, type] = {}


def mark_upcycled(model: nn.Module) -> nn.Module:
    """Give `model` its class's upcycle subclass (same name and module, `UpcycledModel.save_pretrained`); the
    model is otherwise untouched. Idempotent; returns the model."""
    cls = type(model)
    if getattr(cls, "_upcycle_marked", False) or not hasattr(cls, "save_pretrained"):
        return model
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (UpcycledModel, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    model.__class__ = _CLASSES[cls]
    return model
