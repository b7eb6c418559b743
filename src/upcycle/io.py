"""The upcycle checkpoint format, and atomic output directories.

An upcycle folder holds (DESIGN principle 7, for any architecture):
  config.json            the dense base model's transformers config (unchanged)
  upcycle_config.json    the MoE config: model class, and per MoE layer its block path and constructor spec
  model.safetensors      all weights (tied tensors stored once)
  run_config.yaml        the resolved run configuration        upcycle_report.json   what the run measured
  tokenizer / generation config files, when the source had them (tokenizer_class readable by 4.x and 5.x)

`load(path)` rebuilds the base model from its config, installs empty MoE layers where the spec says, and loads
the weights strictly: a missing or unexpected tensor is an error, not a silent re-initialization.
Writing goes to a temporary sibling directory that is renamed into place at the end (principle 4), so an
interrupted or failed run leaves no partial output.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from .errors import UpcycleError
from .moe import MoELayer, moe_layers
from .surgery import install, track_padding_masks

FORMAT_VERSION = 1
MOE_CONFIG = "upcycle_config.json"
WEIGHTS = "model.safetensors"


def temp_prefix(out: Path, kind: str = "tmp") -> str:
    """Name prefix of a temporary sibling of `out` that records its owner (host and process id), so a later run
    can tell a temporary left by a killed process from one still being written."""
    return f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _owner_alive(name: str, out: Path) -> bool | None:
    """Whether the process that made temporary `name` of `out` still runs; None when unknown (another host, or
    a name without an owner, as older versions wrote)."""
    for kind in ("tmp", "old"):
        head = f".{out.name}.{kind}-"
        if not name.startswith(head):
            continue
        parts = name[len(head):].rsplit("-", 2)   # the host may contain '-'; the pid and mkdtemp's suffix do not
        if len(parts) != 3 or not parts[1].isdigit() or parts[0] != socket.gethostname():
            return None
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:       # another user's process: alive
            pass
        return True
    return None


def clean_stale_temporaries(out: str | os.PathLike) -> list[str]:
    """Remove temporaries of `out` whose owner process is gone (a run killed while writing); say on stderr (and
    return) what was removed and what was left (an owner still running, or on another host)."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    said = []
    stems = (f".{glob.escape(out.name)}.tmp-*", f".{glob.escape(out.name)}.old-*")
    for path in sorted(p for stem in stems for p in out.parent.glob(stem)):
        alive = _owner_alive(path.name, out)
        if alive is False:
            shutil.rmtree(path, ignore_errors=True)
            said.append(f"removed {path}, left by a process that no longer runs")
        elif alive is None:
            said.append(f"left {path} in place: a temporary of {out} from another host or an older upcycle; "
                        f"remove it by hand if no run is writing it")
    for message in said:
        print(f"[upcycle] {message}", file=sys.stderr)
    return said


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise UpcycleError(f"output {out} already exists (pass --overwrite to replace it)")


