"""transformers' Auto classes read upcycle folders: model type "upcycle" registered with AutoConfig, AutoModel
and AutoModelForCausalLM, each loading through `upcycle.load`.

An upcycle folder's config.json has model type "upcycle" (checkpoint/upcycle_format.py says why). Registered,
`AutoModelForCausalLM.from_pretrained(folder)` returns exactly the model `upcycle.load(folder)` returns (the base
model's own class, MoE layers installed, weights checked whole); unregistered, transformers refuses the folder as a
model type it does not know. No code of the folder's own is ever run: the classes are this module's.

`register()` is called by `import upcycle` (through `auto_registration.py`) as soon as transformers' Auto model
module is imported, in whichever order the two are imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from ..errors import UpcycleError
from .folder_type import FOLDER_MODEL_TYPE


class UpcycleConfig(PreTrainedConfig):
    """config.json of an upcycle folder: the base model's config under `base_config`, and the format version."""

    model_type = FOLDER_MODEL_TYPE

    def __init__(self, base_config: dict | None = None, upcycle_format_version: int = 2, **kwargs) -> None:
        self.base_config = dict(base_config or {})
        self.upcycle_format_version = upcycle_format_version
        super().__init__(**kwargs)


# from_pretrained arguments that change nothing for a local upcycle folder (hub arguments are used to fetch it)
_HUB_ARGUMENTS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")
_HARMLESS = ("trust_remote_code", "adapter_kwargs", "_commit_hash", "code_revision", "use_safetensors",
             "low_cpu_mem_usage", "_from_auto", "_from_pipeline", "attn_implementation", "offload_folder",
             "offload_buffers", "weights_only", "resume_download", "mirror", "local_rank")
# from_pretrained arguments upcycle cannot honour (the whole model loads, checked, on one device): accepted at the
# values that ask for nothing, which clients pass as defaults (lm-eval's `hf` model passes gguf_file,
# quantization_config and max_memory as None), refused at any other
_ONLY_AS_DEFAULT = {"gguf_file": (None,), "quantization_config": (None,), "max_memory": (None,),
                    "load_in_8bit": (False, None), "load_in_4bit": (False, None), "tp_plan": (None,),
                    "tp_size": (None,), "device_mesh": (None,), "key_mapping": (None,), "variant": (None,),
                    "state_dict": (None,), "from_tf": (False,), "from_flax": (False,),
                    "ignore_mismatched_sizes": (False,), "distributed_config": (None,), "generation_config": (None,),
                    "offload_state_dict": (False, None), "use_kernels": (False,)}


def _names(table: dict) -> set[str]:
    return {name for value in table.values() for name in ((value,) if isinstance(value, str) else value)}


def _folder(path: str | os.PathLike, hub: dict) -> Path:
    """A local folder, or the snapshot of a hub repository holding an upcycle folder (only its JSON, safetensors
    and tokenizer files are fetched)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    hub = {k: v for k, v in hub.items() if k in ("revision", "cache_dir", "token", "local_files_only",
                                                   "force_download", "proxies")}
    return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"], **hub))


def _dtype(value) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UpcycleError(f"dtype {value!r} is not a torch dtype")
    return dtype


class _UpcycleLoader:
    """Registered in an Auto class's table for UpcycleConfig; `from_pretrained` is `upcycle.load`."""

    config_class = UpcycleConfig
    auto_class = "AutoModel"
    accepted: set[str] = set()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *model_args, config=None, dtype=None, torch_dtype=None,
                        device_map=None, output_loading_info: bool = False, **kwargs):
        from .save_load import load

        unknown = sorted(k for k in kwargs if k not in _HUB_ARGUMENTS + _HARMLESS + tuple(_ONLY_AS_DEFAULT))
        if model_args or unknown:
            raise UpcycleError(f"{cls.auto_class}.from_pretrained of an upcycle folder takes transformers' "
                               f"arguments; not {', '.join(unknown) or 'positional model arguments'}")
        asked = [f"{k}={kwargs[k]!r:.60}" for k, fine in _ONLY_AS_DEFAULT.items()
                 if k in kwargs and not any(kwargs[k] is v or kwargs[k] == v for v in fine)]
        if asked:
            raise UpcycleError(f"{cls.auto_class}.from_pretrained of an upcycle folder loads the whole model, "
                               f"checked, on one device; it cannot honour {', '.join(asked)}")
        if kwargs.get("subfolder"):
            path = Path(path) / kwargs["subfolder"]
        folder = _folder(path, kwargs)
        model = load(folder, dtype=_dtype(dtype if dtype is not None else torch_dtype))
        if type(model).__name__ not in cls.accepted:
            raise UpcycleError(f"{folder} holds a {type(model).__name__}, which {cls.auto_class} does not "
                               f"give; load it with upcycle.load(folder)")
        if device_map is not None:
            if isinstance(device_map, dict):        # {"": device}: the whole model on one device (lm-eval's)
                if set(device_map) != {""}:
                    raise UpcycleError("device_map placing parts of the model on several devices is not supported "
                                       "for upcycle folders; give one device (or {'': device})")
                device_map = device_map[""]
            device = ("cuda" if torch.cuda.is_available() else "cpu") if device_map == "auto" else device_map
            model = model.to(device)
        if output_loading_info:     # load() refuses anything missing, unexpected or mis-shaped
            return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return model


class UpcycleForCausalLM(_UpcycleLoader):
    auto_class = "AutoModelForCausalLM"
    accepted = _names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class UpcycleModel(_UpcycleLoader):
    auto_class = "AutoModel"
    accepted = _names(MODEL_MAPPING_NAMES)       # base classes (BertModel, CLIPModel), not the LM heads


def register() -> None:
    """Register model type "upcycle" with AutoConfig, AutoModel and AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(FOLDER_MODEL_TYPE, UpcycleConfig, exist_ok=True)
    AutoModelForCausalLM.register(UpcycleConfig, UpcycleForCausalLM, exist_ok=True)
    AutoModel.register(UpcycleConfig, UpcycleModel, exist_ok=True)

