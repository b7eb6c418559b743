"""One place that loads every kind of model folder `upcycle` is given, and says what kind of model it is.

  dense folder / hub id / 'default' / 'minilm'   -> `load_dense` (config first, so a missing model or an
                                                    unsupported architecture fails before any weight is read)
  upcycle folder (upcycle_config.json)           -> `upcycle.checkpoint.upcycle_format.load`
  stock MoE checkpoint (`--export hf`)           -> transformers' own class, as it is (`upcycle.core.stock_moe`)

`load_model` picks among them for `train` and `eval` (which task a model then trains on is
`upcycle.tasks.kind`'s question); `check_sequence_length` refuses rows longer than a learned position table.

A model folder from someone else is data, never code, and never a way out of itself: every transformers load
here passes `trust_remote_code=False` (a folder whose config asks for its own Python is refused, whatever stdin
answers), reads safetensors only (no pickle), and `check_model_folder` refuses a weight index naming files outside
the folder before transformers reads it. A model is whole or refused: missing, unexpected or mis-shaped tensors
and non-finite weights are errors naming the tensors, never freshly initialised weights (`checked_weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn

from ..config import STORAGE_DTYPES
from ..core.architectures import family_of, find_family
from ..core.stock_moe import is_stock_moe
from ..core.surgery import track_padding_masks
from ..data.assets import DEFAULT_MODEL_NAMES
from ..data.model_names import resolve_model_name
from ..errors import UpcycleError
from ..files import read_json_file
from .agreement import check_dense_checkpoint
from .config_sizes import check_config_sizes
from .reader import INDEX_FILE, SINGLE_FILE, check_finite, check_index
from .sentence_modules import read_sentence_modules
from .upcycle_format import MOE_CONFIG
from .upcycle_format import load as load_upcycled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(DTYPES) == STORAGE_DTYPES, "the config's dtype choices are these dtypes"


def resolve_dtype(setting: str, config) -> str:
    """The dtype name a conversion uses: `setting` itself, or for "auto" the dtype the checkpoint's config
    states (`dtype`, or `torch_dtype` as transformers 4 writes it), float32 when it states none we store."""
    if setting != "auto":
        return setting
    # transformers 5 reads a config.json's `torch_dtype` into `dtype`; its `torch_dtype` property only warns that
    # it is deprecated, so it is not read (vars: an object that stores `torch_dtype` itself)
    stated = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    name = str(stated).removeprefix("torch.") if stated is not None else None
    return name if name in DTYPES else "float32"


def check_model_folder(folder: str | Path) -> None:
    """Refuse a local model folder transformers should not be let into: a config.json that is not a regular
    file, or a weight index that names files outside the folder. Hub ids (no folder here) pass."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    config = folder / "config.json"
    if config.exists() and not config.is_file():
        raise UpcycleError(f"{config} is not a regular file")
    if config.is_file():
        _refuse_own_code(folder, config)
    if (folder / INDEX_FILE).exists():
        check_index(folder)


def _refuse_own_code(folder: Path, config: Path) -> None:
    """A config whose model type transformers does not know, naming Python of the folder's own (`auto_map`),
    is refused here with the reason; transformers would ask whether to run it. A known type with an `auto_map`
    loads with transformers' own class, and the folder's code is never imported."""

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        data = read_json_file(config, "model's config")
    except UpcycleError as e:
        raise UpcycleError(f"could not load model {str(folder)!r}: {e}") from None
    if not isinstance(data, dict):
        raise UpcycleError(f"could not load model {str(folder)!r}: config.json must be a JSON object")
    check_config_sizes(data, str(folder))
    model_type = data.get("model_type")
    if data.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise UpcycleError(f"could not load model {str(folder)!r}: its type {model_type!r} is not one transformers "
                           f"knows, and config.json's auto_map names Python of the folder's own; upcycle never runs "
                           f"a model folder's code")


def check_weight_files(folder: str | Path) -> None:
    """A local folder's weights must be safetensors: a pickled `pytorch_model.bin` is never read."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file():
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    raise UpcycleError(f"{folder} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})"
                       + (f"; {', '.join(pickles[:3])} would have to be unpickled, which upcycle never does "
                          f"(convert it to safetensors where you trust it)" if pickles else ""))


def auto_config(path: str | Path, name: str | None = None):
    """transformers' AutoConfig of a folder or hub id, never running code the folder ships."""
    check_model_folder(path)
    try:
        return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for unloadable models
        raise UpcycleError(f"could not load model {name or str(path)!r}: {_one_line(e)}") from None


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:400] + " ..."


def checked_weights(model: nn.Module, info: dict, name: str) -> nn.Module:
    """The model transformers loaded, refused when its checkpoint did not fill it exactly (missing, unexpected or
    mis-shaped tensors: transformers would have initialised them at random) or holds NaN/inf."""
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of the wrong shape")):
        names = sorted(str(k) for k in (info.get(key) or ()))
        if names:
            more = ", ..." if len(names) > 4 else ""
            problems.append(f"{len(names)} tensor(s) {what} ({', '.join(names[:4])}{more})")
    if info.get("error_msgs"):
        problems.append("; ".join(map(str, info["error_msgs"]))[:300])
    if problems:
        raise UpcycleError(f"model {name!r} does not match its config: {'; '.join(problems)}. The weights and "
                           f"config.json must describe the same model; nothing is initialised at random")
    for key, tensor in model.state_dict().items():
        check_finite(tensor, key, name)
    return model