def check_output_location(out: str | os.PathLike, *, inputs: tuple[str | os.PathLike | None, ...] = (),
                          overwrite: bool = False) -> Path:
    """Refuse an OUT that replacing could destroy what the user gave us: an input (model folder, data file,
    recipe) or a folder holding one, the current directory or a folder above it, an existing file where a
    folder goes; and an existing OUT without `overwrite`. Nothing is touched here."""
    out = Path(out).expanduser()
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, resolved):
        raise UpcycleError(f"output {out} is the current directory or holds it; choose a new folder for OUT")
    for given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        src = Path(given).expanduser().resolve()
        if _inside(src, resolved):
            raise UpcycleError(f"output {out} is, or holds, the input {given}; replacing it would delete the input."
                               " Choose another folder for OUT")
    if out.exists() and not out.is_dir():
        raise UpcycleError(f"output {out} exists and is not a folder")
    refuse_existing(out, overwrite)
    check_writable_output(out)          # a read-only or impossible OUT is found now, not after the work
    return out


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, *, overwrite: bool = False):
    """Yield a temporary directory that becomes `out` only if the block finishes without an exception.

    The temporary is a sibling named after its owner (`temp_prefix`), so a run killed with SIGKILL leaves a
    folder that the next run of the same OUT recognizes and removes (`clean_stale_temporaries`)."""
    out = Path(out)
    refuse_existing(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        _default_permissions(tmp)
    except BaseException:          # KeyboardInterrupt and SystemExit too: never leave a partial folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_directory(tmp, out)


def replace_directory(new: Path, out: Path) -> None:
    """Put folder `new` at `out`: a rename, with the previous `out` moved aside first and removed after."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
        os.replace(out, old / "previous")
        os.replace(new, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, out)


def _default_permissions(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; give the output the permissions of a plain mkdir."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def moe_spec(model: nn.Module) -> dict:
    """Everything `load` needs to rebuild the model's MoE layers."""
    return {"format": "upcycle", "format_version": FORMAT_VERSION, "model_class": type(model).__name__,
            # the block that holds each layer (install() takes the block; the layer sits at block.mlp etc.)
            "layers": [{"block": path.rsplit(".", 1)[0], **layer.spec()} for path, layer in moe_layers(model).items()]}


def save(model: nn.Module, directory: str | os.PathLike, *, tokenizer=None) -> None:
    """Write the upcycle format into an existing (temporary) directory."""
    directory = Path(directory)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    (directory / MOE_CONFIG).write_text(json.dumps(moe_spec(model), indent=2))
    save_model(model, str(directory / WEIGHTS))
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


# transformers 5 names its generic fast tokenizer "TokenizersBackend", a class transformers 4.x does not have;
# both majors load the same tokenizer.json as PreTrainedTokenizerFast (5.x keeps that name as an alias)
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained`, with a `tokenizer_class` that transformers 4.x and 5.x both load."""
    tokenizer.save_pretrained(directory)
    path = Path(directory) / "tokenizer_config.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") in PORTABLE_TOKENIZER_CLASSES:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES[config["tokenizer_class"]]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _saved_dtype(weights: Path) -> torch.dtype:
    """The dtype most of the saved parameters have (the float32 routers of a bf16 model are the exception)."""
    sizes: dict[str, int] = {}
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            sizes[tensor.get_dtype()] = sizes.get(tensor.get_dtype(), 0) + math.prod(tensor.get_shape())
    name = max(sizes, key=sizes.get) if sizes else "F32"
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(
        name, torch.float32)


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild an upcycled model written by `upcycle convert` (eval mode, padding masks tracked), in the dtype
    its weights were saved in unless `dtype` asks for another."""
    path = Path(path)
    spec_file = path / MOE_CONFIG
    if not spec_file.exists():
        model_type = json.loads((path / "config.json").read_text()).get("model_type") \
            if (path / "config.json").exists() else None
        if model_type in ("qwen2_moe", "qwen3_moe", "mixtral"):
            raise UpcycleError(f"{path} is a stock transformers {model_type} checkpoint (upcycle --export hf): "
                               "load it with transformers.AutoModelForCausalLM.from_pretrained")
        raise UpcycleError(f"{path} is not an upcycle checkpoint (no {MOE_CONFIG})")
    spec = json.loads(spec_file.read_text())
    if spec.get("format_version") != FORMAT_VERSION:
        raise UpcycleError(f"{path}: format version {spec.get('format_version')} is not {FORMAT_VERSION}")
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, spec["model_class"], None)
    if cls is None:
        raise UpcycleError(f"{path}: transformers has no class {spec['model_class']}")
    # built in the dtype it was saved in (or the one asked for), so a bf16 checkpoint stays bf16 and no weight
    # is rounded twice; routers stay float32 in any dtype (MoELayer)
    model = cls._from_config(config, dtype=dtype or _saved_dtype(path / WEIGHTS))
    for layer_spec in spec["layers"]:
        layer_spec = dict(layer_spec)
        block = layer_spec.pop("block")
        install(model, block, MoELayer(**layer_spec, dtype=model.dtype))
    missing, unexpected = load_model(model, str(path / WEIGHTS), strict=False)
    if missing or unexpected:
        raise UpcycleError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    model.tie_weights()
    track_padding_masks(model)
    return model.eval()



def check_writable_output(out: str | os.PathLike) -> None:
    """Refuse an OUT that `atomic_directory` could not create, before any work is done: a parent path that runs
    through a file, a folder without write permission, a read-only or virtual file system (/proc).

    The writer creates OUT's missing parents and a temporary sibling of OUT, so what must be writable is the
    nearest folder on the way up that exists. It is probed by creating and removing an empty temporary folder
    there (permission bits alone miss read-only mounts, /proc, and the superuser who ignores them), so the check
    leaves nothing behind."""
    out = Path(out).absolute()
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UpcycleError(f"cannot write output {out}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UpcycleError(f"cannot write output {out}: no permission to create files in {base}")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.write-check-", dir=base)
    except OSError as e:
        raise UpcycleError(f"cannot write output {out}: a folder cannot be created in {base} "
                           f"({e.strerror or e})") from None
    os.rmdir(probe)
