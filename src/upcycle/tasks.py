"""Training tasks: how a model and a data source become batches, a task loss and an evaluation.

- causal_lm: next-token cross-entropy on packed documents (`data.pack_documents`), padding masked; evaluated by
  held-out perplexity.
- clip: symmetric InfoNCE with CLIP's learned temperature, L = (L_I->T + L_T->I) / 2 (METHODS §3), computed by
  transformers' CLIPModel over the batch; evaluated by zero-shot classification and retrieval. The two towers are
  separate backbones, so each MoE layer sees one modality and its router losses are per modality (CLIP-UP).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn

from .config import TrainConfig
from .data import PackedBatches, SeededBatches, pack_documents
from .errors import UpcycleError
from .evaluate import clip_metrics, perplexity
from .io import MOE_CONFIG
from .io import load as load_upcycled
from .objective import causal_lm_loss
from .pairs import encode_captions, load_pairs, pixel_values
from .stock_moe import is_stock_moe

TASKS = ("causal_lm", "clip")


def _tokenizer_of(folder: str):
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception:
        return None


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
        return model, _tokenizer_of(name)
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
            return model.eval(), _tokenizer_of(name)
    from .convert import load_dense
    from .surgery import track_padding_masks

    model, tokenizer = load_dense(name)
    track_padding_masks(model)
    return model, tokenizer


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the model predicts the next token: a class of transformers' causal-LM table, and for encoder
    families (BERT's LM-head class) only when configured as a decoder, since otherwise it attends both ways and
    `labels = input_ids` would be an identity task."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if type(model).__name__ not in names:
        return False
    return getattr(model.config, "model_type", None) not in ("bert",) or bool(getattr(model.config, "is_decoder",
                                                                                       False))


def task_of(model: nn.Module, requested: str | None = None) -> str:
    """The task a model trains on: CLIP models contrastively, causal LMs on next tokens; anything else (a BERT
    encoder, a masked-LM head) is refused rather than trained on a task that means nothing for it."""
    if getattr(model.config, "model_type", None) == "clip":
        kind = "clip"
    elif is_causal_lm(model):
        kind = "causal_lm"
    else:
        raise UpcycleError(f"{type(model).__name__} ({model.config.model_type}) is not a causal language model or "
                           f"CLIP: `upcycle train` and `upcycle eval` know next-token prediction and CLIP's "
                           f"contrastive task; masked-LM training and pseudo-perplexity are not implemented, and "
                           f"next-token training of an encoder that sees the whole sequence would be meaningless")
    if requested is not None and requested != kind:
        raise UpcycleError(f"task {requested!r} does not fit a {type(model).__name__} (its task is {kind!r})")
    return kind


class CausalLMTask:
    name = "causal_lm"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer, *, is_default: bool) -> None:
        if tokenizer is None:
            raise UpcycleError("causal-LM training needs the model's tokenizer (none found next to the model)")
        check_sequence_length(model, cfg.sequence_length)
        train_texts, eval_texts = self.texts(cfg, is_default)
        ids, mask = pack_documents(tokenizer, train_texts, cfg.sequence_length)
        self.train = PackedBatches(ids, mask, cfg.batch_size, cfg.seed)
        self.eval_rows = None
        if eval_texts:
            ids, mask = pack_documents(tokenizer, eval_texts, cfg.sequence_length)
            rows = max(1, cfg.eval_tokens // cfg.sequence_length)
            self.eval_rows = (ids[:rows], mask[:rows])

    @staticmethod
    def texts(cfg: TrainConfig, is_default: bool) -> tuple[list[str], list[str] | None]:
        from .text import read_texts, wikipedia_split

        def read(path: str, what: str) -> list[str]:
            if Path(path).is_dir():
                raise UpcycleError(f"{what}: {path} is a folder; give a .txt or .jsonl file")
            try:
                return read_texts(path)
            except (OSError, ValueError) as e:       # missing, unreadable, binary (UnicodeDecodeError), bad JSON
                raise UpcycleError(f"{what}: {e}") from None

        wiki = None
        if cfg.data is None or cfg.eval_data is None:
            if is_default:
                wiki = wikipedia_split()
        if cfg.data is None and wiki is None:
            raise UpcycleError("give training text with --data FILE (.txt or .jsonl with a \"text\" field)")
        train = read(cfg.data, "data") if cfg.data is not None else wiki[0]
        held = read(cfg.eval_data, "eval_data") if cfg.eval_data is not None else (wiki[1] if wiki else None)
        return train, held

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    @staticmethod
    def tokens(batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def evaluate(self, model: nn.Module) -> dict | None:
        if self.eval_rows is None:
            return None
        return perplexity(model, *self.eval_rows, batch_size=8)


class CLIPTask:
    name = "clip"

    def __init__(self, cfg: TrainConfig, model: nn.Module, tokenizer) -> None:
        if tokenizer is None:
            raise UpcycleError("CLIP training needs the model's caption tokenizer (none found next to the model; "
                               "`upcycle tiny-clip` writes one)")
        self.tokenizer = tokenizer
        self.max_length = model.config.text_config.max_position_embeddings
        self.image_size = model.config.vision_config.image_size
        self.patches = (self.image_size // model.config.vision_config.patch_size) ** 2 + 1
        train = load_pairs(cfg.data, split="train")
        self.train = SeededBatches(self.encode(train), cfg.batch_size, cfg.seed)
        self.held = None
        if cfg.eval_data is not None or cfg.data in (None, "digits"):
            self.held = load_pairs(cfg.eval_data if cfg.eval_data is not None else cfg.data, split="heldout")

    def encode(self, pairs) -> dict[str, torch.Tensor]:
        return {**encode_captions(self.tokenizer, pairs.captions, self.max_length),
                "pixel_values": pixel_values(pairs.images, self.image_size)}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(**batch, return_loss=True).loss

    def tokens(self, batch: dict) -> int:
        """Text tokens plus image patches (+ class token) that went through the towers."""
        return int(batch["attention_mask"].sum()) + batch["pixel_values"].shape[0] * self.patches

    def evaluate(self, model: nn.Module) -> dict | None:
        if self.held is None:
            return None
        return clip_metrics(model, self.tokenizer, self.held, batch_size=256)


def from_embedded_model(name: str) -> bool:
    """Whether `name` is the embedded SmolLM2 or a folder converted from it (its run_config.yaml says so), so
    that the embedded Wikipedia corpus is its default text."""
    from .assets import DEFAULT_MODEL_NAMES

    if name in DEFAULT_MODEL_NAMES:
        return True
    run_config = Path(name) / "run_config.yaml"
    if not run_config.is_file():
        return False
    import yaml

    try:
        saved = yaml.safe_load(run_config.read_text()) or {}
    except yaml.YAMLError:
        return False
    return isinstance(saved, dict) and saved.get("model") in DEFAULT_MODEL_NAMES


def make_task(cfg: TrainConfig, model: nn.Module, tokenizer):
    kind = task_of(model, cfg.task)
    if kind == "clip":
        return CLIPTask(cfg, model, tokenizer)
    return CausalLMTask(cfg, model, tokenizer, is_default=from_embedded_model(cfg.model))


def check_sequence_length(model: nn.Module, sequence_length: int) -> None:
    """Refuse rows longer than a learned position table (GPT-2's `wpe`, `position_embeddings`), which would
    index past its end; rotary models (Llama, Qwen) have no table and may extrapolate, so they are not capped."""
    tables = [m.num_embeddings for name, m in model.named_modules()
              if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in ("wpe", "position_embeddings")]
    if tables and sequence_length > min(tables):
        raise UpcycleError(f"sequence_length {sequence_length} is longer than the {min(tables)} positions "
                           f"{type(model).__name__} has; use --sequence-length {min(tables)} or less")
