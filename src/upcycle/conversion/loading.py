"""One place that loads every kind of model folder `upcycle` is given, and says what kind of model it is.

  dense folder / hub id / 'default' / 'minilm'   -> `load_dense` (config first, so a missing model or an
                                                    unsupported architecture fails before any weight is read)
  upcycle folder (upcycle_config.json)           -> `upcycle.conversion.io.load`
  stock MoE checkpoint (`--export hf`)           -> transformers' own class, as it is (`upcycle.core.stock_moe`)

`load_model` picks among them for `train` and `eval`; `task_of` says which task a model trains on, and refuses
models neither task fits (encoders); `check_sequence_length` refuses rows longer than a learned position table.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn

from ..core.architectures import family_of, find_family
from ..core.stock_moe import is_stock_moe
from ..core.surgery import track_padding_masks
from ..data.assets import resolve_model_name
from ..errors import UpcycleError
from .io import MOE_CONFIG
from .io import load as load_upcycled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"


def resolve_dtype(setting: str, config) -> str:
    """The dtype name a conversion uses: `setting` itself, or for "auto" the dtype the checkpoint's config
    states (`dtype`, or `torch_dtype` as transformers 4 writes it), float32 when it states none we store."""
    if setting != "auto":
        return setting
    stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(stated).removeprefix("torch.") if stated is not None else None
    return name if name in DTYPES else "float32"


def resolve_device(setting: str) -> torch.device:
    """The device calibration, the methods' linear algebra and the checks run on: "auto" is the first GPU when
    torch sees one, else the CPU; a GPU that is not there is an error (not a silent CPU run)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except (RuntimeError, TypeError):
        raise UpcycleError(f"device must be one of {DEVICE_CHOICES}, got {setting!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UpcycleError(f"device must be one of {DEVICE_CHOICES}, got {setting!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UpcycleError(f"device {setting!r}: torch sees no CUDA GPU here (torch {torch.__version__}); use "
                               f"--device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UpcycleError(f"device {setting!r}: torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def dense_config(name: str) -> tuple[str, object]:
    """(resolved path, transformers config) of a dense model, read without its weights: a missing model or an
    unsupported architecture fails here, in a second."""
    path = resolve_model_name(name)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for unloadable models
        raise UpcycleError(f"could not load model {name!r}: {e}") from None
    family_of(config)   # unsupported architectures fail here, before the weights are read
    return path, config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                   "spiece.model")


def load_tokenizer(path: str | Path):
    """The model's tokenizer; None when a local folder has no tokenizer files (tiny test models, vision models:
    the probe then uses seeded random ids). Tokenizer files that do not load are an error, not a silent None
    that would turn a text probe into random ids."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:
        if not folder.is_dir():         # a hub id without a tokenizer (or offline): nothing local to report
            return None
        raise UpcycleError(f"{path}: the tokenizer files there do not load ({type(e).__name__}: {e}); fix or "
                           f"remove them") from None


def dense_weights(name: str, path: str, config, dtype: str = "float32") -> nn.Module:
    """The dense model of `dense_config(name)`, in eval mode."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or getattr(transformers, family_of(config).auto_class)
    try:
        model = cls.from_pretrained(path, dtype=DTYPES[dtype])
    except Exception as e:
        raise UpcycleError(f"could not load model {name!r}: {e}") from None
    return model.eval()


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
        try:
            model = load_upcycled(name)
        except UpcycleError:
            raise
        except Exception as e:      # a truncated or corrupt weights file, a config that does not build
            raise UpcycleError(f"could not load the upcycle folder {name}: {type(e).__name__}: {e}") from None
        return model, load_tokenizer(name)
    if folder.is_dir() and (folder / "config.json").is_file():
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except Exception as e:
            raise UpcycleError(f"could not read the config of {name}: {e}") from None
        if is_stock_moe(config):
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(name)
            except Exception as e:
                raise UpcycleError(f"could not load {name}: {type(e).__name__}: {e}") from None
            return model.eval(), load_tokenizer(name)
    model, tokenizer = load_dense(name)
    track_padding_masks(model)
    return model, tokenizer


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the model predicts the next token: a class of transformers' causal-LM table, and for families that
    attend both ways (BERT's LM-head class; `bidirectional` in the architecture table) only when configured as a
    decoder, since otherwise `labels = input_ids` would be an identity task."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if type(model).__name__ not in names:
        return False
    family = find_family(model.config)      # None for stock MoE checkpoints: decoders
    return family is None or not family.bidirectional or bool(getattr(model.config, "is_decoder", False))


def task_of(model: nn.Module, requested: str | None = None) -> str:
    """The task a model trains on: the one its architecture row names for its type (CLIP models: contrastive),
    else next tokens for causal LMs; anything else (a BERT encoder, a masked-LM head) is refused rather than
    trained on a task that means nothing for it."""
    family = find_family(model.config)
    kind = family.task_of(model.config) if family is not None else None
    if kind is None and is_causal_lm(model):
        kind = "causal_lm"
    if kind is None:
        raise UpcycleError(f"{type(model).__name__} ({model.config.model_type}) is not a causal language model or "
                           f"CLIP: `upcycle train` and `upcycle eval` know next-token prediction and CLIP's "
                           f"contrastive task; masked-LM training and pseudo-perplexity are not implemented, and "
                           f"next-token training of an encoder that sees the whole sequence would be meaningless")
    if requested is not None and requested != kind:
        raise UpcycleError(f"task {requested!r} does not fit a {type(model).__name__} (its task is {kind!r})")
    return kind


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