def pretrained(cls, path: str | Path, name: str | None = None, **kwargs) -> nn.Module:
    """`cls.from_pretrained(path)`: no code from the folder, safetensors only, and the weights checked whole
    and finite (`checked_weights`)."""
    name = name or str(path)
    check_model_folder(path)
    check_weight_files(path)
    try:
        model, info = cls.from_pretrained(str(path), trust_remote_code=False, use_safetensors=True,
                                          output_loading_info=True, **kwargs)
    except Exception as e:
        raise UpcycleError(f"could not load model {name!r}: {type(e).__name__}: {_one_line(e)}") from None
    return checked_weights(model, info, name)


def dense_config(name: str, *, build: bool = True, wanted_by: str = "convert takes a dense model (train, eval, "
                 "export and analyze take this folder)") -> tuple[str, object]:
    """(resolved path, transformers config) of a dense model, read without its weights: a missing model or an
    unsupported architecture fails here, in a second. `build=False` (a dry run): the embedded model's config is
    read from its GGUF file when its cache is not built, nothing is written and no weight is read."""
    if not build and name in DEFAULT_MODEL_NAMES:
        from ..data.assets import default_model_cache, default_model_config

        config = default_model_config()
        family_of(config)
        return str(default_model_cache()), config
    path = resolve_model_name(name)
    if Path(path).is_dir() and (Path(path) / MOE_CONFIG).is_file():
        raise UpcycleError(f"model {name!r} is an upcycle MoE folder already; {wanted_by}")
    config = auto_config(path, name)
    family_of(config)   # unsupported architectures fail here, before the weights are read
    check_config_sizes(config, name)
    if build:       # a dry run plans from the config alone
        check_dense_checkpoint(path, config, f"model {name!r}")   # headers, and two tied tensors when both stored
    return path, config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model")
# every file a tokenizer folder may hold: what a command that changes only the weights carries over as it is
TOKENIZER_FOLDER_FILES = (*TOKENIZER_FILES, "merges.txt", "added_tokens.json", "special_tokens_map.json",
                          "chat_template.jinja", "chat_template.json")


def load_tokenizer(path: str | Path):
    """The model's tokenizer, with the folder's sentence-transformers modules as `sentence_modules` (None when it
    has none); None when a local folder has no tokenizer files (tiny test models, vision models:
    the probe then uses seeded random ids). Tokenizer files that do not load are an error, not a silent None
    that would turn a text probe into random ids; a tokenizer that asks to run the folder's code is refused."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        if not folder.is_dir():         # a hub id without a tokenizer (or offline): nothing local to report
            return None
        raise UpcycleError(f"{path}: the tokenizer files there do not load ({type(e).__name__}: {_one_line(e)}); "
                           f"fix or remove them") from None
    # sentence-transformers' pooling and normalization travel with the tokenizer (save_tokenizer writes them)
    tokenizer.sentence_modules = read_sentence_modules(folder) if folder.is_dir() else None
    return tokenizer


def dense_weights(name: str, path: str, config, dtype: str = "float32") -> nn.Module:
    """The dense model of `dense_config(name)`, in eval mode."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or getattr(transformers, family_of(config).auto_class)
    return pretrained(cls, path, name, dtype=DTYPES[dtype]).eval()


def load_dense(name: str, dtype: str = "float32") -> tuple[nn.Module, object | None]:
    """A dense model (hub id, local folder, or 'default') and its tokenizer when it has one."""
    path, config = dense_config(name)
    tokenizer = load_tokenizer(path)
    return dense_weights(name, path, config, dtype), tokenizer


def load_model(name: str) -> tuple[nn.Module, object | None]:
    """(model, tokenizer) from an upcycle folder (MoE), a stock MoE checkpoint (`--export hf`: Qwen2-MoE,
    Qwen3-MoE, Mixtral, loaded as it is), or a dense folder / hub id / 'default'."""
    folder = Path(name)
    if folder.is_dir() and (folder / MOE_CONFIG).exists():
        return load_upcycled(name), load_tokenizer(name)
    if folder.is_dir() and (folder / "config.json").is_file():
        config = auto_config(name)
        if is_stock_moe(config):
            return pretrained(transformers.AutoModelForCausalLM, name).eval(), load_tokenizer(name)
    model, tokenizer = load_dense(name)
    track_padding_masks(model)
    return model, tokenizer


def check_sequence_length(model: nn.Module, sequence_length: int) -> None:
    """Refuse rows longer than a learned position table (the architecture row's `position_tables`: GPT-2's `wpe`,
    BERT's `position_embeddings`), which would index past its end; rotary models (Llama, Qwen) have no table and
    may extrapolate, so they are not capped."""
    family = find_family(model.config)
    names = family.position_tables if family is not None else ()
    tables = [m.num_embeddings for name, m in model.named_modules()
              if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in names]
    if tables and sequence_length > min(tables):
        raise UpcycleError(f"sequence_length {sequence_length} is longer than the {min(tables)} positions "
                           f"{type(model).__name__} has; use --sequence-length {min(tables)} or less")
